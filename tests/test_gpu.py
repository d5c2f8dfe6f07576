"""The CUDA path, on a GPU: `make test-gpu`.

`make test` needs no GPU and leaves these out (marker `gpu`); on a machine without CUDA they fail, they
do not skip. They check what a model on a GPU relies on: θ and the outer state in pinned host memory
(or on the GPU with `global_device`), the model holding θ exactly after a synchronization, codecs given
GPU tensors writing the same bytes as for host tensors, bf16 models, and real swarms of GPU peers (the
bundled job with `--device cuda`, and the user's script under the launcher).
"""

from __future__ import annotations

import sys

import pytest
import torch

import diloco.compression.pipeline as pipeline_module
from diloco import DiLoCo
from diloco.bench.codecs import DEFAULT_SPECS, DEFAULT_PIPELINE
from diloco.bench.transfer import TransferSetup
from diloco.bench.transfer import run as transfer_run
from diloco.compression.pipeline import Pipeline
from diloco.job.model import GPTConfig
from multiproc_util import TINY, Peers
from test_launcher import SCRIPT, Sites

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA GPU (torch.cuda.is_available() is False); `make test` runs the rest")


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(CUDA, dtype)


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = 0.3 * torch.linspace(-1, 1, 16)
    out = []
    for _ in range(n):
        x = torch.randn(32, 16, generator=g)
        out.append((x.to(CUDA), torch.sin(x @ w).unsqueeze(1).to(CUDA)))
    return out


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]],
           autocast: bool = False) -> float:
    loss = torch.tensor(float("nan"))
    for x, y in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(x.to(next(model.parameters()).dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss.detach())


def test_a_gpu_model_keeps_theta_and_the_outer_state_in_pinned_host_memory_and_holds_theta_after_a_sync():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = _batches(40)
    with DiLoCo(model, opt, swarm=None, inner_steps=10) as d:
        assert all(p.device.type == "cpu" and p.is_pinned() for p in d.state.params)
        first = _train(model, opt, data[:10])
        last = _train(model, opt, data[10:])
        assert d.round == 4
        assert all(p.device == CUDA for p in model.parameters())  # the model never left the GPU
        for p, theta in zip(model.parameters(), d.state.params):  # α = 0: the model continues from θ, exactly
            assert torch.equal(p.detach().cpu(), theta)
        outer = [v for s in d.state.outer.state.values() for v in s.values() if torch.is_tensor(v)]
        assert outer and all(v.device.type == "cpu" for v in outer)  # host-only arithmetic: no need to pin
    assert last < first


def test_global_device_cuda_keeps_theta_on_the_gpu_and_steps_it_to_the_same_bits_as_host_memory():
    """Peers of one swarm may choose differently: their global states must not fork over it."""
    data = _batches(30)
    states = {}
    for where in ("cpu", "cuda"):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        with DiLoCo(model, opt, swarm=None, inner_steps=10, global_device=where) as d:
            assert {p.device.type for p in d.state.params} == {where}
            _train(model, opt, data)
            assert d.round == 3
            states[where] = ([p.detach().cpu() for p in d.state.params], d.digest)
    for host, gpu in zip(states["cpu"][0], states["cuda"][0]):
        assert torch.equal(host, gpu), (host - gpu).abs().max()
    assert states["cpu"][1] == states["cuda"][1]


def test_a_bf16_model_and_bf16_autocast_train_on_the_gpu_against_an_fp32_theta():
    for dtype, autocast in ((torch.bfloat16, False), (torch.float32, True)):
        model = _model(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = _batches(40)
        with DiLoCo(model, opt, swarm=None, inner_steps=10) as d:
            first = _train(model, opt, data[:10], autocast)
            last = _train(model, opt, data[10:], autocast)
            assert d.round == 4 and all(p.dtype == torch.float32 for p in d.state.params)
            for p, theta in zip(model.parameters(), d.state.params):
                assert torch.equal(p.detach().cpu(), theta.to(dtype))
        assert last < first, (dtype, autocast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codecs_write_the_same_bytes_for_a_gpu_tensor_as_for_its_host_copy(monkeypatch, dtype):
    monkeypatch.setattr(pipeline_module.os, "urandom", lambda n: bytes(range(1, n + 1)))  # rand-k's seed, fixed
    x = torch.randn((1 << 20) + 123, generator=torch.Generator().manual_seed(0)).to(dtype)
    on_gpu = x.to(CUDA)
    for spec in (*DEFAULT_SPECS, DEFAULT_PIPELINE):
        pipe = Pipeline(spec)
        assert pipe.encode(on_gpu) == pipe.encode(x), spec


def test_bench_transfer_measures_the_moves_of_a_sync_on_the_gpu_and_labels_it():
    report = transfer_run(TransferSetup(GPTConfig(d_model=64, n_layer=2), device="cuda", repeats=2))
    assert "(cuda:0)" in report["device"] and torch.cuda.get_device_name(0) in report["device"]
    where = {(r["what"].split(" (")[0], r["theta"]) for r in report["rows"]}
    assert where == {("Δ to host", "pageable host memory"), ("θ to device", "pageable host memory"),
                     ("Δ to host", "pinned host memory"), ("θ to device", "pinned host memory"),
                     ("Δ on device", "cuda:0")}
    assert all(r["ms"] > 0 and r["bytes"] == 4 * report["params"] for r in report["rows"])


@pytest.fixture
def peers(tmp_path):
    group = Peers(tmp_path, run_id=f"gpu-{tmp_path.name[-6:]}")
    yield group
    group.kill_all()


@pytest.mark.timeout(240)
def test_two_peers_of_the_bundled_job_train_on_the_gpu_to_one_digest(peers):
    common = ["--rounds", "3", "-H", "5", "--wait-for", "2", "--device", "cuda", *TINY]
    first = peers.spawn(0, ["start", *common])
    second = peers.spawn(1, ["join", peers.address(0), *common])
    for i, p in enumerate([first, second]):
        assert peers.wait(p, 180) == 0, peers.log(i)
    finals = [peers.lines(i, "final")[-1] for i in range(2)]
    assert {f["round"] for f in finals} == {3} and {f["device"] for f in finals} == {"cuda:0"}, finals
    assert len({f["digest"] for f in finals}) == 1, finals


@pytest.fixture
def sites(tmp_path):
    group = Sites(tmp_path)
    yield group
    group.kill_all()


@pytest.mark.timeout(240)
def test_your_script_on_the_gpu_under_the_launcher_trains_to_one_digest(sites):
    rounds = [sys.executable, SCRIPT, "--device", "cuda", "--rounds", "3", "--inner-steps", "5"]
    sites.launch(0, ["start", "--wait-for", "2"], rounds)
    sites.launch(1, ["join", sites.address(0), "--wait-for", "2"], rounds)
    for i, proc in sites.procs.items():
        assert proc.wait(timeout=180) == 0, sites.log(i)
    finals = [sites.lines(i, "final")[-1] for i in range(2)]
    assert {f["round"] for f in finals} == {3} and len({f["digest"] for f in finals}) == 1, finals
