"""The end of a whole swarm's run (diloco/ending.py, docs/USAGE.md "Ending the whole run"): one peer is asked, every
peer ends at the round it announced, on one final model.

Pure decisions first (the margin, the announced end, a malformed record), then in-process swarms of real `Swarm`s
and `DiLoCo` workers (flat workers of unequal pace, a loop that does not look and meets `RunEnded`, two regions that
end on one global state), then real processes: a `diloco start` peer and a script under `diloco join -- CMD` ended by
SIGUSR2 to the launcher."""

from __future__ import annotations

import copy
import signal
import sys
import textwrap
import threading
import time
from dataclasses import replace

import pytest
import torch
from multiproc_util import TINY, Peers
from test_swarm_inproc import PATIENT, Harness, _batches, _mlp, _run_threads

import diloco
from diloco import DiLoCo
from diloco.comms import InProcNetwork, PeerId
from diloco.comms.loop import LoopThread
from diloco.ending import UNTIMED, Ending, RunEnded, announced, margin
from diloco.peers import InProcBoard, PeerRecord
from diloco.peers.records import parse_record

H = 3


# ---------------------------------------------------------------------------------------------- pure decisions

@pytest.mark.unit
def test_the_margin_leaves_every_peer_three_heartbeats_and_a_second_to_read_the_end():
    assert margin(0.5, 1.0) == 8  # rounds of half a second: 4 s of them
    assert margin(300.0, 1.0) == 1  # rounds of minutes: the round after the newest
    assert margin(None, 1.0) == UNTIMED  # nothing timed yet
    assert margin(0.0, 1.0) == UNTIMED


def _rec(peer: str, ends: int = 0, status: str = "training") -> PeerRecord:
    return PeerRecord(peer=PeerId(peer), status=status, round=3, ends=ends)


@pytest.mark.unit
def test_the_announced_end_is_the_lowest_any_peer_shows_a_banned_peers_aside():
    assert announced([_rec("a"), _rec("b")]) is None
    assert announced([_rec("a", 12), _rec("b", 9, status="left"), _rec("c")]) == 9  # the announcer may have left
    assert announced([_rec("a", 12), _rec("b", 9)], banned={PeerId("b")}) == 12


class _Whole:
    """What `Ending.reached` reads of the whole swarm: our record, the others', bans, the heartbeat; what it writes."""

    def __init__(self, others: list[PeerRecord]) -> None:
        self.presence = type("P", (), {"record": _rec("me")})()
        self._others, self.published = others, []
        self.collective = type("C", (), {"banned": set()})()
        self.cfg = type("Cfg", (), {"heartbeat_interval": 1.0})()

    def others_seen(self) -> list[PeerRecord]:
        return self._others

    def update(self, **fields) -> None:
        self.published.append(fields)


@pytest.mark.unit
def test_an_announced_end_holds_when_a_peer_asked_again_announces_nothing_new():
    """A peer restarted while the launcher's end file stands is asked again: an end the records show holds (its own
    margin, untimed after a restart, could name an earlier round than the others can read in time)."""
    ending = Ending()
    ending.wanted = True
    whole = _Whole([_rec("a", 40)])
    assert not ending.reached(whole, count=30)
    assert ending.end == 40 and whole.published == [{"ends": 40}]
    fresh = Ending()
    fresh.wanted = True
    assert not fresh.reached(_Whole([_rec("a")]), count=30) and fresh.end == 30 + UNTIMED  # none yet: announced


@pytest.mark.unit
@pytest.mark.parametrize("ends", [-1, "7", 2.5, True, 1 << 60])
def test_a_malformed_end_in_a_record_from_the_network_is_no_end(ends):
    record = parse_record("p", {"status": "training", "round": 4, "ends": ends})
    assert record is not None and record.ends == 0
    assert parse_record("p", {"status": "training", "round": 4, "ends": 17}).ends == 17


# ---------------------------------------------------------------------------------------------- in-process swarms

def _steps(d: DiLoCo, model: torch.nn.Module, opt: torch.optim.Optimizer, data: list, *, pace: float,
           ask=lambda d: False, look: bool = True) -> None:
    """Inner steps until the run ended (`d.ended`; a loop that does not `look`: until `RunEnded`), or 20 s; asks for
    the end once `ask(d)`."""
    k, deadline = 0, time.monotonic() + 20
    while (not look or not d.ended) and time.monotonic() < deadline:
        if ask(d):
            d.end_swarm()
        x, y = data[k % len(data)]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        k += 1
        time.sleep(pace)


def _flat_worker(h: Harness, name: str, out: dict, barrier: threading.Barrier, *, pace: float, ask_at: int | None,
                 look: bool = True):
    swarm = h.swarm(name)
    model = _mlp(1)  # one initial model: built in the test thread below (torch's RNG is shared by threads)

    def run() -> None:
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        try:
            with DiLoCo(m, opt, swarm=swarm, inner_steps=H) as d:
                out[name] = d
                barrier.wait()
                _steps(d, m, opt, _batches(len(name), 16), pace=pace, look=look,
                       ask=lambda d: ask_at is not None and d.round >= ask_at)
        except RunEnded as e:
            out[name + ".raised"] = e.round
    return run


@pytest.mark.swarm
def test_every_worker_ends_at_the_announced_round_on_one_state_the_slow_one_too():
    """Three workers, one three times slower per step: the fastest asks at round 3; each loop checks `d.ended` and
    stops at the round announced, which every record shows; one state everywhere. (PATIENT: no deadline may decide
    a round.)"""
    h = Harness(PATIENT)
    out: dict = {}
    barrier = threading.Barrier(3, timeout=20)
    try:
        _run_threads([_flat_worker(h, "a", out, barrier, pace=0.01, ask_at=3),
                      _flat_worker(h, "b", out, barrier, pace=0.01, ask_at=None),
                      _flat_worker(h, "c", out, barrier, pace=0.03, ask_at=None)], [barrier])
        end = out["a"].member.ending.end
        assert end is not None and end > 3
        assert {n: out[n].round for n in "abc"} == {n: end for n in "abc"}
        assert len({out[n].digest for n in "abc"}) == 1
        assert all(r.ends == end for r in h.swarms[0].records())  # each peer published it: it outlives the announcer
    finally:
        h.close()


@pytest.mark.swarm
def test_a_loop_that_does_not_look_leaves_at_the_slot_past_the_end_by_run_ended():
    """A loop that never checks `d.ended`: the slot after the end raises `RunEnded` (exit status 0), the `with`
    applies what is in flight and the worker ends on the announced round like the others."""
    h = Harness(PATIENT)
    out: dict = {}
    barrier = threading.Barrier(2, timeout=20)
    try:
        _run_threads([_flat_worker(h, "a", out, barrier, pace=0.01, ask_at=2),
                      _flat_worker(h, "b", out, barrier, pace=0.01, ask_at=None, look=False)], [barrier])
        end = out["a"].member.ending.end
        assert out["b.raised"] == end and out["b"].round == end == out["a"].round
        assert out["a"].digest == out["b"].digest
    finally:
        h.close()
    assert RunEnded(5).code == 0


@pytest.mark.swarm
def test_two_regions_of_unequal_pace_end_on_one_global_state():
    """Two regions of two peers, the second region's peers twice as slow: a member (not a representative) asks;
    every representative's last merge is the announced global round, and every peer ends holding θ_G′, its
    parameters in the model."""
    cfg = replace(PATIENT, merge_every=2)  # no deadline may decide a round or a merge
    net, board, loop = InProcNetwork(), InProcBoard(), LoopThread()
    regions = {"a1": "eu", "a2": "eu", "b1": "us", "b2": "us"}
    swarms = {p: diloco.Swarm.in_process(net, board, p, replace(cfg, region=r), loop) for p, r in regions.items()}
    base = _mlp(5)
    workers: dict[str, DiLoCo] = {}
    barrier = threading.Barrier(4, timeout=20)

    def worker(peer: str) -> None:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with DiLoCo(model, opt, swarm=swarms[peer], inner_steps=H) as d:
            workers[peer] = d
            barrier.wait()
            _steps(d, model, opt, _batches(hash(peer) % 1000, 16), pace=0.01 if peer.startswith("a") else 0.02,
                   ask=lambda d: peer == "a2" and d.regions.upper.round + d.round >= 4)
            d.finish()  # what a launched run's end does

    try:
        _run_threads([lambda p=p: worker(p) for p in regions], [barrier])
    finally:
        for s in swarms.values():
            s.close()
        loop.stop()
    end = workers["a2"].member.ending.end
    uppers = {p: d.regions.upper for p, d in workers.items()}
    assert end is not None
    assert {uppers["a1"].round, uppers["b1"].round} == {end}, {p: u.round for p, u in uppers.items()}
    assert len({d.topology.final_digest(d.member) for d in workers.values()}) == 1
    theta_g = uppers["a1"].state.params
    for d in workers.values():
        assert all(torch.equal(p.detach(), t) for p, t in zip(d.model.parameters(), theta_g))


# ---------------------------------------------------------------------------------------------- real processes

SCRIPT = textwrap.dedent("""
    import torch
    from diloco import DiLoCo
    from diloco.job.model import GPTConfig, build_model

    model = build_model(GPTConfig(context=32, d_model=32, n_layer=1), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with DiLoCo(model, opt, inner_steps=10) as d:
        while not d.ended:
            x = torch.randint(0, 256, (4, 32), generator=g)
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
    print("ENDED", d.round, flush=True)
""")


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_sigusr2_to_a_launcher_ends_the_bundled_peer_and_the_script_at_one_round(tmp_path):
    """A `diloco start` peer (the bundled job) and a script under `diloco join -- python script.py` train; SIGUSR2 to
    the launcher: its end file reaches the script's worker, which announces the end; both exit 0 on the same round
    and final state, the script's loop ended by `d.ended`."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    peers = Peers(tmp_path, "end-run")
    try:
        first = peers.spawn(0, ["start", *TINY, "-H", "10", "--rounds", "100000", "--context", "32"])
        addr = peers.address(0)
        site = peers.spawn(1, ["join", addr, "--gather-timeout", "20"], command=[sys.executable, str(script)])
        deadline = time.monotonic() + 120
        while len(peers.lines(0, "round")) < 4 or not peers.lines(1, "round"):
            assert time.monotonic() < deadline, peers.log(0) + peers.log(1)
            assert first.poll() is None and site.poll() is None, peers.log(0) + peers.log(1)
            time.sleep(0.2)
        site.send_signal(signal.SIGUSR2)
        assert peers.wait(site, 90) == 0, peers.log(1)
        assert peers.wait(first, 90) == 0, peers.log(0)
    finally:
        peers.kill_all()
    finals = [peers.lines(i, "final")[-1] for i in (0, 1)]
    assert finals[0]["round"] == finals[1]["round"] > 4 and finals[0]["final_digest"] == finals[1]["final_digest"], \
        finals
    assert "event=run_end_announced" in peers.log(1, whole=True)
    assert f"ENDED {finals[1]['round']}" in peers.log(1, whole=True)
    assert finals[0]["run_ended"] and f"done: round {finals[0]['round']} (the whole run ended there" in peers.log(0)
