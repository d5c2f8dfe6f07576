"""The CUDA path, on a GPU: `make test-gpu`.

`make test` needs no GPU and leaves these out (marker `gpu`); on a machine without CUDA they fail, they
do not skip. They check what a model on a GPU relies on: θ and the outer state in pinned host memory
(or on the GPU with `global_device`), the model holding θ exactly after a synchronization, codecs given
GPU tensors writing the same bytes as for host tensors, bf16 models, a Trainer and an accelerate loop in
bf16, and real swarms of GPU peers (the bundled job with `--device cuda`, and the user's script under the
launcher).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import diloco.compression.pipeline as pipeline_module
import diloco.outer as outer_module
from diloco import DiLoCo
from diloco.bench.codecs import DEFAULT_SPECS, DEFAULT_PIPELINE
from diloco.bench.transfer import TransferSetup
from diloco.bench.transfer import run as transfer_run
from diloco.compression.indexcode import INDEX_CODECS
from diloco.compression.pipeline import Pipeline
from diloco.compression.sparse import ChunkSpec, topk_select
from diloco.fragments import StreamingConfig
from diloco.job.model import GPTConfig
from diloco.outer import copy_into, pseudo_gradient, pseudo_gradient_pieces
from multiproc_util import TINY, Peers
from test_launcher import SCRIPT, Sites
from test_sparse import fuzz_case, outcome

# hf_trainer (transformers' GPT-2 and Llama: 2.3 CPU-s to import) is imported by the tests that use it, not by every
# pytest worker that collects this module
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("piece", [1 << 22, 1000])
def test_delta_from_the_gpu_and_theta_back_are_exact_and_land_before_the_host_reads_them(dtype, piece, monkeypatch):
    """`pseudo_gradient` and its pieces form Δ on the GPU (θ crossing there a piece at a time: `outer.PIECE`) and
    wait once; `copy_into` likewise: the results are exactly the host arithmetic's, also right after a long kernel
    still writing the parameters, and θ is left as it was."""
    monkeypatch.setattr(outer_module, "PIECE", piece)
    g = torch.Generator().manual_seed(3)
    shapes = [(1000, 700), (700,), (5, 3), (4097,)]
    theta = [torch.randn(s, generator=g).pin_memory() for s in shapes]
    host_local = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    local = [p.to(CUDA) for p in host_local]
    big = torch.randn(4096, 4096, device=CUDA)
    for _ in range(20):  # keep the GPU busy, then change the parameters at the end of its queue
        big = (big @ big).tanh_()  # bounded: the parameters stay finite
    for p in local:
        p.add_(big[0, 0] * 0)
    expected = torch.cat([(t - p.float()).reshape(-1) for t, p in zip(theta, host_local)])
    before = [t.clone() for t in theta]
    delta = pseudo_gradient(theta, local)
    assert delta.device.type == "cpu" and delta.is_pinned() and torch.equal(delta, expected)
    assert all(torch.equal(t, b) for t, b in zip(theta, before))
    pieces = pseudo_gradient_pieces(theta, local, piece=1000)
    assert torch.equal(torch.cat(pieces), expected) and all(x.is_pinned() for x in pieces)
    copy_into(local, theta)
    assert all(torch.equal(p.cpu(), t.to(dtype)) for p, t in zip(local, theta))
    back = [torch.empty_like(t) for t in theta]
    copy_into(back, [p.float() for p in local])
    assert all(torch.equal(b, t.to(dtype).float()) for b, t in zip(back, theta))


def test_theta_is_pinned_again_after_a_resume_and_a_cpu_model_leaves_it_unpinned(tmp_path):
    """A resumed (or downloaded) state arrives in ordinary host memory: a GPU model's wrapper pins it again,
    same digest; a CPU model's θ is never pinned, CUDA or not."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with DiLoCo(model, opt, swarm=None, inner_steps=5, checkpoint_dir=tmp_path) as d:
        _train(model, opt, _batches(10))
        assert d.save_checkpoint() is not None
    again = _model()
    with DiLoCo(again, torch.optim.AdamW(again.parameters(), lr=3e-3), swarm=None, inner_steps=5,
                checkpoint_dir=tmp_path) as resumed:
        assert resumed.resume() and resumed.digest == d.digest
        assert all(p.is_pinned() for p in resumed.state.params)
        assert all(torch.equal(p.detach().cpu(), t) for p, t in zip(again.parameters(), resumed.state.params))
    on_cpu = _model().cpu()
    with DiLoCo(on_cpu, torch.optim.AdamW(on_cpu.parameters()), swarm=None, inner_steps=5) as lone:
        assert not any(p.is_pinned() for p in lone.state.params)


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


def test_a_state_on_the_gpu_is_hashed_beside_training_after_the_outer_step_it_follows():
    """The digest's copies of θ go on a stream of their own: they must wait for the outer step queued before them
    (else the hash could read θ half stepped), round after round."""
    digests = {}
    for where in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024)).to(CUDA)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        seen = []
        with DiLoCo(model, opt, swarm=None, inner_steps=2, global_device=where) as d:
            for k in range(8):
                model(torch.ones(4, 1024, device=CUDA)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if k % 2 == 1:
                    seen.append(d.digest)
        digests[where] = seen
    assert digests["cpu"] == digests["cuda"] and len(set(digests["cpu"])) == 4


@pytest.mark.parametrize("options", [
    dict(compression="topk:64/4096+s2+ef:0.95"),
    dict(streaming=StreamingConfig(overlap=1, alpha=0.5)),
    dict(streaming=StreamingConfig(outer_overlap="eager")),
    dict(streaming=StreamingConfig(outer_overlap="delayed")),
], ids=["sparse-ef", "overlap-alpha", "eager", "delayed"])
def test_global_device_cuda_steps_like_host_memory_with_error_feedback_and_overlap(options):
    data = _batches(30)
    thetas = {}
    for where in ("cpu", "cuda"):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        with DiLoCo(model, opt, swarm=None, inner_steps=10, global_device=where, **options) as d:
            _train(model, opt, data)
        assert d.round >= 2, options
        thetas[where] = [p.detach().cpu() for p in d.state.params]
    for host, gpu in zip(thetas["cpu"], thetas["cuda"]):
        assert torch.equal(host, gpu), (options, (host - gpu).abs().max())


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


def test_a_trainer_in_bf16_on_the_gpu_with_the_callback_is_a_diloco_worker(tmp_path):
    from hf_trainer import Counting
    from hf_trainer import build as build_hf
    from transformers import Trainer, TrainingArguments

    from diloco.hf import DiLoCoCallback

    callback = DiLoCoCallback(inner_steps=5)
    model = build_hf("gpt2")
    trainer = Trainer(model=model, train_dataset=Counting(512, 0), callbacks=[callback],
                      args=TrainingArguments(output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=8,
                                             learning_rate=3e-3, report_to=[], save_strategy="no", bf16=True,
                                             logging_steps=5, disable_tqdm=True))
    trainer.train()
    d = callback.diloco
    assert d is not None and d.round == 4 and all(r.committed for r in d.reports)
    assert next(model.parameters()).device.type == "cuda"
    assert all(p.device.type == "cpu" and p.is_pinned() for p in d.state.params)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0], losses


def test_an_accelerate_loop_in_bf16_on_the_gpu_with_the_wrapper():
    from accelerate import Accelerator
    from hf_trainer import Counting
    from hf_trainer import build as build_hf

    accelerator = Accelerator(mixed_precision="bf16")
    model = build_hf("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(Counting(256, 1), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    first = None
    with DiLoCo(model, optimizer, inner_steps=4) as d:
        for batch in loader:  # 32 steps
            loss = model(**batch).loss
            first = first if first is not None else loss.item()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    assert d.steps == 32 and d.round == 8 and next(model.parameters()).device.type == "cuda"
    assert loss.item() < first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codecs_write_the_same_bytes_for_a_gpu_tensor_as_for_its_host_copy_and_decode_them_there(monkeypatch, dtype):
    """Encoded on the GPU (only the bytes cross), decoded onto the GPU: the bytes and values of the host. `s4`/`s2`
    sum their statistics in float64 in another order there, which would change a bin or a centroid only if a sum
    fell within its float64 rounding of an fp32 boundary."""
    monkeypatch.setattr(pipeline_module.os, "urandom", lambda n: bytes(range(1, n + 1)))  # rand-k's seed, fixed
    n = (1 << 20) + 123
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype)
    on_gpu = x.to(CUDA)
    for spec in (*DEFAULT_SPECS, DEFAULT_PIPELINE):
        pipe = Pipeline(spec)
        payload = pipe.encode(on_gpu)
        assert isinstance(payload, bytes) and payload == pipe.encode(x), spec
        decoded = pipe.decode(payload, n, CUDA).dense(n)
        assert decoded.device == CUDA and torch.equal(decoded.cpu(), pipe.decode(payload, n).dense(n)), spec
        # as the swarm encodes a span: the same bytes; a dense one is the pinned memory they crossed into
        sent = pipe.encode_parts([on_gpu])
        assert bytes(sent) == payload, spec
        if pipe.spec.sparsifier is None and not pipe.spec.zstd:
            assert isinstance(sent, memoryview) and sent.readonly, spec
            with warnings.catch_warnings():  # read-only: the tensor over it is only asked where it lives
                warnings.simplefilter("ignore", UserWarning)
                assert torch.frombuffer(sent, dtype=torch.uint8).is_pinned(), spec


@pytest.mark.parametrize("name", ["rice", "idx12"])
def test_index_codecs_decode_on_the_gpu_to_the_hosts_indices_or_the_hosts_verdict(name):
    """A top-k selection's indices decode where the values go: valid payloads to the host's indices, on the GPU;
    mutated ones (test_sparse's fuzzer, 300 cases) to the same indices or the same rejection as on the host."""
    codec, verdicts = INDEX_CODECS[name], []
    for seed in range(300):
        case = fuzz_case(name, seed)[1:]
        host = outcome(codec, *case)
        assert outcome(codec, *case, CUDA) == host, seed
        verdicts.append(isinstance(host, list))
    assert 10 < sum(verdicts) < 290  # both outcomes exercised
    numel, spec = 1 << 20, ChunkSpec(64, 4096)
    indices = topk_select(torch.randn(numel, generator=torch.Generator().manual_seed(1)), spec)
    decoded = codec.decode(codec.encode(indices.to(CUDA), numel, spec), numel, spec, CUDA)
    assert decoded.device == CUDA and torch.equal(decoded.cpu(), indices)


def test_bench_transfer_measures_the_moves_of_a_sync_on_the_gpu_and_labels_it():
    report = transfer_run(TransferSetup(GPTConfig(d_model=64, n_layer=2), device="cuda", repeats=2))
    assert "(cuda:0)" in report["device"] and torch.cuda.get_device_name(0) in report["device"]
    where = {(r["what"].split(" (")[0], r["theta"]) for r in report["rows"]}
    assert where == {("Δ to host", "host memory"), ("θ to device", "pageable host memory"),
                     ("θ to device", "pinned host memory"), ("Δ on device", "cuda:0")}
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
