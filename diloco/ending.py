"""The end of a whole swarm's run, at one round for every peer (docs/USAGE.md, "Ending the whole run").

A worker told to stop (Ctrl-C, SIGTERM) leaves at its next inner step, alone: ending a run that way ends each
worker where it stood, a round apart at times, and a region's last merge never happens. To end the *run*, on one
final model everywhere, any one peer is asked (SIGUSR2 to its `diloco start/join`, `DiLoCo.end_swarm()`). It
publishes in its record the round the run ends at (`PeerRecord.ends`): the newest round a record shows and the one
it may have on the wire, plus enough rounds for every peer to read it with the heartbeat before its rounds get there (`margin`). Every peer that reads
an end takes the lowest any member announced and publishes it in its own record too, so the end outlives its
announcer and a peer that joins or restarts later learns it. A peer launches no round past it, then ends its run as
one that reached `--rounds` does (`diloco.lifecycle`): regions merge a last time and every peer takes that state,
peers still behind download the final state.

Rounds are counted as the whole swarm counts them (`Topology.count`): a flat swarm's and gossip's rounds, the
global rounds (merges) with regions.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Collection, Sequence

from diloco.comms import PeerId
from diloco.peers.records import PeerRecord

if TYPE_CHECKING:
    from .swarm import Swarm

log = logging.getLogger(__name__)

BEATS = 3
"""Heartbeats an announced end leaves every peer to read it, and a second more (a read, a slow directory)."""
UNTIMED = 3
"""Rounds of margin before any round was timed."""


def margin(period: float | None, heartbeat: float) -> int:
    """Rounds between the newest round and the end: as many as `BEATS` heartbeats and a second take at `period`
    seconds a round (at least 1: the round after the newest; `UNTIMED` when no round was timed yet)."""
    if period is None or not period > 0:
        return UNTIMED
    return max(1, math.ceil((BEATS * heartbeat + 1.0) / period))


def announced(records: Sequence[PeerRecord], banned: Collection[PeerId] = ()) -> int | None:
    """The lowest end a record announces (peers that left included: the announcer may have ended already), a banned
    peer's aside; None when none does."""
    ends = [r.ends for r in records if r.ends > 0 and r.peer not in banned]
    return min(ends) if ends else None


class RunEnded(SystemExit):
    """Raised at the second synchronization slot of a loop that went on past the swarm's end (the first launches no
    round and sets `DiLoCo.ended`; on a site, every rank at the same slots): the exit status is 0, and leaving the
    `with` ends the run as a completed one (the last merge, the final state everywhere). A loop that checks
    `DiLoCo.ended` never meets it."""

    def __init__(self, rnd: int) -> None:
        super().__init__(0)
        self.round = rnd


class Ending:
    """One worker's side of the swarm's end: asked to announce one, the end once known, the pace of its rounds."""

    def __init__(self) -> None:
        self.wanted = False
        """Asked to end the run (a flag: a signal handler sets it; the training thread announces)."""
        self.end: int | None = None
        """The round the run ends at, once announced by us or read in a record."""
        self.over = False
        """A synchronization slot found the run over (on a site, every rank alike): `DiLoCo.ended` from then on."""
        self._published: int | None = None
        self._passed = False
        self._commits: deque[float] = deque(maxlen=6)

    def committed(self, now: float | None = None) -> None:
        """A round of ours committed (its time paces the margin of an end we announce)."""
        self._commits.append(time.monotonic() if now is None else now)

    def period(self) -> float | None:
        """Seconds per round over our last few commits (None before two)."""
        c = self._commits
        return (c[-1] - c[0]) / (len(c) - 1) if len(c) > 1 else None

    def reached(self, whole: Swarm, count: int, scale: int = 1) -> bool:
        """Whether the run ended for us: an end is announced (ours now, when we were asked and none is) and our
        rounds, `count` as the swarm counts them, got to it. `whole`: the swarm whose records carry the end;
        `scale`: our rounds per counted round (a region's rounds per merge). No network I/O (before the heartbeat's
        first read, our own record alone)."""
        records = [whole.presence.record, *whole.others_seen()]
        seen = announced(records, whole.collective.banned)
        if self.wanted and self.end is None and seen is None:  # an end already announced holds (a restart re-asks)
            # a record's round, and the one it may have on the wire (with regions: the merge a region has due)
            newest = max([count, *(r.round + 1 for r in records if r.status != "left")])
            period = self.period()
            self.end = newest + margin(period * scale if period is not None else None, whole.cfg.heartbeat_interval)
            log.warning("event=run_end_announced round=%d newest=%d reason=asked to end the whole run", self.end,
                        newest)
        if seen is not None and (self.end is None or seen < self.end):
            if self.end is None:
                log.info("event=run_end_read round=%d at=%d", seen, count)
            self.end = seen
        if self.end is None:
            return False
        if self._published != self.end:  # ours too: the end outlives its announcer
            self._published = self.end
            whole.update(ends=self.end)
        if count > self.end and not self._passed:
            self._passed = True
            log.warning("event=run_end_passed round=%d at=%d reason=the end reached us after we launched past it; "
                        "we end here", self.end, count)
        return count >= self.end
