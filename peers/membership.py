"""Membership decisions: pure functions of the records a peer can see.

No I/O and no clock here: the caller reads the directory and passes the records in, so every rule
is unit-tested deterministically.

- `expected_peers`: whom a ready peer waits for in the gather of a round.
- `round_key_for`: which attempt of our round to run, so that peers at the same round agree.
- `resync_source`: whether our global state is outdated or in the minority, and whom to copy.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from diloco.comms import PeerId, RoundKey

from .records import PeerRecord


def training(records: Sequence[PeerRecord]) -> list[PeerRecord]:
    return [r for r in records if r.status == "training"]


def expected_peers(records: Sequence[PeerRecord], key: RoundKey, me: PeerId) -> list[PeerId]:
    """Peers to wait for in round `key`: those training at this round, or one behind (a peer that
    just committed the previous round may not have refreshed its record yet)."""
    return sorted(r.peer for r in training(records) if r.peer != me and key.round - 1 <= r.round <= key.round)


def round_key_for(records: Sequence[PeerRecord], my_round: int, my_attempt: int) -> RoundKey:
    """Our next round key: peers at our round that already failed more attempts set the pace."""
    attempts = [r.attempt for r in training(records) if r.round == my_round]
    return RoundKey(my_round, max([my_attempt, *attempts]))


def resync_source(
    records: Sequence[PeerRecord], me: PeerId, my_round: int, my_digest: str
) -> tuple[PeerRecord | None, str]:
    """Whom to download global state from, and why; (None, reason) when ours is current.

    Rule: the newest round any training peer holds wins; at that round, the digest most peers hold
    (ties: the smaller digest) is the swarm's state; the source is the lowest peer id holding it.
    We resync if that round is newer than ours, or equal with a different digest held by more
    peers than ours.
    """
    others = [r for r in training(records) if r.peer != me and r.digest]
    if not others:
        return None, "no other training peers"
    newest = max(r.round for r in others)
    if newest < my_round:
        return None, f"we are ahead (round {my_round} > {newest})"
    at_newest = [r for r in others if r.round == newest]
    votes = Counter(r.digest for r in at_newest)
    if newest == my_round:
        votes[my_digest] += 1
    best = min(votes, key=lambda d: (-votes[d], d))
    if newest == my_round and best == my_digest:
        return None, "our state matches the majority"
    source = min((r for r in at_newest if r.digest == best), key=lambda r: r.peer)
    if newest > my_round:
        return source, f"swarm is at round {newest}, we are at {my_round}"
    return source, f"our digest {my_digest} is in the minority at round {my_round} ({votes[best]} peers hold {best})"
