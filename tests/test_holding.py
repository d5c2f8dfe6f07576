"""The worker's state (diloco.holding) and what a synchronization no longer does on the training thread: the
digest is hashed beside training (the same digest; a record says "" until it is known, and goes out once it is),
a lone worker's fp32 round encodes nothing, Δ is formed in the same memory every slot, and the outer Nesterov step
runs in its foreach form, bit for bit."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from diloco import DiLoCo
from diloco.accounting import Accounting
from diloco.holding import Holding
from diloco.member import Member
from diloco.sitelink import SiteLink
from diloco.outer import nesterov, outer_step
from diloco.state import GlobalState

pytestmark = pytest.mark.unit


def _state(seed: int = 0) -> GlobalState:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(300, 70, generator=g), torch.randn(1000, generator=g)]
    state = GlobalState(params, nesterov())
    outer_step(state.outer, state.params, torch.randn(22000, generator=g), 1.0)  # momentum in the state too
    state.round = 3
    return state


def test_the_digest_held_is_the_state_hashed_in_place_and_follows_every_change():
    state = _state()
    expected = state.manifest().digest
    held = Holding(state, nesterov(), torch.device("cpu"))
    assert held.digest == expected and held.manifest.digest == expected
    with held.changing() as s:
        s.params[1].add_(1.0)
        s.round += 1
    assert held.digest == s.manifest().digest != expected
    assert list(held.recent) == [(3, expected), (4, held.digest)]


class _Gate:
    """A manifest function that hashes only when let go (`release`), counting how many hashes are running."""

    def __init__(self) -> None:
        self.go, self.started = threading.Event(), threading.Event()
        self.running, self.most = 0, 0

    def __call__(self, state: GlobalState):
        self.running += 1
        self.most = max(self.most, self.running)
        self.started.set()
        assert self.go.wait(10)
        try:
            return state.manifest()
        finally:
            self.running -= 1

    def release(self) -> None:
        self.go.set()


def test_the_digest_is_hashed_beside_training_and_waited_for_only_where_it_is_needed():
    state, gate = _state(), _Gate()
    gate.release()  # the first state's hash
    held = Holding(state, nesterov(), torch.device("cpu"), manifest_of=gate, background=True)
    first = held.digest
    known: list[str] = []
    told = threading.Event()
    held.on_known(lambda: known.append(held.known()))
    held.on_known(told.set)  # after the one above
    gate.go.clear()
    gate.started.clear()
    with held.changing() as s:
        s.params[0].mul_(2.0)
        s.round += 1
    assert gate.started.wait(10)  # the change returned while its hash is under way
    assert held.known() == "" and held.record() == (4, "", ((3, first),))  # a record says "": not known yet

    waited: list[str] = []
    waiter = threading.Thread(target=lambda: waited.append(held.digest))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not known  # whoever needs the digest waits for it
    gate.release()
    waiter.join(10)
    assert told.wait(10)  # the listeners run on the hashing thread after it woke the waiters
    assert waited == [s.manifest().digest] == known and held.record() == (4, known[0], ((3, first), (4, known[0])))


def test_a_change_waits_for_the_hash_in_flight_which_reads_the_state_in_place():
    gate = _Gate()
    held = Holding(_state(), nesterov(), torch.device("cpu"), manifest_of=gate, background=True)
    changed = threading.Event()

    def change() -> None:
        with held.changing() as s:
            s.params[1].zero_()
        changed.set()

    assert gate.started.wait(10)
    t = threading.Thread(target=change)
    t.start()
    assert not changed.wait(0.3)  # the first hash is still reading θ
    gate.release()
    t.join(10)
    assert changed.is_set() and gate.most == 1
    assert held.digest == held.state.manifest().digest


def test_a_hash_that_fails_is_raised_to_whoever_waits_for_the_digest(monkeypatch):
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the hashing thread's own report

    def broken(state: GlobalState):
        raise OSError("disk on fire")

    held = Holding(_state(), nesterov(), torch.device("cpu"), manifest_of=broken, background=True)
    with pytest.raises(OSError, match="disk on fire"):
        held.digest
    assert held.known() == ""


class _Board:
    """A swarm stand-in that keeps our record and counts the publications that go out at once."""

    def __init__(self) -> None:
        self.record: dict[str, Any] = {}
        self.sent: list[dict[str, Any]] = []

    def update(self, *, now: bool = True, **fields: Any) -> None:
        self.record.update(fields)
        if now:
            self.sent.append(dict(self.record))

    def bytes_on_wire(self) -> tuple[int, int]:
        return 0, 0


def test_a_record_published_while_the_digest_is_hashed_goes_out_once_it_is_known():
    gate = _Gate()
    gate.release()
    held = Holding(_state(), nesterov(), torch.device("cpu"), manifest_of=gate, background=True)
    member = Member(held, lambda: [], SiteLink(None, None), Accounting(), schema="s", period=lambda: 4)
    board = _Board()
    member.swarm = board  # type: ignore[assignment]
    held.digest
    member.publish("training")
    assert [r["digest"] for r in board.sent] == [held.digest]  # known: at once, as before
    gate.go.clear()
    with held.changing() as s:
        s.round += 1
    member.publish("training")
    assert board.record["digest"] == "" and board.record["round"] == 4 and len(board.sent) == 1  # owed, not sent
    gate.release()
    held.digest
    for _ in range(200):  # the hashing thread publishes after it let the waiters go
        if len(board.sent) == 2:
            break
        threading.Event().wait(0.05)
    assert [(r["round"], r["digest"]) for r in board.sent] == [(3, board.sent[0]["digest"]), (4, held.digest)]
    assert board.sent[1]["recent"] == held.record()[2] and board.sent[1]["status"] == "training"


def test_foreach_nesterov_steps_bit_for_bit_like_the_loop_over_tensors():
    g = torch.Generator().manual_seed(5)
    params = [torch.randn(257, 33, generator=g), torch.randn(4099, generator=g)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(4)]
    out = {}
    for foreach in (False, True):
        theta = [p.clone() for p in params]
        opt = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True, foreach=foreach)
        for step in grads:
            for t, d in zip(theta, step):
                t.grad = d.clone()
            opt.step()
        out[foreach] = theta
    assert all(torch.equal(a, b) for a, b in zip(out[False], out[True]))
    assert nesterov()([torch.zeros(1)]).defaults["foreach"] is True


def _lone(monkeypatch=None, **kw) -> tuple[DiLoCo, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return DiLoCo(model, opt, swarm=None, inner_steps=2, **kw), model, opt


def _train(d: DiLoCo, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 8) -> None:
    g = torch.Generator().manual_seed(1)
    with d:
        for _ in range(steps):
            loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()


def test_a_lone_fp32_round_encodes_nothing_and_forms_delta_in_the_same_memory(monkeypatch):
    d, model, opt = _lone()
    buffers = set()
    real = d.engine._buffer

    def seen(frag):
        out = real(frag)
        buffers.add(out.data_ptr())
        return out

    monkeypatch.setattr(d.engine, "_buffer", seen)
    monkeypatch.setattr(d.engine.local_pipeline, "encode", lambda *_: pytest.fail("a lone fp32 round encoded Δ"))
    _train(d, model, opt)
    assert d.round == 4 and len(buffers) == 1
    assert {r.bits_per_param for r in d.reports} == {32.0}  # what the codec would have sent

    plain, model2, opt2 = _lone()  # the same run, Δ freshly allocated every slot: the same state, bit for bit
    monkeypatch.setattr(plain.engine, "_buffer", lambda frag: None)
    _train(plain, model2, opt2)
    assert plain.digest == d.digest


def test_a_lone_lossy_round_still_goes_through_its_codec():
    d, model, opt = _lone(compression="q8")
    _train(d, model, opt)
    assert d.round == 4 and all(0 < r.bits_per_param < 10 for r in d.reports)


def test_a_fragments_outer_step_hashes_again_only_the_chunks_that_hold_that_fragment(monkeypatch):
    """Streaming: each round steps one fragment's θ and momentum. The manifest after it, hashing again only the
    chunks that hold those bytes, equals the whole state hashed anew, round after round, including the first
    steps (the momentum appears: another layout, all hashed) and a parameter that spans several chunks."""
    import diloco.state as state_mod

    g = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=g) for n in (300_000, 70, 5_000, 1_300_000, 10)]  # 1.2 MB and 5.2 MB tensors
    held = Holding(GlobalState(params, nesterov()), nesterov(), torch.device("cpu"))
    fragments = [(0, 2, 4), (1, 3)]
    again: list[list[int]] = []
    real = state_mod._chunks_of
    monkeypatch.setattr(state_mod, "_chunks_of", lambda *a: again.append(real(*a)) or again[-1])
    for rnd in range(6):
        frag = fragments[rnd % 2]
        with held.changing(touched=frag) as s:
            outer_step(s.outer, [s.params[i] for i in frag],
                       torch.randn(sum(s.params[i].numel() for i in frag), generator=g), 1.0)
            s.round += 1
        assert held.digest == s.manifest().digest, rnd  # (a whole manifest: no previous given)
    # rounds 1 and 2 add each fragment's momentum (a new layout: every chunk); then only the fragment's chunks
    assert len(again) == 4 and again[0] == again[2] and again[1] == again[3], again
    assert len(held.manifest.hashes) == 4 and all(len(a) < 4 for a in again[::2]), again
    with held.changing() as s:  # a change of everything (a download, a merge) hashes everything
        s.params[1].add_(1.0)
    assert held.digest == s.manifest().digest and len(again) == 4
