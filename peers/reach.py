"""Whom to ping back into our DHT node's routing table: members of our last round that our reads miss.

A DHT node only meets the nodes its lookups and callers lead it to; a group whose nodes know only each other reads
and stores records among themselves alone (an island: `DHTDirectory.reach`). `Missing` keeps what that decision needs
between reads (each member's last record, the bytes each peer had sent us, when we last tried whom) and turns a fresh
read into the records to reach (`membership.unseen_peers`); the swarm's heartbeat does the pinging.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from diloco.comms import PeerId

from .membership import unseen_peers
from .records import PeerRecord


class Missing:
    """What `due` needs between reads, for one peer (`me`), at most once every `every` seconds a peer."""

    def __init__(self, me: PeerId, every: float) -> None:
        self.me, self.every = me, every
        self.last_seen: dict[PeerId, PeerRecord] = {}  # every peer's last record a read found: where to dial it
        self.tried: dict[PeerId, float] = {}  # when we last pinged a missing peer
        self.heard: dict[PeerId, int] = {}  # bytes received from each peer as of the last read

    def due(self, members: Sequence[PeerId], others: Sequence[PeerRecord], received: Mapping[PeerId, int],
            left: Collection[PeerId], now: float, *, busy: bool = False) -> list[PeerRecord]:
        """The records to reach after a fresh read that found `others`: `members` (of our last round) it misses, by
        their last record's addresses, or by id alone when they called us since the last read (`received`: bytes
        from each peer so far), that did not say goodbye (`left`) and that we did not try lately. `busy`: a reach
        is still under way; this read is only noted, and nobody is due."""
        self.last_seen.update({r.peer: r for r in others})
        if len(self.last_seen) > 4 * len(members) + 64:  # forget peers that are neither here nor members
            keep = {*members, *(r.peer for r in others)}
            self.last_seen = {p: r for p, r in self.last_seen.items() if p in keep}
        heard = [p for p, n in received.items() if n > self.heard.get(p, 0)]
        self.heard = dict(received)
        if busy:
            return []
        peers = unseen_peers(members, heard, self.me, {r.peer for r in others}, left, self.last_seen, self.tried, now,
                             self.every)
        self.tried.update({p: now for p in peers})
        # a member we hold no record of (restarted, we read none since) that called us: its id alone
        return [self.last_seen.get(p) or PeerRecord(peer=p, status="training", round=0) for p in peers]
