"""Failure injection: crash this peer at an exact phase of an exact round, or turn it into a poisoning
peer, for tests and chaos runs.

    DILOCO_FAULTS="kill@reduce:2"   # SIGKILL ourselves in round 2 before our span's result goes out
    DILOCO_FAULTS="kill@gather:1,kill@apply:3"
    DILOCO_FAULTS="poison@2"        # from round 2 on, contribute our pseudo-gradient x 1e4

Phases, in the order a round passes them:

| phase    | where the peer dies                                                  | what the others see        |
|----------|----------------------------------------------------------------------|----------------------------|
| `gather` | our ready messages went out: others count on us                      | a view with a dead member  |
| `encode` | the view closed with us in it; nothing of our Δ went out             | no contribution, no result |
| `send`   | our contributions reached their owners; our span's result may not    | our span has no result     |
| `reduce` | our span is reduced but its result not sent: nobody can commit       | our span has no result     |
| `decide` | we accepted the round's value (every result is in), voted for nobody | members in doubt, or committed |
| `apply`  | every result is in (others commit), our outer step is not applied    | a committed round, then us gone |
| `applied`| our outer step is applied; its digest is being hashed beside training | a committed round, then us gone |

Each kill fires at most once. A poisoning peer is an authorized peer gone bad: robust aggregation
clips its contributions, then the others ban it, and it stops (`diloco.Banned`).

A round passes its hooks (`Faults`: `hit` at each phase, `outgoing` on each span of our Δ before it
is encoded); the `Faults` every peer gets by default does nothing. Only a process's entry point reads
`DILOCO_FAULTS` (`FaultPlan.from_env`: `diloco start/join`, and a script under the launcher when it
connects) and hands the plan to its `Swarm`; in-process tests pass a plan with their own `kill`
action (drop the peer from the network, stop its thread), and the simulator poisons a worker by
calling `poison()` on the plan it gave that worker's swarm.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Callable

from diloco.compression.errors import ConfigError

if TYPE_CHECKING:
    import torch

PHASES = ("gather", "encode", "send", "reduce", "decide", "apply", "applied")
POISON_FACTOR = 1e4


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Faults:
    """The hooks a round passes through. These do nothing: the product path."""

    def hit(self, phase: str, round_: int) -> None:
        """Reached `phase` (one of PHASES) of round `round_`."""

    def outgoing(self, round_: int, delta: torch.Tensor) -> torch.Tensor:
        """What we contribute in round `round_` in place of `delta` (a span of our pseudo-gradient)."""
        return delta


NO_FAULTS = Faults()

CLOCK_STEP_FILE = "DILOCO_CLOCK_STEP_FILE"
"""A file whose number is how many seconds this process's wall clock reads ahead (negative: behind): `step_clock`."""
_REAL_TIME = time.time


def step_clock(path: str) -> None:
    """From now on this process's wall clock (`time.time`, whatever reads it: the swarm's directory, signed calls,
    records, logs) reads the number of seconds in the file at `path` ahead of the machine's, as after an NTP step or
    a VM resumed from a snapshot; a missing or unreadable file is 0. The file is read again at most every 0.2 s, so
    a chaos run steps the clock of a running peer by writing it. The monotonic clock is not touched (no step moves
    it)."""
    read_at, offset = -1.0, 0.0

    def now() -> float:
        nonlocal read_at, offset
        t = time.monotonic()
        if t - read_at > 0.2:
            read_at = t
            try:
                with open(path) as f:
                    offset = float(f.read().strip() or 0.0)
            except (OSError, ValueError):
                offset = 0.0
        return _REAL_TIME() + offset

    time.time = now
    from .clock import use_in_hivemind

    use_in_hivemind(now)  # hivemind bound the machine's clock at import: it reads this one too


def clock_from_env() -> None:
    """`step_clock` from DILOCO_CLOCK_STEP_FILE, when it is set (tests and chaos runs). For entry points only."""
    if os.environ.get(CLOCK_STEP_FILE):
        step_clock(os.environ[CLOCK_STEP_FILE])


class FaultPlan(Faults):
    """A plan of kills and poisoning (the module's docstring has the format)."""

    def __init__(self, spec: str = "", kill: Callable[[], None] = _sigkill) -> None:
        self.points: set[tuple[str, int]] = set()
        self.poison_from: int | None = None
        """From this round on our contributions are our pseudo-gradient times `poison_factor`."""
        self.poison_factor = POISON_FACTOR
        for item in filter(None, (s.strip() for s in spec.split(","))):
            action, _, where = item.partition("@")
            if action == "poison" and where.isdigit():
                self.poison_from = int(where)
                continue
            phase, _, rnd = where.partition(":")
            if action != "kill" or phase not in PHASES or not rnd.isdigit():
                raise ConfigError(f"bad fault {item!r}; expected kill@PHASE:ROUND with PHASE in {', '.join(PHASES)}, "
                                 "or poison@ROUND")
            self.points.add((phase, int(rnd)))
        self.fired: list[tuple[str, int]] = []
        self._kill = kill

    @classmethod
    def from_env(cls) -> Faults:
        """The plan in DILOCO_FAULTS, or `NO_FAULTS` when it is unset or empty; and DILOCO_CLOCK_STEP_FILE's
        stepped wall clock (`clock_from_env`). For entry points only. Raises ValueError on a malformed plan."""
        clock_from_env()
        spec = os.environ.get("DILOCO_FAULTS", "")
        return cls(spec) if spec.strip() else NO_FAULTS

    def hit(self, phase: str, round_: int) -> None:
        """Reached `phase` of round `round_`: die here if the plan says so (once)."""
        if (phase, round_) in self.points:
            self.points.discard((phase, round_))
            self.fired.append((phase, round_))
            self._kill()

    def poison(self, factor: float = POISON_FACTOR, from_round: int = 0) -> None:
        """Contribute our pseudo-gradient times `factor` from round `from_round` on."""
        self.poison_from, self.poison_factor = from_round, factor

    def outgoing(self, round_: int, delta: torch.Tensor) -> torch.Tensor:
        """What we contribute in round `round_` in place of our pseudo-gradient `delta`."""
        if self.poison_from is None or round_ < self.poison_from:
            return delta
        return delta * self.poison_factor
