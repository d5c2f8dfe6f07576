"""The swarm's clock: the wall clock this process's directory and signed DHT calls read.

The swarm's directory (hivemind's DHT) keeps a record until its expiration, a wall-clock time set by its writer and
checked by every node that stores or reads it; a signed DHT request carries its sender's time. Two peers whose
clocks disagree by more than a record's lifetime (`heartbeat_ttl`, 30 s) cannot see each other: a peer whose clock
reads 30 s behind publishes records that every other node holds expired on arrival, one 30 s ahead holds everyone
else's expired. A clock can step while a peer trains (an NTP correction, a VM resumed from a snapshot, a laptop
waking up), or be off when it joins.

So the time the directory reads is the swarm's: this machine's clock plus `SwarmClock.offset`, the median of the
swarm times this peer reads (its own, and the others' that their signed DHT requests carry), taken when it moves by
more than `DEADBAND` seconds; a joining peer takes the time of the peers it shakes hands with. A peer whose clock stepped reads the others' clocks and follows them; the others,
the majority, keep theirs. `use_in_hivemind` makes hivemind's DHT read it (hivemind reads `get_dht_time`, bound by
name in several of its modules).
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from typing import Callable

log = logging.getLogger(__name__)

DEADBAND = 2.0
"""Seconds of disagreement left alone: the delays of a sample (a request's way and queue) stay below it, and a record
that lives 30 s does not notice it."""
WINDOW = 60.0
"""Seconds a sample counts: a peer not heard from for longer (gone, or cut off) no longer moves our clock."""


def swarm_offset(current: float, samples: list[float], deadband: float = DEADBAND, joining: bool = False) -> float:
    """The offset to add to our clock so it reads the swarm's, from the one we add now (`current`: our vote) and the
    other peers' swarm clocks against ours (`samples`: their swarm time − our clock): the lower median of them all,
    kept at `current` when within `deadband` of it. A minority of peers whose clocks stepped moves nobody else's;
    with one other peer, the one whose clock stepped ahead follows the other, and one stepped behind is followed
    (both then read one time, which is what the directory needs). `joining`: we have no time of the swarm's yet
    and take the others' (the handshakes' samples) without a vote."""
    values = sorted(samples if joining and samples else [current, *samples])
    median = values[(len(values) - 1) // 2]
    return median if abs(median - current) > deadband else current


class SwarmClock:
    """Offsets measured to the other peers, and the swarm's time from them (see the module docstring)."""

    def __init__(self, raw: Callable[[], float] | None = None, window: float = WINDOW,
                 deadband: float = DEADBAND) -> None:
        self._raw = raw
        self.window, self.deadband = window, deadband
        self._samples: dict[bytes, tuple[float, float]] = {}
        """By source: (its offset, until when it counts (monotonic))."""
        self._provisional: set[bytes] = set()
        self._settled = False
        """A sample that is not provisional arrived: provisional ones no longer count."""
        self.offset = 0.0
        """Seconds added to this machine's clock: the swarm's time minus ours."""

    def raw(self) -> float:
        """This machine's wall clock (read each time: a stepped clock is seen at once)."""
        return self._raw() if self._raw is not None else time.time()

    def now(self) -> float:
        """The swarm's time."""
        return self.raw() + self.offset

    def observe(self, source: bytes, theirs: float) -> None:
        """`source` (a DHT node) read `theirs` on its swarm clock when it sent what arrives now."""
        self.record(source, theirs - self.raw())

    def record(self, source: bytes, offset: float, provisional: bool = False) -> None:
        """`source`'s swarm clock reads `offset` seconds ahead of this machine's (behind when negative). A
        `provisional` sample (the join handshake's, before any DHT request arrived) counts until the first sample
        that is not: the same peer's requests then speak for it, and must not be counted twice."""
        mono = time.monotonic()
        if provisional and self._settled:
            return  # DHT requests arrive already: they tell
        if provisional:
            self._provisional.add(source)
        elif not self._settled:
            self._settled = True
            for key in self._provisional:
                self._samples.pop(key, None)
        self._samples[source] = (offset, mono + self.window)
        for key in [k for k, (_, until) in self._samples.items() if mono > until]:
            del self._samples[key]
        offset = swarm_offset(self.offset, [o for o, _ in self._samples.values()], self.deadband,
                              joining=not self._settled)
        if abs(offset - self.offset) > self.deadband:
            how = (f"reads {abs(offset):.1f} s {'behind' if offset > 0 else 'ahead of'} the swarm's (it stepped?); the "
                   "directory reads the swarm's time" if abs(offset) > self.deadband else "agrees with the swarm's again")
            log.warning("event=swarm_clock offset=%.1f peers=%d reason=this machine's wall clock %s", offset,
                        len(self._samples), how)
        self.offset = offset


SWARM_CLOCK = SwarmClock()
"""This process's: hivemind's DHT reads one clock per process (`use_in_hivemind`)."""


def use_in_hivemind(now: Callable[[], float]) -> None:
    """From now on hivemind's DHT (every module of it, loaded or loaded later) reads its time from `now`."""
    importlib.import_module("hivemind.utils.timed_storage")  # first: a module loaded later takes the name from it

    for name, module in list(sys.modules.items()):
        if (name == "hivemind" or name.startswith("hivemind.")) and callable(getattr(module, "get_dht_time", None)):
            module.get_dht_time = now  # type: ignore[attr-defined]
