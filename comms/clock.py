"""The swarm's clock: the wall clock this process's directory, signed DHT calls and metrics lines read.

The swarm's directory (hivemind's DHT) keeps a record until its expiration, a wall-clock time set by its writer and
checked by every node that stores or reads it; a signed DHT request carries its sender's time. Two peers whose
clocks disagree by more than a record's lifetime (`heartbeat_ttl`, 30 s) cannot see each other: a peer whose clock
reads 30 s ahead holds every other record expired and sees nobody, while the others still read its last record and
wait for it (the swarm stands still); one 30 s behind publishes records that expire on arrival. A clock can step
while a peer trains (an NTP correction, a VM resumed from a snapshot), or be off when it joins.

So the time this process reads is its own timeline, not the machine's wall clock as it stands:
- a step of the wall clock is seen locally and undone: the wall clock against `CLOCK_BOOTTIME` (which no step moves,
  and which counts a suspend as the wall clock does) jumps by more than `DEADBAND` seconds, and `SwarmClock.offset`
  takes the jump back, at the next read, whatever its size and whoever else is up;
- a joining peer takes the time of the peers it shakes hands with (`adopt`: the median of their clocks against ours,
  each measured over the handshake's round trip), when it is off by more than `DEADBAND`.
No peer's time moves because of another's afterwards: network delays cannot drag it. `use_in_hivemind` makes
hivemind's DHT read it (hivemind reads `get_dht_time`, bound by name in several of its modules).
"""

from __future__ import annotations

import importlib
import logging
import statistics
import sys
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

DEADBAND = 2.0
"""Seconds of disagreement left alone: a step smaller than this, or a joiner this close to the swarm, is not worth a
correction (a record that lives 30 s does not notice it)."""


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class SwarmClock:
    """This process's timeline (see the module docstring): the wall clock, its steps taken back, plus what a join
    adopted."""

    def __init__(self, raw: Callable[[], float] | None = None, boot: Callable[[], float] = _boottime,
                 deadband: float = DEADBAND) -> None:
        self._raw, self._boot, self.deadband = raw, boot, deadband
        self._lock = threading.Lock()
        self._base: float | None = None
        """The wall clock minus the boot clock when last read: a step moves it at once."""
        self.offset = 0.0
        """Seconds added to this machine's wall clock: the swarm's time minus it."""

    def raw(self) -> float:
        """This machine's wall clock (read each time: a stepped clock is seen at once)."""
        return self._raw() if self._raw is not None else time.time()

    def now(self) -> float:
        """The swarm's time (a step of the wall clock since the last read is taken back here)."""
        with self._lock:
            raw = self.raw()
            base = raw - self._boot()
            step = 0.0 if self._base is None else base - self._base
            self._base = base  # what moves it slowly (NTP's slewing) is the clock's own; a jump is a step
            if abs(step) > self.deadband:
                self.offset -= step
                log.warning("event=swarm_clock step=%+.1f offset=%.1f reason=this machine's wall clock stepped %.1f s "
                            "%s; this peer keeps the swarm's time", step, self.offset, abs(step),
                            "ahead" if step > 0 else "back")
            return raw + self.offset

    def adopt(self, offsets: list[float]) -> None:
        """Joining: the swarm's clocks read `offsets` seconds ahead of this machine's (each peer we shook hands with,
        measured against our wall clock): take their median, when it is more than `DEADBAND` from ours."""
        if not offsets:
            return
        self.now()  # a step before this is taken back first
        median = statistics.median_low(offsets)
        with self._lock:
            if abs(median - self.offset) <= self.deadband:
                return
            self.offset = median
        log.warning("event=swarm_clock offset=%.1f peers=%d reason=this machine's wall clock reads %.1f s %s the "
                    "swarm's; this peer reads the swarm's time", median, len(offsets), abs(median),
                    "behind" if median > 0 else "ahead of")


SWARM_CLOCK = SwarmClock()
"""This process's: hivemind's DHT reads one clock per process (`use_in_hivemind`)."""


def use_in_hivemind(now: Callable[[], float]) -> None:
    """From now on hivemind's DHT (every module of it, loaded or loaded later) reads its time from `now`."""
    importlib.import_module("hivemind.utils.timed_storage")  # first: a module loaded later takes the name from it

    for name, module in list(sys.modules.items()):
        # vars(), not getattr: a read of the package's own names would run all of hivemind's __init__ (its averager
        # and scipy: diloco.hivemind_lean), and one that ran later takes the name from timed_storage anyway
        if (name == "hivemind" or name.startswith("hivemind.")) and callable(vars(module).get("get_dht_time")):
            module.get_dht_time = now  # type: ignore[attr-defined]
