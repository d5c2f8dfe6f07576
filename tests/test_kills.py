"""A peer killed at each phase of a round, in-process.

Three peers train; the victim's fault plan kills it in round 2 at one phase (`comms/faults.py`):
it drops off the network at once and never says goodbye, its record lingering until
`heartbeat_ttl`, as a SIGKILLed process's does. The survivors must commit without it within the
round deadline plus the heartbeat timeout, never hold two states for one round id, and end
identical. The multi-process twin (real SIGKILL, real daemons) is in test_multiproc.py.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from test_swarm_inproc import CFG, H, Harness, _batches, _mlp, _run_threads

from diloco import DiLoCo
from diloco.comms.faults import PHASES, FaultPlan

pytestmark = pytest.mark.swarm

TARGET = 6
KILL_ROUND = 2


@pytest.mark.parametrize("phase", PHASES)
def test_survivors_commit_without_a_peer_killed_at_each_phase(phase):
    h = Harness()
    base = _mlp(5)
    start = threading.Barrier(3, timeout=10)
    killed, killed_at = threading.Event(), []
    seen: dict[int, list[tuple[int, bool, str, int, float]]] = {0: [], 1: [], 2: []}
    finals: dict[int, str] = {}

    def peer(i: int):
        def run():
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            def die() -> None:
                killed_at.append(time.monotonic())
                h.net.kill(swarm.peer_id)  # off the network now, before the next line of the round runs
                swarm.crash()
                killed.set()

            swarm = h.swarm(f"peer{i}", faults=FaultPlan(f"kill@{phase}:{KILL_ROUND}", kill=die) if i == 2 else None)

            def on_round(r):
                seen[i].append((r.round, r.committed, d.digest, r.peers, time.monotonic()))

            data = _batches(10 + i, 8)
            d = DiLoCo(model, opt, swarm=swarm, inner_steps=H, on_round=on_round)
            with d:
                start.wait()
                k, deadline = 0, time.monotonic() + 20
                while d.round < TARGET and time.monotonic() < deadline:
                    if i == 2 and killed.is_set():
                        return  # the process is gone: not even the `with` exit runs
                    x, y = data[k % len(data)]
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                    k += 1
                finals[i] = d.digest
        return run

    try:
        _run_threads([peer(i) for i in range(3)], [start])
    finally:
        h.close()

    assert killed.is_set(), f"the fault at {phase} never fired"
    assert set(finals) == {0, 1} and finals[0] == finals[1]
    # one state per round id, on every peer, the victim's rounds before it died included
    states: dict[int, set[str]] = {}
    for rows in seen.values():
        for rnd, committed, digest, _, _ in rows:
            if committed:
                states.setdefault(rnd, set()).add(digest)
    assert all(len(d) == 1 for d in states.values()), (states, seen)
    assert set(states) >= set(range(1, TARGET + 1))
    # the survivors' first commit without the victim comes within the round deadline + heartbeat
    # (a kill after the victim's span result went out, at send or apply, lets that round commit with 3)
    for i in (0, 1):
        alone = [t for _, committed, _, peers, t in seen[i] if committed and peers == 2 and t > killed_at[0]]
        assert alone, seen[i]
        bound = CFG.round.result_timeout + CFG.heartbeat_ttl + 1.0
        assert alone[0] - killed_at[0] < bound, (phase, alone[0] - killed_at[0], seen[i])
    if phase in ("gather", "encode", "reduce"):  # the victim's span had no result: that round failed
        assert not any(c and p == 3 and rnd == KILL_ROUND + 1 for rnd, c, _, p, _ in seen[0]), seen[0]
    if phase in ("apply", "applied"):  # every result was out: the survivors committed that round with all three
        assert any(c and p == 3 and rnd == KILL_ROUND + 1 for rnd, c, _, p, _ in seen[0]), seen[0]


def test_each_fault_fires_exactly_once():
    fired = []
    plan = FaultPlan("kill@encode:1,kill@apply:1", kill=lambda: fired.append(1))
    for _ in range(3):
        for phase in PHASES:
            plan.hit(phase, 1)
        plan.hit("encode", 2)
    assert plan.fired == [("encode", 1), ("apply", 1)] and len(fired) == 2
    with pytest.raises(ValueError, match="PHASE in gather, encode, send, reduce, decide, apply, applied"):
        FaultPlan("kill@decode:1")


def test_a_poison_entry_scales_what_we_contribute_from_its_round_on():
    plan = FaultPlan("kill@encode:3,poison@2", kill=lambda: None)
    delta = torch.ones(3)
    assert torch.equal(plan.outgoing(1, delta), delta)
    assert torch.equal(plan.outgoing(2, delta), delta * 1e4) and torch.equal(plan.outgoing(9, delta), delta * 1e4)
    assert plan.points == {("encode", 3)}
    assert torch.equal(FaultPlan().outgoing(5, delta), delta)
    with pytest.raises(ValueError, match="or poison@ROUND"):
        FaultPlan("poison@two")
