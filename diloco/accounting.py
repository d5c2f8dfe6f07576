"""Where a worker's time and bytes go: per-inner-step accounting with an injected clock.

The wrapper calls `begin_sync()` / `end_sync()` around the work it does inside `optimizer.step`
(encoding, outer steps, mixing, waiting), `blocked(seconds)` for the part spent waiting on the
network, and `step(now, sent, received)` after every inner step with the transport's byte
counters. Everything else between two steps is the user's compute (forward, backward, inner
optimizer), so

    compute utilization = (wall − time inside sync work) / wall

over the window since the first step; `blocked` is the share of the sync work spent waiting for
an exchange that had not finished (zero when every result came back within τ steps).

Bandwidth: `mean` is all bytes moved (sent + received) over the window's wall time; `peak` is the
largest rate of one round, its bytes over the time its exchange took (`round_moved`), i.e. the rate
the link had to sustain. (Per-step rates would be meaningless: bytes are counted per message, and one
message can take many steps to cross a slow link.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    steps: int
    wall_seconds: float
    sync_seconds: float
    blocked_seconds: float
    blocked_waits: int
    bytes_sent: int
    bytes_received: int
    peak_bytes_per_second: float

    @property
    def utilization(self) -> float:
        """Inner-step compute time over wall time (1.0 when the wrapper costs nothing)."""
        return 1.0 - self.sync_seconds / self.wall_seconds if self.wall_seconds > 0 else 1.0

    @property
    def bytes_per_step(self) -> float:
        return (self.bytes_sent + self.bytes_received) / self.steps if self.steps else 0.0

    @property
    def mean_bytes_per_second(self) -> float:
        return (self.bytes_sent + self.bytes_received) / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "steps": self.steps, "wall_seconds": round(self.wall_seconds, 4),
            "sync_seconds": round(self.sync_seconds, 4), "blocked_seconds": round(self.blocked_seconds, 4),
            "blocked_waits": self.blocked_waits, "utilization": round(self.utilization, 4),
            "bytes_per_step": round(self.bytes_per_step, 1),
            "mean_bandwidth_bytes_per_s": round(self.mean_bytes_per_second, 1),
            "peak_bandwidth_bytes_per_s": round(self.peak_bytes_per_second, 1),
        }


class Accounting:
    def __init__(self) -> None:
        self._start: float | None = None
        self._last: float | None = None
        self._last_bytes = (0, 0)
        self._base_bytes = (0, 0)
        self._sync_started: float | None = None
        self.steps = 0
        self.sync_seconds = 0.0
        self.blocked_seconds = 0.0
        self.blocked_waits = 0
        self.peak = 0.0
        self._now = 0.0

    def begin_sync(self, now: float) -> None:
        self._sync_started = now

    def end_sync(self, now: float) -> None:
        if self._sync_started is not None and self._start is not None:
            self.sync_seconds += max(0.0, now - max(self._sync_started, self._start))
        self._sync_started = None

    def round_moved(self, nbytes: int, seconds: float) -> None:
        """A round moved `nbytes` (sent + received) in `seconds`."""
        if seconds > 0:
            self.peak = max(self.peak, nbytes / seconds)

    def blocked(self, seconds: float) -> None:
        """The training thread waited `seconds` for an exchange that was not back yet."""
        self.blocked_seconds += seconds
        self.blocked_waits += 1

    def step(self, now: float, sent: int, received: int) -> None:
        """An inner step ended at `now`; `sent` / `received` are the transport's running totals."""
        if self._start is None:  # the window starts at the end of the first step
            self._start, self._last = now, now
            self._base_bytes = self._last_bytes = (sent, received)
            return
        self.steps += 1
        self._last, self._last_bytes, self._now = now, (sent, received), now

    def usage(self) -> Usage:
        wall = (self._now - self._start) if self._start is not None and self.steps else 0.0
        return Usage(self.steps, wall, min(self.sync_seconds, wall), self.blocked_seconds, self.blocked_waits,
                     self._last_bytes[0] - self._base_bytes[0], self._last_bytes[1] - self._base_bytes[1], self.peak)
