"""Error feedback through the real round protocol: with random exclusions
of a peer's span contributions, nothing is lost and nothing is counted twice.

The oracle is independent of what the collective reports as "sent": the test re-encodes every
peer's span contributions itself, checks that each span's aggregate is exactly the average of
the contributors the result lists, and from that list derives what of peer a's Δ really entered
the global update. Then Σ applied + residual must equal Σ Δ.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from diloco.comms import Collective, CollectiveConfig, InProcNetwork, RoundKey, span_bounds
from diloco.comms.reduce import average, canonical_order
from diloco.compression.ef import ErrorFeedback
from diloco.compression.pipeline import Pipeline

pytestmark = pytest.mark.swarm

SPEC = "topk:8/64+fp16+ef:1"  # lossy (top-k and fp16), with error feedback: the round reports what it sent
NUMEL = 3 * 64 * 4
PEERS = ("a", "b", "c")


async def _run(rounds: int, honest: bool) -> dict:
    rng = random.Random(7)
    net = InProcNetwork()
    cfg = CollectiveConfig(gather_timeout=2, reduce_timeout=0.15, result_timeout=10.0, call_timeout=0.5,
                           compression=SPEC)
    # Peer "a" loses ~30% of its contributions on the way to the span owners.
    drop_a = lambda target, handler: handler == "diloco.contrib" and rng.random() < 0.3  # noqa: E731
    peers = [await Collective.create(net.transport(p, drop_a if p == "a" else None), "ef-test", cfg) for p in PEERS]
    pipe = Pipeline(SPEC)
    ef = ErrorFeedback(1.0, NUMEL)
    g = torch.Generator().manual_seed(0)
    stats = {"delta": torch.zeros(NUMEL), "applied": torch.zeros(NUMEL), "excluded": 0, "included": 0}
    for r in range(rounds):
        deltas = [torch.randn(NUMEL, generator=g) for _ in PEERS]
        acc = ef.accumulate(deltas[0])
        inputs = [acc, *deltas[1:]]
        outs = await asyncio.gather(*(c.run_round(RoundKey(r), "d", list(PEERS), x) for c, x in zip(peers, inputs)))
        assert all(o.committed for o in outs), [o.reason for o in outs]
        assert len({o.aggregate.numpy().tobytes() for o in outs}) == 1  # identical on every peer
        a_out, applied = outs[0], torch.zeros(NUMEL)
        for (lo, hi), members in zip(span_bounds(NUMEL, 3, align=64), a_out.contributors):
            encoded = {p: pipe.encode(x[lo:hi]) for p, x in zip(PEERS, inputs)}
            decoded = {p: pipe.decode(encoded[p], hi - lo) for p in PEERS}
            order = [members[i] for i in canonical_order([encoded[p] for p in members])]
            assert torch.equal(a_out.aggregate[lo:hi], average([decoded[p] for p in order], hi - lo))
            if "a" in members:
                applied[lo:hi] = decoded["a"].dense(hi - lo)
                stats["included"] += 1
            else:
                stats["excluded"] += 1
        assert torch.equal(a_out.sent, applied)
        ef.commit(acc, a_out.sent if honest else pipe.decode(pipe.encode(acc), NUMEL).dense(NUMEL))
        stats["delta"] += deltas[0]
        stats["applied"] += applied
    stats["residual"] = ef.residual
    return stats


def _conservation_error(s: dict) -> float:
    return float((s["applied"] + s["residual"] - s["delta"]).norm() / s["delta"].norm())


def test_residual_keeps_exactly_what_the_rounds_left_out():
    s = asyncio.run(_run(12, honest=True))
    assert s["excluded"] > 0 and s["included"] > 0  # the scenario really mixes both
    assert _conservation_error(s) < 1e-5


def test_negative_control_counting_dropped_contributions_as_sent_loses_them():
    s = asyncio.run(_run(12, honest=False))
    assert s["excluded"] > 0
    assert _conservation_error(s) > 1e-2
