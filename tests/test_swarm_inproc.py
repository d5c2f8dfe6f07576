"""The full wrapper (`DiLoCo` + `Swarm.in_process`) with several peers in one process.

Each peer trains in its own thread on a shared in-process network, board and event loop. Models
are built in the test thread (torch's global RNG is shared by threads), and a barrier after
attaching makes sure no peer starts its first round alone.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import zlib
import time
from dataclasses import replace
from typing import Callable

import pytest
import torch

import diloco
from diloco import DiLoCo
from diloco.catchup import fetch_state
from diloco.comms import InProcNetwork, RoundKey
from diloco.comms.faults import NO_FAULTS, Faults
from diloco.comms.loop import LoopThread
from diloco.outer import nesterov
from diloco.peers import InProcBoard
from diloco.state import GlobalState
from diloco.statesync import Snapshot

pytestmark = pytest.mark.swarm

H = 3
CFG = diloco.SwarmConfig(run_id="inproc", heartbeat_interval=0.1, heartbeat_ttl=2,
                         round=diloco.CollectiveConfig(gather_timeout=3, reduce_timeout=1, result_timeout=2, call_timeout=1))
PATIENT = replace(CFG, heartbeat_ttl=10).with_round(gather_timeout=20, reduce_timeout=10, result_timeout=15, call_timeout=5)
"""Deadlines far beyond a loaded machine's stalls, for tests where no deadline may decide a round (CFG's 1-3 s were
passed by rounds of busy fresh-clone suites)."""


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))


def _batches(seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(16, 6, generator=g)
        out.append((x, x[:, :3].sum(1, keepdim=True)))
    return out


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches) -> None:
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


class Harness:
    """One in-process swarm: network, board, event loop; closes every peer it made."""

    def __init__(self, cfg: diloco.SwarmConfig = CFG) -> None:
        self.cfg = cfg
        self.net, self.board, self.loop = InProcNetwork(), InProcBoard(), LoopThread()
        self.swarms: list[diloco.Swarm] = []
        self._lock = threading.Lock()

    def swarm(self, name: str, *, bootstrapped: bool = False, faults: Faults | None = None) -> diloco.Swarm:
        s = diloco.Swarm.in_process(self.net, self.board, name, self.cfg, self.loop, bootstrapped=bootstrapped,
                                    faults=faults or NO_FAULTS)
        with self._lock:
            self.swarms.append(s)
        return s

    def forget(self, swarm: diloco.Swarm) -> None:
        """`swarm` was closed by its owner: drop it (a harness of many short-lived peers must not hold them)."""
        with self._lock:
            self.swarms.remove(swarm)

    def close(self) -> None:
        for s in self.swarms:
            s.close()
        self.loop.stop()


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


@pytest.fixture
def patient():
    """A harness whose rounds no deadline decides (`PATIENT`): for tests where every round must commit."""
    h = Harness(PATIENT)
    yield h
    h.close()


def _worker_on(cfg: diloco.SwarmConfig, **kw: object) -> None:
    """Build a `DiLoCo` worker (`kw`: its settings) on a lone in-process peer of a swarm with `cfg`, then tear
    both down: for settings a topology refuses when the worker is built."""
    h = Harness(cfg)
    try:
        model = _mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        DiLoCo(model, opt, swarm=h.swarm("p"), inner_steps=4, **kw)  # type: ignore[arg-type]
    finally:
        h.close()


def _run_threads(targets: list[Callable[[], None]], barriers: list[threading.Barrier]) -> None:
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
                errors.append(e)
                for b in barriers:
                    b.abort()
        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    assert not any(t.is_alive() for t in threads), "a peer thread hung"
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------- three peers, four rounds


def test_three_peers_four_rounds_end_identical(patient):
    rounds, M = 4, 3
    base = _mlp(0)
    models = [copy.deepcopy(base) for _ in range(M)]
    data = [_batches(i, rounds * H) for i in range(M)]
    start = threading.Barrier(M, timeout=10)
    out: dict[int, DiLoCo] = {}

    def peer(i):
        def run():
            model = models[i]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            with DiLoCo(model, opt, swarm=patient.swarm(f"peer{i}"), inner_steps=H) as d:
                start.wait()
                _train(model, opt, data[i])
            out[i] = d
        return run

    _run_threads([peer(i) for i in range(M)], [start])

    ds = [out[i] for i in range(M)]
    assert {d.round for d in ds} == {rounds}
    assert len({d.digest for d in ds}) == 1
    for d in ds:
        assert [(r.round, r.committed, r.peers, r.resynced) for r in d.reports] == [
            (k + 1, True, M, False) for k in range(rounds)
        ], d.reports
        assert all(r.bytes_sent > 0 for r in d.reports)
        assert d.steps == rounds * H
    # identical global state, loaded into every model, which moved away from the initialization
    for d in ds[1:]:
        for p, q in zip(d.state.params, ds[0].state.params):
            assert torch.equal(p, q)
    for i in range(M):
        for p, g in zip(models[i].parameters(), ds[0].state.params):
            assert torch.equal(p.detach(), g)
    assert max((p - b).abs().max().item() for p, b in zip(models[0].parameters(), base.parameters())) > 1e-2
    # and the board shows all of them training at round 4 with that digest
    records = {r.peer: r for r in ds[0].swarm.records()}
    assert {(records[f"peer{i}"].round, records[f"peer{i}"].digest) for i in range(M)} == {(rounds, ds[0].digest)}


# ---------------------------------------------------------------------- a peer joins a running swarm


def test_late_joiner_downloads_state_and_ends_identical(patient):
    """Three peers commit rounds 1 and 2; a fourth (bootstrapped, own initialization) attaches,
    downloads the round-2 state, and all four commit rounds 3 and 4 together.

    Ordering: the old peers start their third round only once the joiner has sent its first ready
    message. (The other order, where a ready reaches the joiner before it caught up and is refused as
    "too far ahead", is covered by test_collective's
    test_a_ready_refused_while_catching_up_is_answered_by_the_reply_to_ours.)
    """
    M = 3
    base = _mlp(0)
    models = [copy.deepcopy(base) for _ in range(M)]
    joiner_model = _mlp(1)  # its own, different initialization: it must not be used
    joiner_init = [p.detach().clone() for p in joiner_model.parameters()]
    data = [_batches(i, 4 * H) for i in range(M + 1)]
    start = threading.Barrier(M, timeout=60)
    mid = threading.Barrier(M + 1, timeout=60)   # the first M peers are at round 2
    go = threading.Barrier(M + 1, timeout=60)    # the joiner has attached
    joiner_in_round = threading.Event()          # the joiner sent its first ready message
    out: dict[str, object] = {}

    def peer(i):
        def run():
            model = models[i]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            with DiLoCo(model, opt, swarm=patient.swarm(f"peer{i}"), inner_steps=H) as d:
                start.wait()
                _train(model, opt, data[i][: 2 * H])
                out[f"mid{i}"] = (d.round, d.digest, [p.clone() for p in d.state.params])
                mid.wait()
                go.wait()
                assert joiner_in_round.wait(10)
                _train(model, opt, data[i][2 * H :])
            out[i] = d
        return run

    def joiner():
        mid.wait()
        opt = torch.optim.AdamW(joiner_model.parameters(), lr=1e-2)
        swarm = patient.swarm("peer9", bootstrapped=True)
        call = swarm.transport.call

        async def call_and_tell(peer, name, payload, timeout):
            if name == "diloco.ready":
                joiner_in_round.set()
            return await call(peer, name, payload, timeout)

        swarm.transport.call = call_and_tell
        d = DiLoCo(joiner_model, opt, swarm=swarm, inner_steps=H, join_timeout=5)
        out["joiner_before"] = d.digest
        with d:
            out["joiner_attached"] = (d.round, d.digest, [p.detach().clone() for p in joiner_model.parameters()],
                                      len(d.reports))
            out["joiner_steps"] = (d.steps, d.swarm_step, d.data_shard)
            go.wait()
            _train(joiner_model, opt, data[M][: 2 * H])
        out["joiner"] = d

    _run_threads([peer(i) for i in range(M)] + [joiner], [start, mid, go])

    mids = {out[f"mid{i}"][:2] for i in range(M)}
    assert len(mids) == 1
    (swarm_round, swarm_digest), = mids
    assert swarm_round == 2
    swarm_params = out["mid0"][2]

    # the joiner adopted the swarm's state on attach, before its first step
    assert out["joiner_before"] != swarm_digest
    rnd, digest, params, n_reports = out["joiner_attached"]
    assert (rnd, digest, n_reports) == (2, swarm_digest, 0)
    for p, g, own in zip(params, swarm_params, joiner_init):
        assert torch.equal(p, g)
        assert not torch.equal(p, own)
    # it continues the swarm's step (a schedule set from it goes on where the swarm's is), with data of its own
    assert out["joiner_steps"] == (0, 2 * H, zlib.crc32(b"peer9") % 100_000), out["joiner_steps"]

    # then all four took part in rounds 3 and 4 and ended identical
    ds: list[DiLoCo] = [out[i] for i in range(M)] + [out["joiner"]]
    assert {d.round for d in ds} == {4}
    assert len({d.digest for d in ds}) == 1
    for d in ds[:M]:
        assert [(r.round, r.committed, r.peers) for r in d.reports] == [(1, True, 3), (2, True, 3),
                                                                     (3, True, 4), (4, True, 4)], d.reports
    assert [(r.round, r.committed, r.peers, r.resynced) for r in out["joiner"].reports] == [
        (3, True, 4, False), (4, True, 4, False)]
    for p, q in zip(out["joiner"].state.params, ds[0].state.params):
        assert torch.equal(p, q)
    assert {d.swarm_step for d in ds} == {4 * H} and out["joiner"].steps == 2 * H
    assert len({d.data_shard for d in ds}) == M + 1


def test_a_joiner_gets_in_while_the_swarm_commits_rounds_faster_than_a_download(harness):
    """A lone peer commits a round every few milliseconds (H=1, a tiny model), faster than a joiner can
    read its record and ask for the state it advertises, which is gone by then. The holder hears the
    joiner asking for state and gives it a grace in its next rounds, so the joiner downloads a state that
    is still current and then commits rounds with the holder, on the holder's digests."""
    holder_model, joiner_model = _mlp(0), _mlp(1)
    batches = _batches(0, 1)
    started, stop = threading.Event(), threading.Event()
    digests: dict[str, dict[int, str]] = {"holder": {}, "joiner": {}}
    out: dict[str, DiLoCo] = {}

    def wrap(name: str, model: torch.nn.Module, **kw) -> DiLoCo:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        swarm = harness.swarm(name, bootstrapped=name != "holder")
        if name == "joiner":  # its link is slow: every call it makes takes 30 ms more
            call = swarm.transport.call

            async def slow_call(peer, method, payload, timeout):
                await asyncio.sleep(0.03)
                return await call(peer, method, payload, timeout)

            swarm.transport.call = slow_call
        d = DiLoCo(model, opt, swarm=swarm, inner_steps=1,
                   on_round=lambda r: digests[name].__setitem__(r.round, d.digest) if r.committed else None, **kw)
        out[name] = d
        return d

    def holder():
        with wrap("holder", holder_model) as d:
            started.set()
            while not stop.is_set():
                _train(holder_model, d.optimizer, batches)

    def joiner():
        assert started.wait(5)
        deadline = time.monotonic() + 5
        while out["holder"].round < 50:  # the holder is well under way, a round every few milliseconds
            assert time.monotonic() < deadline, "the holder does not commit rounds"
            time.sleep(0.01)
        try:
            with wrap("joiner", joiner_model, join_timeout=5) as d:
                deadline = time.monotonic() + 10
                while not any(r.committed and r.peers == 2 for r in d.reports):
                    assert time.monotonic() < deadline, [(r.round, r.reason) for r in d.reports[-5:]]
                    _train(joiner_model, d.optimizer, batches)
        finally:
            stop.set()

    _run_threads([holder, joiner], [])
    h, j = out["holder"], out["joiner"]
    together = [r.round for r in j.reports if r.committed and r.peers == 2]
    assert any(r.round == together[0] and r.committed and r.peers == 2 for r in h.reports), h.reports[-5:]
    assert all(digests["holder"][n] == digests["joiner"][n] for n in together), (together, digests)


# ---------------------------------------------------------------------- a peer serves forged state


@pytest.mark.parametrize("forgery", ["chunks_differ_from_the_manifest", "manifest_of_another_state"])
def test_joiner_rejects_state_that_does_not_match_the_digest(harness, monkeypatch, forgery):
    """peer0 advertises its real digest in its record but serves another state: that state's bytes under
    the real manifest, or that state's own manifest under the real digest. The joiner must refuse it,
    keep its own state, and report the failed resync; the honest state is then adopted."""
    model0 = _mlp(0)
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.05)
    d0 = DiLoCo(model0, opt0, swarm=harness.swarm("peer0"), inner_steps=H)
    honest = d0.member.server.serve

    def forged(digest: str) -> Snapshot | None:
        real = honest(digest)
        if real is None:
            return None
        fake = GlobalState(d0.state.params, nesterov())
        fake.load_bytes(d0.state.to_bytes())
        with torch.no_grad():
            fake.params[0].add_(0.5)
        assert fake.digest() != digest
        manifest = real.manifest if forgery == "chunks_differ_from_the_manifest" else fake.manifest()
        return Snapshot(real.round, manifest, [t for _, t in fake.layout()[0]], real.info)

    monkeypatch.setattr(d0.member.server, "serve", forged)
    with d0:
        _train(model0, opt0, _batches(0, H))  # one round, alone
    assert d0.round == 1 and d0.reports[-1].committed

    model1 = _mlp(1)
    own = [p.detach().clone() for p in model1.parameters()]
    opt1 = torch.optim.SGD(model1.parameters(), lr=0.05)
    d1 = DiLoCo(model1, opt1, swarm=harness.swarm("peer1", bootstrapped=True), inner_steps=H, join_timeout=2)
    own_digest = d1.digest
    d1.attach()
    try:
        # the download on attach was refused: nothing of the forged (or the real) state was adopted
        assert (d1.round, d1.digest) == (0, own_digest)
        for p, q in zip(model1.parameters(), own):
            assert torch.equal(p.detach(), q)
        # the next sync sees the swarm ahead, tries again, fails again, and says so
        report = d1.sync()
        assert not report.committed and not report.resynced
        assert report.reason.startswith("resync failed"), report.reason
        assert (d1.round, d1.digest) == (0, own_digest)
        for p, q in zip(model1.parameters(), own):
            assert torch.equal(p.detach(), q)

        # control: once peer0 serves its real state, the same joiner adopts it
        d0.swarm.serve_state(honest)
        report = d1.sync()
        assert report.resynced and report.reason.startswith("resynced")
        assert (d1.round, d1.digest) == (1, d0.digest)
        for p, q in zip(model1.parameters(), d0.state.params):
            assert torch.equal(p.detach(), q)
    finally:
        d1.detach()


def test_wait_for_peers_stops_waiting_once_the_swarm_has_started(harness):
    """--wait-for N: wait while fewer than N peers train, but not once another peer has started
    (waiting longer would only make us late for its first round)."""
    a, b = harness.swarm("a"), harness.swarm("b", bootstrapped=True)
    a.update(status="training")
    b.update(status="training")
    started = time.monotonic()
    assert a.wait_for_peers(3, timeout=0.6) == 2  # nobody has started: waits out its timeout
    assert time.monotonic() - started >= 0.6
    b.update(status="training", step=10)
    started = time.monotonic()
    assert a.wait_for_peers(3, timeout=30) == 2
    assert time.monotonic() - started < 2


def test_an_empty_directory_read_falls_back_to_the_recent_view(harness, monkeypatch):
    """A DHT lookup that times out on a slow link returns nothing; that must not look like "everyone
    left" (a peer would then run its rounds alone), until records would have expired anyway."""
    a, b = harness.swarm("a"), harness.swarm("b")
    a.update(status="training")
    b.update(status="training")
    _until(lambda: "b" in [r.peer for r in a.records()])

    async def nothing():
        return []

    monkeypatch.setattr(harness.board, "read", nothing)
    assert [r.peer for r in a.records()] == ["a", "b"]  # the view read less than heartbeat_ttl ago
    time.sleep(CFG.heartbeat_ttl + 0.3)
    assert [r.peer for r in a.records()] == ["a"]  # by now b's record would have expired: believe it


def test_a_directory_read_that_outlasts_its_bound_gives_the_last_view_and_never_raises(harness, monkeypatch):
    """The full chaos soak (`diloco bench chaos`, seed 1) crashed a worker with TimeoutError: a read of the directory
    on the training thread (catching up, a round's start) waited for the swarm's loop longer than the call timeout and
    a second, and the timeout reached `run_job`. A read that late now gives the view the heartbeat read last."""
    a, b = harness.swarm("a"), harness.swarm("b")
    a.update(status="training")
    b.update(status="training")
    _until(lambda: "b" in [r.peer for r in a.records()])

    async def starved():
        await asyncio.sleep(30)
        return []

    monkeypatch.setattr(a.presence, "read", starved)
    started = time.monotonic()
    assert [r.peer for r in a.records()] == ["a", "b"]
    assert time.monotonic() - started < CFG.round.call_timeout + 3


def test_a_round_does_not_wait_for_a_slow_directory_read_when_the_heartbeat_read_it_lately(patient, monkeypatch):
    """A DHT node that froze holds every lookup that asks it for the DHT's RPC timeout (3 s): a round starts from the
    heartbeat's recent view instead of waiting that long before its gather, and the slow read still refreshes it.
    (PATIENT: a view is recent for a quarter of the records' 10 s life, so a loaded machine's late heartbeat does
    not age it past that before the round asks; under CFG's 2 s it had 0.5 s.)"""
    harness = patient
    a, b = harness.swarm("a"), harness.swarm("b")
    a.update(status="training")
    b.update(status="training")
    _until(lambda: "b" in [r.peer for r in a.records()])
    fast = harness.board.read

    async def slow():
        await asyncio.sleep(3)
        return await fast()

    monkeypatch.setattr(harness.board, "read", slow)
    started = time.monotonic()
    seen = a.loop.run(a.presence.for_round(), timeout=10)
    took = time.monotonic() - started
    assert [r.peer for r in seen] == ["a", "b"] and took < 1.5, took  # not the read's 3 s
    monkeypatch.setattr(harness.board, "read", fast)
    assert [r.peer for r in a.loop.run(a.presence.for_round(), timeout=10)] == ["a", "b"]  # a fresh read, at once


def test_a_peer_most_members_refuse_as_banned_learns_it_and_gets_no_state(harness):
    """A banned peer must not train on through rounds nobody takes. Its peers tell it in their own
    authenticated replies (a ready refused as `banned`, a state request refused); once most members of
    its last round did, `check_standing` raises `Banned` naming why. Directory records play no part:
    any holder of the secret could forge them."""
    peers = {p: harness.swarm(p) for p in ("a", "b", "c", "x")}
    state = GlobalState([torch.ones(3)], nesterov())
    snapshot = Snapshot.take(state, state.manifest(), {})
    peers["a"].serve_state(lambda digest: snapshot if digest == snapshot.digest else None)
    for s in peers.values():
        s.update(status="training")
    _until(lambda: len(peers["x"].records()) == 4)
    x, members = peers["x"], ("a", "b", "c", "x")
    got, _, _ = fetch_state(x, snapshot.digest, ["a"], GlobalState([torch.zeros(3)], nesterov()).receiver)
    assert got.assemble(nesterov()).digest() == state.digest()
    peers["a"].collective.adopt_bans(["x"], "test")
    with pytest.raises(diloco.SwarmError, match="banned"):  # a peer that banned x serves it nothing
        fetch_state(x, snapshot.digest, ["a"], GlobalState([torch.zeros(3)], nesterov()).receiver)
    assert x.collective.banned_by == {"a"}
    x.check_standing(members)  # one of three is no majority
    for p in ("b", "c"):
        peers[p].collective.adopt_bans(["x"], "test")
    # x's next round: b and c refuse its ready as banned (a does too), in replies only they can seal;
    # x does not wait out its gather timeout (3 s) for peers that banned it, and the round ends in Banned
    started = time.monotonic()
    with pytest.raises(diloco.Banned, match=r"peer x was banned from run 'inproc' by 3 of the 3 other peers"):
        x.finish_exchange(x.exchange_async(0, 0, "d0", torch.zeros(4), previous=members), RoundKey(0))
    assert time.monotonic() - started < CFG.round.gather_timeout
    assert x.collective.banned_by == {"a", "b", "c"}
    with pytest.raises(diloco.Banned):  # at its next slot, too, without any call
        x.check_standing(members)
    peers["a"].check_standing(("a", "b", "c"))  # the others are in good standing
    x.check_standing(("x", "a", "b", "c", "d", "e", "f"))  # 3 of 6 members: no majority


def test_stopping_the_loop_cancels_what_still_runs_on_it():
    """A task still pending when the loop stops (a heartbeat between beats, a refusal the tarpit holds)
    is cancelled and unwound, not left to be reported as destroyed at exit."""
    import asyncio

    loop = LoopThread()
    cleaned = threading.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.set()

    future = loop.submit(forever())
    time.sleep(0.05)
    loop.stop()
    assert cleaned.is_set() and future.cancelled()


def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
