"""Failure injection: crash this peer at an exact phase of an exact round, for tests and chaos runs.

    DILOCO_FAULTS="kill@reduce:2"   # SIGKILL ourselves in round 2 before our span's result goes out
    DILOCO_FAULTS="kill@gather:1,kill@apply:3"

Phases, in the order a round passes them (RELIABILITY row 1):

| phase    | where the peer dies                                                  | what the others see        |
|----------|----------------------------------------------------------------------|----------------------------|
| `gather` | our ready messages went out: others count on us                      | a view with a dead member  |
| `encode` | the view closed with us in it; nothing of our Δ went out             | no contribution, no result |
| `send`   | our contributions reached their owners; our span's result may not    | our span has no result     |
| `reduce` | our span is reduced but its result not sent: nobody can commit       | our span has no result     |
| `apply`  | every result is in (others commit), our outer step is not applied    | a committed round, then us gone |

Each entry fires at most once. The plan is read once, from the environment of the peer process;
in-process tests pass their own `kill` action (drop the peer from the network, stop its thread).
"""

from __future__ import annotations

import os
import signal
from typing import Callable

PHASES = ("gather", "encode", "send", "reduce", "apply")


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FaultPlan:
    def __init__(self, spec: str = "", kill: Callable[[], None] = _sigkill) -> None:
        self.points: set[tuple[str, int]] = set()
        for item in filter(None, (s.strip() for s in spec.split(","))):
            action, _, where = item.partition("@")
            phase, _, rnd = where.partition(":")
            if action != "kill" or phase not in PHASES or not rnd.isdigit():
                raise ValueError(f"bad fault {item!r}; expected kill@PHASE:ROUND with PHASE in {', '.join(PHASES)}")
            self.points.add((phase, int(rnd)))
        self.fired: list[tuple[str, int]] = []
        self._kill = kill

    @classmethod
    def from_env(cls) -> FaultPlan:
        return cls(os.environ.get("DILOCO_FAULTS", ""))

    def hit(self, phase: str, round_: int) -> None:
        """Reached `phase` of round `round_`: die here if the plan says so (once)."""
        if (phase, round_) in self.points:
            self.points.discard((phase, round_))
            self.fired.append((phase, round_))
            self._kill()
