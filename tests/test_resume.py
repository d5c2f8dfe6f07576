"""A worker's checkpoints through the wrapper: periodic saves, resume, fallback past damage, refusal
of another model's checkpoint, and training that goes on when a save fails."""

from __future__ import annotations

import pytest
import torch
from test_streaming import H, _net, _step
from test_swarm_inproc import _batches

from diloco import DiLoCo, StreamingConfig
from diloco.checkpoint import CheckpointError, list_checkpoints

SPARSE = "topk:16/64+s2+ef:0.9"  # with error feedback: the residual must survive a restart too


def _train(tmp_path, rounds: int, **kw) -> DiLoCo:
    model = _net(7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with DiLoCo(model, opt, inner_steps=H, compression=SPARSE, checkpoint_dir=tmp_path, checkpoint_every=1,
                streaming=StreamingConfig(fragments=2), **kw) as d:
        for b in _batches(8, rounds * H // 2):  # 2 fragments: a round every H/2 steps
            _step(model, opt, b)
    return d


def _fresh(tmp_path) -> DiLoCo:
    model = _net(99)  # another initialization: resume must replace it
    return DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), inner_steps=H, compression=SPARSE,
                  checkpoint_dir=tmp_path, streaming=StreamingConfig(fragments=2))


def test_periodic_checkpoints_resume_to_the_same_state(tmp_path):
    d = _train(tmp_path, rounds=4)
    assert d.round == 4 and len(list_checkpoints(tmp_path)) == 3  # keep=3 newest
    e = _fresh(tmp_path)
    assert e.resume()
    assert e.round == 4 and e.digest == d.digest and e.steps == d.steps
    assert e.schedule_position == d.schedule_position
    assert e.residuals is not None and d.residuals is not None and len(e.residuals) == len(d.residuals) > 0
    for a, b in zip(e.residuals, d.residuals):
        assert torch.equal(a, b) and torch.count_nonzero(b) > 0
    for p, g in zip(e.model.parameters(), d.state.params):  # the model continues from θ
        assert torch.equal(p.detach(), g)


def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path, caplog):
    d = _train(tmp_path, rounds=3)
    newest = list_checkpoints(tmp_path)[0]
    data = bytearray((newest / "tensors.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (newest / "tensors.safetensors").write_bytes(bytes(data))
    e = _fresh(tmp_path)
    assert e.resume()
    assert e.round == 2 and e.digest != d.digest  # the previous round's state, verified
    assert "checkpoint_skipped" in caplog.text


def test_another_models_checkpoint_is_refused(tmp_path):
    _train(tmp_path, rounds=1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 1))
    other = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), inner_steps=H, compression=SPARSE)
    with pytest.raises(CheckpointError, match="another model"):
        other.resume(tmp_path)


def test_nothing_to_resume_from(tmp_path):
    assert not _fresh(tmp_path / "empty").resume()


def test_a_failed_save_is_logged_and_training_goes_on(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    d = _train(blocker, rounds=2)
    assert d.round == 2  # trained through both rounds
    assert "checkpoint_failed" in caplog.text
