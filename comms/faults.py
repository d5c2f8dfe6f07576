"""Failure injection: crash this peer at an exact phase of an exact round, for tests and chaos runs.

    DILOCO_FAULTS="kill@reduce:2"   # SIGKILL ourselves in round 2 before our span's result goes out
    DILOCO_FAULTS="kill@gather:1,kill@reduce:3"

Phases: `gather` (after our ready messages went out: others count on us) and `reduce` (our span
is reduced but its result not yet sent: no one can commit the round, the hardest case for the
survivors). Each entry fires at most once. The plan is read once, from the environment of the peer process.
"""

from __future__ import annotations

import os
import signal

PHASES = ("gather", "reduce")


class FaultPlan:
    def __init__(self, spec: str = "") -> None:
        self.points: set[tuple[str, int]] = set()
        for item in filter(None, (s.strip() for s in spec.split(","))):
            action, _, where = item.partition("@")
            phase, _, rnd = where.partition(":")
            if action != "kill" or phase not in PHASES or not rnd.isdigit():
                raise ValueError(f"bad fault {item!r}; expected kill@PHASE:ROUND with PHASE in {', '.join(PHASES)}")
            self.points.add((phase, int(rnd)))
        self.fired: list[tuple[str, int]] = []

    @classmethod
    def from_env(cls) -> FaultPlan:
        return cls(os.environ.get("DILOCO_FAULTS", ""))

    def hit(self, phase: str, round_: int) -> None:
        if (phase, round_) in self.points:
            self.points.discard((phase, round_))
            self.fired.append((phase, round_))
            os.kill(os.getpid(), signal.SIGKILL)
