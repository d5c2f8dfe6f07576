"""Getting the trained model out: `DiLoCo.save_final` (the global model, tied weights included) and `diloco
export` (a run's newest checkpoint as a plain state dict). Both load with `load_state_dict(strict=True)`."""

from __future__ import annotations

import pytest
import torch
from cli_util import invoke
from safetensors.torch import load_file

from diloco import DiLoCo
from diloco.checkpoint import CheckpointError
from diloco.persist import export

pytestmark = pytest.mark.unit


class Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight (as GPT-2's wte and lm_head), and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.wte(x)))) * self.scale


def _trained(tmp_path, rounds: int = 3) -> DiLoCo:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with DiLoCo(model, opt, inner_steps=4, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1) as d:
        while d.round < rounds:
            x = torch.randint(0, 11, (8, 5), generator=g)
            torch.nn.functional.cross_entropy(model(x).reshape(-1, 11), x.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        for _ in range(2):  # steps past the last round: the model's own weights are not the global ones now
            x = torch.randint(0, 11, (8, 5), generator=g)
            torch.nn.functional.cross_entropy(model(x).reshape(-1, 11), x.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
    return d


def _global(d: DiLoCo) -> dict[str, torch.Tensor]:
    with d.global_weights():
        return {k: v.clone() for k, v in d.model.state_dict().items()}


def test_save_final_writes_the_global_model_with_its_tied_weights(tmp_path):
    d = _trained(tmp_path)
    path = d.save_final(tmp_path / "final.safetensors")
    fresh = Tied()
    fresh.load_state_dict(load_file(str(path)), strict=True)
    expected = _global(d)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
    assert fresh.head.weight is fresh.wte.weight  # still tied
    assert not torch.equal(d.model.mid.weight, expected["mid.weight"])  # the model itself moved on locally


def test_export_turns_the_newest_checkpoint_into_a_plain_state_dict(tmp_path):
    d = _trained(tmp_path)
    out, loaded = export(tmp_path / "ckpt", tmp_path / "model.safetensors")
    assert loaded.step == 3
    state = load_file(str(out))
    assert set(state) == {"wte.weight", "mid.weight", "mid.bias", "head.weight"}  # the tied name too, no buffer
    fresh = Tied()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert missing == ["scale"] and unexpected == []
    expected = _global(d)
    assert all(torch.equal(fresh.state_dict()[k], expected[k]) for k in state)
    result = invoke(["export", str(tmp_path / "ckpt"), str(tmp_path / "cli.safetensors")])
    assert result.exit_code == 0 and "the global model of round 3" in result.output, result.output
    assert all(torch.equal(load_file(str(tmp_path / "cli.safetensors"))[k], v) for k, v in state.items())


def test_export_without_a_checkpoint_says_what_to_give(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no verified checkpoint under"):
        export(tmp_path / "empty", tmp_path / "x.safetensors")
    result = invoke(["export", str(tmp_path / "nowhere"), str(tmp_path / "x.safetensors")])
    assert result.exit_code == 2 and "no such checkpoint directory" in result.output


def test_the_bundled_job_saves_its_final_global_model(tmp_path):
    """`diloco start/join --save-final PATH`: the bundled job writes the global model at its end, which the same
    model loads strictly (tied embedding and head, buffers)."""
    from diloco.job.model import GPTConfig, build_model
    from diloco.job.train import JobConfig, run_job

    job = JobConfig(rounds=2, inner_steps=3, d_model=16, n_layer=1, context=16, batch_size=2, eval_batches=1,
                    corpus_bytes=1 << 20, save_final=str(tmp_path / "final.safetensors"))
    summary = run_job(job, None)
    assert summary["saved"] == job.save_final and summary["round"] == 2
    model = build_model(GPTConfig(context=16, d_model=16, n_layer=1), seed=job.seed)
    model.load_state_dict(load_file(job.save_final), strict=True)
