"""Partitions: at most one side of a split swarm commits, and after the
split heals the minority catches up, so no round id ever has two global states.

Four in-process peers train together; then calls between two groups are dropped and each group
sees only its own peers' records (a partitioned DHT); then the partition heals. Each peer records (round, digest) after every round it commits or
downloads; a round id with two digests is a split brain. The negative control turns the majority
rule off and shows exactly that damage.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import replace

import pytest
import torch
from test_swarm_inproc import CFG, Harness, _batches, _mlp, _run_threads, _train

import diloco
from diloco import DiLoCo, RoundReport
from diloco.comms import InProcNetwork
from diloco.comms.loop import LoopThread
from diloco.peers import InProcBoard, PeerRecord, departed, quorum

pytestmark = pytest.mark.swarm

H = 3


# ---------------------------------------------------------------------- the rule (pure)


def test_quorum_needs_a_strict_majority_of_the_last_members():
    prev = ("a", "b", "c", "d")
    assert quorum(("a", "b", "c"), prev, (), 1)[0]
    ok, why = quorum(("d",), prev, (), 1)
    assert not ok and "1 of the last round's 4 members" in why and "needs 3" in why
    assert not quorum(("a", "b"), prev, (), 1)[0]  # 2 | 2: neither half
    assert not quorum(("c", "d"), prev, (), 1)[0]


def test_announced_leavers_do_not_count_and_newcomers_do_not_help():
    prev = ("a", "b", "c")
    assert quorum(("a",), prev, ("b", "c"), 1)[0]  # the others said goodbye: a alone is the swarm
    assert not quorum(("a", "x", "y", "z"), prev, (), 1)[0]  # strangers are no majority of the old members
    assert quorum(("a", "b", "x"), prev, (), 1)[0]


def test_only_peers_that_left_at_or_behind_our_round_stop_counting():
    """A peer that left ahead of us committed rounds we lack: it still counts (as absent), so a lone
    peer that fell behind cannot re-commit the swarm's rounds with other values once all others left."""
    recs = [PeerRecord(peer="a", status="left", round=3), PeerRecord(peer="b", status="left", round=12),
            PeerRecord(peer="c", status="training", round=2)]
    assert departed(recs, 3) == ["a"]
    assert departed(recs, 12) == ["a", "b"]
    assert not quorum(("c",), ("a", "b", "c"), departed(recs, 3), 1)[0]  # b is ahead: no re-commit
    assert quorum(("c",), ("a", "b", "c"), departed(recs, 12), 1)[0]


def test_peers_that_left_still_count_as_gone_after_their_goodbye_expired():
    """a, b and c commit rounds together; then b and c leave (Ctrl-C: a goodbye record), while a does not step (a
    slow step, a pause) for longer than a record lives. Their goodbyes have expired when a tries its next round: a
    remembers them, so the last round's members are a alone and a goes on. Before, a waited for them for good ("no
    quorum: 1 of the last round's 3 members are here"): `diloco bench chaos` stood still 200 s that way."""
    h = Harness()
    base = _mlp(4)
    together = threading.Barrier(3, timeout=20)
    left = threading.Event()
    rounds: dict[str, int] = {}

    def worker(name: str, leave_at: int | None) -> None:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        data = _batches(hash(name) % 100, 8)
        swarm = h.swarm(name)
        with DiLoCo(model, opt, swarm=swarm, inner_steps=H) as d:
            together.wait()
            k, target = 0, leave_at if leave_at is not None else 6
            deadline = time.monotonic() + 40
            while d.round < target and time.monotonic() < deadline:
                if leave_at is None and d.round == 3 and not left.is_set():  # a pauses at round 3
                    assert left.wait(20)
                    # b's and c's goodbye records expire meanwhile, and so does the last view that held them (an
                    # empty read falls back to a view under `heartbeat_ttl` old)
                    time.sleep(2 * CFG.heartbeat_ttl + 2.0)
                _train(model, opt, [data[k % len(data)]])
                k += 1
            rounds[name] = d.round
        if leave_at is not None:
            swarm.close()  # says goodbye: status "left"

    def leaver(name: str) -> None:
        worker(name, 3)

    def conductor() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not ("b" in rounds and "c" in rounds):
            time.sleep(0.05)
        time.sleep(0.5)  # their goodbyes are published
        left.set()

    try:
        _run_threads([lambda: worker("a", None), lambda: leaver("b"), lambda: leaver("c"), conductor], [together])
    finally:
        h.close()
    assert rounds["b"] == rounds["c"] == 3
    assert rounds["a"] == 6, rounds  # a went on alone after b and c left


def test_min_peers_and_a_fresh_peer():
    assert not quorum(("a",), None, (), 2)[0]
    assert quorum(("a",), None, (), 1) == (True, "no previous membership")


# ---------------------------------------------------------------------- four peers, split and heal


def _run_split(sides: list[set[int]], *, majority: bool, target: int, split_at: int, heal_at: int | None,
               heal_after: float | None = None):
    """Train 4 peers to round `target`; calls between `sides` are dropped from when peer 0 commits round
    `split_at` until it commits `heal_at` (or for `heal_after` seconds)."""
    cfg = replace(CFG, majority=majority)
    net, board, loop = InProcNetwork(), InProcBoard(), LoopThread()
    split = threading.Event()
    minority_tried = threading.Event()  # the cut-off side finished a round attempt while cut off
    side_of = {f"peer{i}": k for k, side in enumerate(sides) for i in side}
    seen: dict[int, set[str]] = {}
    lock = threading.Lock()
    swarms = []
    class SideOfBoard:  # the DHT is partitioned too: while split, a peer reads only its own side's records
        def __init__(self, me: str) -> None:
            self.me = me

        async def publish(self, record, ttl):
            await board.publish(record, ttl)

        async def read(self):
            found = await board.read()
            return [r for r in found if not split.is_set() or side_of[str(r.peer)] == side_of[self.me]]

        async def reach(self, records):
            return 0  # nobody answers across the split

        async def close(self):
            pass

    for i in range(4):
        me = f"peer{i}"
        s = diloco.Swarm.in_process(net, SideOfBoard(me), me, cfg, loop)
        s.transport.drop = lambda target, name, me=me: split.is_set() and side_of[str(target)] != side_of[me]
        swarms.append(s)
    def heal_when_tried() -> None:
        # Heal after `heal_after` seconds, and only once the other side has tried on its own: on a busy machine
        # the first attempts after the split can still hold views from before it and fail for lack of results
        # (dropped calls) until past the heal, so a plain timer could heal before any attempt met the rule.
        time.sleep(heal_after or 0)
        minority_tried.wait(15)
        split.clear()

    base = _mlp(5)
    start = threading.Barrier(4, timeout=10)
    out: dict[int, DiLoCo] = {}

    def peer(i: int):
        def run():
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            data = _batches(i, 64)
            d: DiLoCo

            def on_round(r: RoundReport) -> None:
                if r.committed or r.resynced:
                    with lock:
                        seen.setdefault(r.round, set()).add(d.digest)
                if split.is_set() and side_of[f"peer{i}"] != side_of["peer0"] and (
                        "no quorum" in r.reason or (r.committed and r.peers == 1)):
                    minority_tried.set()  # a round it ran on its own side (refused, or committed alone)
                if i == 0 and r.committed and r.round == split_at:
                    split.set()
                    if heal_after is not None:
                        threading.Thread(target=heal_when_tried, daemon=True).start()
                if i == 0 and r.committed and heal_at is not None and r.round >= heal_at and split.is_set():
                    minority_tried.wait(10)  # heal only once the other side has tried on its own
                    split.clear()

            d = DiLoCo(model, opt, swarm=swarms[i], inner_steps=H, on_round=on_round)
            with d:
                start.wait()
                deadline = time.monotonic() + 20
                k = 0
                while d.round < target and time.monotonic() < deadline:
                    x, y = data[k % len(data)]
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                    k += 1
                    if split.is_set():
                        time.sleep(0.005)  # a cut-off peer fails fast; do not spin through its data
                    if split.is_set() and minority_tried.is_set() and side_of[f"peer{i}"] != side_of["peer0"]:
                        # Once refused, the cut-off side waits for the heal. (Known limitation: a peer that
                        # keeps failing attempts inflates its attempt number, which others adopt from its
                        # record; majority peers reading it at different moments can miss each other.)
                        while split.is_set() and time.monotonic() < deadline:
                            time.sleep(0.01)
            out[i] = d
        return run

    try:
        _run_threads([peer(i) for i in range(4)], [start])
    finally:
        for s in swarms:
            s.close()
        loop.stop()
    return out, seen


def test_partition_3_1_majority_goes_on_minority_waits_then_resyncs():
    out, seen = _run_split([{0, 1, 2}, {3}], majority=True, target=6, split_at=2, heal_at=4)
    assert all(len(digests) == 1 for digests in seen.values()), seen  # never two states for one round
    assert {d.round for d in out.values()} == {6}
    assert len({d.digest for d in out.values()}) == 1
    minority = out[3].reports
    refused = [r for r in minority if not r.committed and "no quorum" in r.reason]
    assert refused, [r.reason for r in minority]  # it tried, and was refused, while cut off
    assert any(r.resynced for r in minority)  # after healing it downloaded the majority's state
    assert not any(r.committed and r.peers == 1 for r in minority)
    for i in range(3):  # the majority went on while the minority was cut off
        assert any(r.committed and r.round in (3, 4) and r.peers >= 3 for r in out[i].reports), out[i].reports


def test_partition_2_2_neither_half_commits():
    out, seen = _run_split([{0, 1}, {2, 3}], majority=True, target=4, split_at=2, heal_at=None, heal_after=1.5)
    assert all(len(digests) == 1 for digests in seen.values()), seen
    assert len({d.digest for d in out.values()}) == 1
    assert any("no quorum" in r.reason for d in out.values() for r in d.reports)  # the rule was exercised
    for d in out.values():
        assert not any(r.committed and r.peers < 3 for r in d.reports)  # no half ever committed alone


def test_negative_control_without_the_majority_rule_the_swarm_splits():
    out, seen = _run_split([{0, 1, 2}, {3}], majority=False, target=6, split_at=2, heal_at=4)
    solo = [r for r in out[3].reports if r.committed and r.peers == 1]
    assert solo, [r.reason for r in out[3].reports]  # the cut-off peer committed on its own
    assert any(len(digests) > 1 for digests in seen.values()), seen  # the damage the rule prevents
