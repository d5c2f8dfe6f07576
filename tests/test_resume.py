"""A worker's checkpoints through the wrapper: periodic saves, resume, fallback past damage, refusal
of another model's checkpoint, and training that goes on when a save fails."""

from __future__ import annotations

import shutil
import time

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
    assert e.round == 4 and e.digest == d.digest and e.steps == d.steps and e.swarm_step == d.swarm_step
    assert e.schedule_position == d.schedule_position
    assert e.residuals is not None and d.residuals is not None and len(e.residuals) == len(d.residuals) > 0
    for a, b in zip(e.residuals, d.residuals):
        assert torch.equal(a, b) and torch.count_nonzero(b) > 0
    for p, g in zip(e.model.parameters(), d.state.params):  # the model continues from θ
        assert torch.equal(p.detach(), g)


def test_a_resumed_joiner_keeps_the_swarms_step(tmp_path):
    """A worker that joined late counts the swarm's step (its source's steps and its own); its checkpoint keeps
    it, so a restart continues the swarm's schedule, not the worker's own count."""
    d = _fresh(tmp_path)
    d.member.standing.offset = 1000  # as if it had downloaded a state 1,000 steps into the swarm
    assert d.swarm_step == 1000
    d.member.standing.steps = 7
    d.save_checkpoint()
    e = _fresh(tmp_path)
    assert e.resume() and (e.steps, e.swarm_step) == (7, 1007)


def test_a_peer_restarted_under_its_peer_id_keeps_its_last_rounds_members_as_its_quorum_base(tmp_path):
    """Resumed under the same peer id (`--identity`), a peer needs a strict majority of its last committed round's
    members to commit again, as before the restart; without them two restarted members that could not see each
    other each committed the next round alone (two states for one round, found by `diloco bench chaos`). Under
    another peer id it was never a member of that round: no quorum base until it catches up."""
    from types import SimpleNamespace

    d = _fresh(tmp_path)
    d.member.standing.members = ("peer-a", "peer-b", "peer-c")
    d.save_checkpoint()
    for me, members in (("peer-b", ("peer-a", "peer-b", "peer-c")), ("peer-z", None)):
        e = _fresh(tmp_path)
        # what resume reads of a swarm, and the record update its state's digest publishes (on a thread)
        e.member.swarm = SimpleNamespace(peer_id=me, moved_to=lambda rnd: None, update=lambda **fields: None)
        assert e.resume() and e.member.standing.members == members, me


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


def test_a_periodic_checkpoint_is_written_beside_training_and_the_next_round_waits_for_it(tmp_path, monkeypatch):
    """The write of round 1's checkpoint is held back: training goes on through the next inner step, the round
    after waits for the write (it would change the state the write reads in place), and the checkpoint holds
    round 1's state, residuals and digest."""
    import threading

    from diloco import persist

    gate, writing = threading.Event(), threading.Event()
    real = persist.write

    def held_back(*args, **kwargs):
        writing.set()
        assert gate.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(persist, "write", held_back)
    model = _net(7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps: list[int] = []
    seen: dict[str, object] = {}
    d = DiLoCo(model, opt, inner_steps=2, compression=SPARSE, checkpoint_dir=tmp_path, checkpoint_every=1)

    def train() -> None:
        with d:
            for i, b in enumerate(_batches(8, 4)):
                _step(model, opt, b)
                if d.round == 1 and "digest" not in seen:
                    seen["digest"], seen["residuals"] = d.digest, [r.clone() for r in d.residuals]
                steps.append(i)

    t = threading.Thread(target=train)
    t.start()
    assert writing.wait(20)
    deadline = time.monotonic() + 20
    while len(steps) < 3 and time.monotonic() < deadline:  # step 3 is no slot: it does not wait for the write
        time.sleep(0.02)
    time.sleep(0.3)
    assert steps == [0, 1, 2], steps  # step 4's round waits for the write
    gate.set()
    t.join(20)
    assert steps == [0, 1, 2, 3] and d.round == 2
    newest = list_checkpoints(tmp_path)[0]
    assert newest.name.endswith("2")
    shutil.rmtree(newest)  # round 2's (written when it was due): round 1's is the one written beside training
    loaded = persist.read(tmp_path, [p.detach() for p in d.state.params], d.member.holding.outer_factory,
                          None, d.member.schema)
    assert loaded is not None
    state, _, meta = loaded
    assert state.round == 1 and state.digest() == seen["digest"] == meta.meta["digest"]
    residuals = meta.tensors  # the residuals as they were at round 1, not as round 2 left them
    kept = [torch.from_numpy(residuals[f"ef/{i}"].copy()) for i in range(len(seen["residuals"]))]
    assert all(torch.equal(a, b) for a, b in zip(kept, seen["residuals"]))
    assert not all(torch.equal(a, b) for a, b in zip(kept, d.residuals))
