"""One peer's presence in the swarm's directory: our record, and the others' as we last read them.

Every peer publishes a `PeerRecord` (status, round, digest, addresses, progress) with a time to live, refreshed by
the swarm's heartbeat, and reads everyone's. `Presence` keeps ours (changed atomically from the training thread and
the heartbeat), the view the last read showed (`records(cached=True)` answers from it without network I/O), the
region each peer last named and the goodbye records of peers that left (a round's quorum counts them), and pings
back into our directory node the members of our last round that a read misses (`diloco.peers.reach`). The
`Swarm` owns one and runs the heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from diloco.comms import PeerId
from diloco.comms.clock import SWARM_CLOCK
from diloco.comms.transport import ByteCounter
from diloco.peers import Directory, PeerRecord
from diloco.peers.reach import Missing

from .config import SwarmConfig
from .lines import write_lines

log = logging.getLogger(__name__)


class Presence:
    """Our record and the directory as we last read it (see the module docstring)."""

    def __init__(self, directory: Directory, cfg: SwarmConfig, record: PeerRecord, counter: ByteCounter) -> None:
        self.directory, self.cfg = directory, cfg
        self.peer_id = PeerId(record.peer)
        self._record = record
        self._lock = threading.Lock()  # the training thread and the heartbeat both change our record
        self._counter = counter  # bytes from each peer: one that called us since the last read is alive
        self.seen: list[PeerRecord] | None = None
        """The directory as the last read showed it (None before the first)."""
        self.seen_at = 0.0
        self._reads: set[asyncio.Task[list[PeerRecord]]] = set()  # fresh reads a round did not wait for (`for_round`)
        self.regions: dict[PeerId, str] = {}
        """The region each peer's record last named (kept when the record expires)."""
        self.left: dict[PeerId, PeerRecord] = {}
        """The goodbye record of every peer we saw leave (and not come back since): it counts as departed in a
        round's quorum after its record expired, so a swarm that committed nothing while two of its last members
        left is not stuck waiting for them for good."""
        self.members: tuple[PeerId, ...] = ()
        """The members of the last round we committed (as our latest exchange named them): whom a read that misses
        them pings back (`_reach_unseen`)."""
        self._missing = Missing(self.peer_id, cfg.heartbeat_ttl)
        self._reaching: asyncio.Future[int] | None = None
        self._addresses_file: str | None = None
        self._kept: list[str] = []

    @property
    def record(self) -> PeerRecord:
        return self._record

    def change(self, **fields: Any) -> PeerRecord:
        """Our record with `fields` changed, atomically (a change made at the same moment by another thread is
        kept, not overwritten with the record as it was before it)."""
        with self._lock:
            self._record = PeerRecord(**{**self._record.__dict__, **fields})
            return self._record

    async def publish(self, **fields: Any) -> None:
        """Our record, with `fields` changed and the time of this beat, into the directory (a failure is logged)."""
        record = self.change(beat=SWARM_CLOCK.now(), **fields)
        try:
            await self.directory.publish(record, self.cfg.heartbeat_ttl)
        except Exception as e:  # noqa: BLE001
            log.warning("event=heartbeat_failed reason=%s", e)

    def data_address_of(self, peer: PeerId) -> str:
        """The data address `peer`'s record named when the heartbeat last read the directory ("" if none)."""
        return next((r.data for r in self.seen or () if r.peer == peer), "")

    def via_of(self, peer: PeerId) -> tuple[PeerId, ...]:
        """The relays `peer`'s record named when the heartbeat last read the directory (it is called through them)."""
        return next((r.via for r in self.seen or () if r.peer == peer), ())

    def others_seen(self) -> list[PeerRecord]:
        """The other peers' records as the heartbeat last read them (no network I/O; none before its first read)."""
        return [r for r in self.seen or () if r.peer != self.peer_id]

    async def read(self) -> list[PeerRecord]:
        """A fresh read of the directory. A read that fails, or finds nobody else although a read less than
        `heartbeat_ttl` ago found others (a DHT lookup that timed out on a slow link looks like that),
        falls back to that last view: records live `heartbeat_ttl` anyway, and a peer that leaves says so."""
        now = time.monotonic()
        try:
            found = await asyncio.wait_for(self.directory.read(), self.cfg.round.call_timeout)
        except Exception as e:  # noqa: BLE001 - a failed read is an empty view, never a crash
            log.warning("event=directory_read_failed reason=%s", e)
            found = None
        others = [r for r in found or [] if r.peer != self.peer_id]
        if found is not None:
            self._reach_unseen(others, now)
        self.regions.update({r.peer: r.region for r in [*others, self.record] if r.region})  # kept when one expires
        for r in others:
            if r.status == "left":
                self.left[r.peer] = r
            else:
                self.left.pop(r.peer, None)  # it came back
        if others or (found is not None and not self._seen_others(now)):
            self.seen, self.seen_at = found, now
        elif self._seen_others(now):
            log.info("event=directory_read_empty reason=using the view read %.1fs ago", now - self.seen_at)
            others = self.others_seen()
        return [self.record, *others]

    def _reach_unseen(self, others: list[PeerRecord], now: float) -> None:
        """Ping, in the background, the members of our last round that this fresh read misses (`Directory.reach`; by
        their last record's addresses, or by id when they called us since the last read): one that answers was
        across a DHT island from us, and the next heartbeat's records span both sides."""
        received = {p: row[1] for p, row in self._counter.per_peer.items()}
        busy = self._reaching is not None and not self._reaching.done()
        unseen = self._missing.due(self.members, others, received, self.left, now, busy=busy)
        if not unseen:
            return

        async def reach() -> int:
            answered = await self.directory.reach(unseen)
            log.info("event=directory_reach reason=members of our last round are missing from the directory "
                     "peers=%s answered=%d", ",".join(sorted(r.peer for r in unseen)), answered)
            return answered

        self._reaching = asyncio.ensure_future(reach())

    async def for_round(self) -> list[PeerRecord]:
        """The records a round starts from: a fresh read, or the heartbeat's last one when the fresh read takes longer
        than a heartbeat interval and that one is under a quarter of `heartbeat_ttl` old (the read goes on and
        refreshes it). A DHT node that froze (SIGSTOP, a swapped-out VM) holds each lookup that asks it for the DHT's
        RPC timeout (3 s): without this every round while its record lives paid that before its gather."""
        read = asyncio.ensure_future(self.read())
        done, _ = await asyncio.wait({read}, timeout=self.cfg.heartbeat_interval)
        if read in done or self.seen is None or time.monotonic() - self.seen_at > self.cfg.heartbeat_ttl / 4:
            return await read
        self._reads.add(read)
        read.add_done_callback(self._reads.discard)
        log.info("event=directory_read_slow reason=using the view read %.1fs ago", time.monotonic() - self.seen_at)
        return [self.record, *self.others_seen()]

    def _seen_others(self, now: float) -> bool:
        return bool(self.others_seen()) and now - self.seen_at < self.cfg.heartbeat_ttl

    def keep_addresses(self, path: str) -> None:
        """Keep the addresses of the other members in `path` (one a line, refreshed with the heartbeat), so
        that a restarted process of this site can rejoin through them (the launcher reads the file)."""
        self._addresses_file = path

    def write_addresses(self, records: list[PeerRecord]) -> None:
        addrs = sorted({a for r in records if r.peer != self.peer_id and r.status != "left" for a in r.addrs})
        if self._addresses_file and addrs and addrs != self._kept:
            try:
                write_lines(self._addresses_file, addrs)
                self._kept = addrs
            except OSError as e:
                log.warning("event=addresses_not_kept path=%s reason=%s", self._addresses_file, e)
