"""Membership decisions: pure functions of the records a peer can see.

No I/O and no clock here: the caller reads the directory and passes the records in, so every rule
is unit-tested deterministically.

- `expected_peers`: whom a ready peer waits for in the gather of a round.
- `round_key_for`: which attempt of our round to run, so that peers at the same round agree.
- `plan_round`: that key, whom a round asks, and whom of them it waits for (stragglers, peers catching up).
- `resync_source`: whether our global state is outdated or in the minority, and whom to copy.
- `vouched`: whether a state another peer served us is the one the swarm advertises.
- `holders`: who can serve a chunk of a given state.
- `departed`: who left for good at or before our round (no longer counted by `quorum`).
- `banned_by_majority`: peers that most other peers banned (robust aggregation), so a peer that
  joined after the ban leaves them out too.
- `voted_out`: whether most members of our last round refused us as banned (we stop: nobody will
  take our contributions).
- `quorum`: whether a round's view may commit: enough peers, and a majority of the last round's
  members, so that at most one side of a partition makes progress.
- Gossip (`diloco.gossip`): `groups` / `group_of` cut the live peers into a round's groups from the run id and
  the round number alone, `group_tag` names a group for its gather, `round_to_run` is the round a peer runs next,
  `gossip_plan` all of that for one slot (or why it runs no round).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Sequence

from diloco.comms import PeerId, RoundKey
from diloco.compression.errors import ConfigError

from .records import PeerRecord


def training(records: Sequence[PeerRecord]) -> list[PeerRecord]:
    return [r for r in records if r.status == "training"]


def serving(records: Sequence[PeerRecord]) -> list[PeerRecord]:
    """Peers that hold a state others may download: those training, and those on standby (a region's members
    in the swarm's records, `diloco.regions`: they hold the global state but leave its rounds to their
    representative)."""
    return [r for r in records if r.status in ("training", "standby")]


Voters = Callable[[Sequence[PeerId]], list[PeerId]]
"""What a round's quorum counts of its peers (`regions_of` for a merge of regions; the peers themselves by default)."""


def regions_of(peers: Sequence[PeerId], region: Mapping[PeerId, str]) -> list[PeerId]:
    """`peers` as the regions they train in (a peer whose region is unknown counts as its own): a global
    round's quorum counts regions, not their representatives, so a region whose representative changed
    (crashed, left, another member took over) is still the same voter."""
    return sorted({PeerId(region[p]) if region.get(p) else p for p in peers})


def expected_peers(records: Sequence[PeerRecord], key: RoundKey, me: PeerId) -> list[PeerId]:
    """Peers to contact in round `key`: those training at this round, one behind (a peer that just
    committed the previous round may not have refreshed its record yet), or ahead (a peer that
    committed this round already answers so, and we download its state instead of forking)."""
    return sorted(r.peer for r in training(records) if r.peer != me and r.round >= key.round - 1)


def banned_by_majority(records: Sequence[PeerRecord], me: PeerId) -> list[PeerId]:
    """Peers banned by a strict majority (and at least two) of the other training peers' records. One
    peer alone can never ban another in anyone else's view."""
    voters = [r for r in training(records) if r.peer != me]
    votes = Counter(p for r in voters for p in set(r.banned) if p != r.peer)
    return sorted(p for p, n in votes.items() if n >= 2 and 2 * n > len(voters) and p != me)


def voted_out(refused_by: Collection[PeerId], members: Sequence[PeerId] | None, me: PeerId) -> tuple[int, int]:
    """(members that refused us as banned, members besides us) when those are a strict majority and at
    least two, else (0, members besides us). `refused_by` are peers whose authenticated replies said
    we are banned; `members` the view of our last committed round. Directory records are not used:
    any holder of the secret can write them, but a reply speaks only for the peer that sealed it."""
    voters = set(members or ()) - {me}
    against = len(voters & set(refused_by))
    return (against if against >= 2 and 2 * against > len(voters) else 0), len(voters)


def round_key_for(records: Sequence[PeerRecord], my_round: int, my_attempt: int) -> RoundKey:
    """Our next round key: peers at our round that already failed more attempts set the pace."""
    attempts = [r.attempt for r in training(records) if r.round == my_round]
    return RoundKey(my_round, max([my_attempt, *attempts]))


@dataclass(frozen=True)
class RoundPlan:
    """What a round starts from (`plan_round`)."""

    key: RoundKey
    ask: list[PeerId]
    """Whom the gather asks to be ready (sorted)."""
    wait_for: set[PeerId] | None
    """Whom of them it waits for (None: all); the others are taken in if ready in time."""
    left: list[PeerId]
    """Peers that left for good at or before our round: not counted by the quorum (`departed`)."""


def plan_round(records: Sequence[PeerRecord], me: PeerId, my_round: int, my_attempt: int, *,
               skip: Collection[PeerId] = (), previous: Sequence[PeerId] | None = None,
               goodbyes: Sequence[PeerRecord] = (), fetching: Collection[PeerId] = ()) -> RoundPlan:
    """Our next round from the `records` we read: its key (`round_key_for`), whom it asks and waits for.

    The expected peers (`expected_peers`) are asked and waited for. Stragglers (`skip`: members the last round went
    on without) are asked, and taken in if they are ready in time, but not waited for: a slow peer costs the others
    one gather timeout, once. A straggler or member of `previous` that shows as joining (it is catching up) is
    asked too, with only the stragglers' grace (a ready from a peer nobody asked is left out). A peer downloading
    our state (`fetching`) is waited for, unless it is a straggler: without that, a swarm whose rounds are quicker
    than a download would move on under it each time and it would never get in; one that stays slow would download
    at each of its slots and cost the others a timeout each time (test_straggler.py). `goodbyes`: the goodbye
    records of peers we saw leave, which still count as departed after their records expired."""
    key = round_key_for(records, my_round, my_attempt)
    expected = expected_peers(records, key, me)
    known = set(skip) | set(previous or ())
    resyncing = [r.peer for r in records if r.status == "joining" and r.peer in known and r.peer != me]
    present = {r.peer for r in records}
    left = departed([*records, *(r for r in goodbyes if r.peer not in present)], my_round)
    catching_up = set(fetching) - set(skip)
    wait_for = None if not skip and not resyncing else {p for p in expected if p not in skip}
    if catching_up:
        wait_for = {*(expected if wait_for is None else wait_for), *catching_up}
    return RoundPlan(key, sorted({*expected, *resyncing, *catching_up}), wait_for, left)


def resync_source(
    records: Sequence[PeerRecord], me: PeerId, my_round: int, my_digest: str, exclude: Sequence[PeerId] = ()
) -> tuple[PeerRecord | None, str]:
    """Whom to download global state from, and why; (None, reason) when ours is current.

    Rule: the newest round any training peer holds wins; at that round, the digest most peers hold
    (ties: the smaller digest) is the swarm's state; the source is the lowest peer id holding it.
    We resync if that round is newer than ours, or equal with a different digest held by more
    peers than ours. Peers in `exclude` (their state failed verification) are chosen only when no
    other peer holds that state.
    """
    others = [r for r in serving(records) if r.peer != me and r.digest]
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
    source = _lowest([r for r in at_newest if r.digest == best], exclude)
    if newest > my_round:
        return source, f"swarm is at round {newest}, we are at {my_round}"
    return source, f"our digest {my_digest} is in the minority at round {my_round} ({votes[best]} peers hold {best})"


def gossip_source(records: Sequence[PeerRecord], me: PeerId, my_round: int,
                  exclude: Sequence[PeerId] = ()) -> tuple[PeerRecord | None, str]:
    """Whom a peer joining a gossip swarm (`diloco.gossip`) downloads a state from: the peer at the newest round
    (ties: the lowest peer id; one whose state failed verification only if no other is there), or (None, why)
    when no other peer is ahead of us."""
    others = [r for r in serving(records) if r.peer != me and r.digest]
    if not others:
        return None, "no other training peers"
    newest = max(r.round for r in others)
    if newest <= my_round:
        return None, f"no peer is ahead of us (round {my_round})"
    source = _lowest([r for r in others if r.round == newest], exclude)
    return source, f"the swarm is at round {newest}, we are at {my_round}"


def _lowest(holders: Sequence[PeerRecord], exclude: Sequence[PeerId]) -> PeerRecord:
    """The holder with the lowest peer id; one in `exclude` (its state failed verification) only if all are."""
    fresh = [r for r in holders if r.peer not in exclude]
    return min(fresh or holders, key=lambda r: r.peer)


def vouched(records: Sequence[PeerRecord], me: PeerId, rnd: int, digest: str) -> tuple[bool | None, str]:
    """Is the state (round `rnd`, `digest`) that a peer served us the swarm's? (verdict, reason).

    Every other peer's record votes with the digest it advertises for round `rnd`, now or among its
    `recent` states (the server's own record included: the state may have moved on after we chose the
    server, so the record read then can show an older round). True when `digest` has more votes than
    any other digest for that round; False when another digest has at least as many (a tampered or
    forked state); None when no record shows round `rnd` yet (the others have not committed or
    published it: ask again shortly).
    """
    votes: Counter[str] = Counter()
    for r in records:
        if r.peer == me:
            continue
        held = r.digests_at(rnd)
        votes.update(held)
    if not votes:
        return None, f"no peer advertises round {rnd} yet"
    rival = max((n for d, n in votes.items() if d != digest), default=0)
    if votes[digest] > rival:
        return True, f"{votes[digest]} peers advertise {digest} for round {rnd}"
    return False, (f"{votes[digest]} peers advertise {digest} for round {rnd} but {rival} advertise "
                   f"{max((d for d in votes if d != digest), key=lambda d: votes[d])}")


def holders(records: Sequence[PeerRecord], me: PeerId, rnd: int, digest: str) -> list[PeerId]:
    """Training peers whose records show state (rnd, digest), now or among their recent states: any of
    them can serve a chunk of it (every peer that committed a round holds the same bytes)."""
    return sorted(r.peer for r in serving(records) if r.peer != me and digest in r.digests_at(rnd))


def started_without(records: Sequence[PeerRecord], me: PeerId) -> bool:
    """Whether the swarm visibly started without us (`--wait-for`): another peer took steps or committed
    rounds, and trains, stands by or already left (a short run may be over before a late peer looks): waiting
    for more peers would only make us late."""
    return any(r.peer != me and r.status != "joining" and (r.step > 0 or r.round > 0) for r in records)


def departed(records: Sequence[PeerRecord], my_round: int) -> list[PeerId]:
    """Peers that announced leaving while at our round or behind it: they no longer count toward a
    quorum. A peer that left *ahead* of us committed rounds we do not hold, so it keeps counting
    (as absent): re-running those rounds without it would give one round id two states."""
    return sorted(r.peer for r in records if r.status == "left" and r.round <= my_round)


def stragglers(before: Collection[PeerId], members: Sequence[PeerId], view: Sequence[PeerId],
               records: Sequence[PeerRecord]) -> set[PeerId]:
    """Who is a straggler after a round with members `view`: the last round's `members` it went on
    without join `before`; a peer stops being one when it is in a view again, or is no longer listed
    (left, or its record expired), so the set stays as small as the swarm however many peers come and go."""
    listed = {r.peer for r in records if r.status != "left"}
    return ((set(before) | set(members)) - set(view)) & listed


def quorum(view: Sequence[PeerId], previous: Sequence[PeerId] | None, left: Sequence[PeerId],
           min_peers: int) -> tuple[bool, str]:
    """May a round with members `view` commit? (decision, reason).

    It needs at least `min_peers` members and a strict majority of `previous` (the members of the
    last round we committed, or of the state we downloaded), not counting peers that announced they
    left. Two sides of a partition cannot both hold a strict majority of the same membership, so at
    most one of them commits; a crashed peer keeps counting (it cannot be told from a partitioned
    one), so a swarm survives losing fewer than half of its last round's members at once.
    `previous` None (a fresh peer that never synchronized) only applies `min_peers`.
    """
    if len(view) < min_peers:
        return False, f"only {len(view)} of min_peers={min_peers} ready"
    if not previous:
        return True, "no previous membership"
    gone = set(left)
    counted = [p for p in previous if p not in gone]
    if not counted:
        return True, "every previous member left"
    present = len(set(view) & set(counted))
    if 2 * present <= len(counted):
        return False, (f"no quorum: {present} of the last round's {len(counted)} members are here, "
                       f"a majority needs {len(counted) // 2 + 1}")
    return True, f"quorum: {present} of {len(counted)} previous members"


# ------------------------------------------------------------------ gossip (diloco.gossip)


def unseen_peers(members: Sequence[PeerId], heard: Sequence[PeerId], me: PeerId, present: Collection[PeerId],
                 left: Collection[PeerId], last_seen: Mapping[PeerId, PeerRecord], tried: Mapping[PeerId, float],
                 now: float, every: float) -> list[PeerId]:
    """Whom `Directory.reach` should ping: the members of our last round that we hold a record of (where to dial
    them) or heard from since the last read (a connection to them exists), that a fresh directory read misses, that
    did not say goodbye, and that we did not try to reach in the last `every` seconds. A member that is alive but
    missing from our reads is across a DHT island from us. Other callers are not pinged: bytes are counted before a
    caller is authorized, and a flood of strangers must not become a flood of our pings."""
    called = set(heard)
    candidates = [p for p in members if p in last_seen or p in called]
    return [p for p in dict.fromkeys(candidates)
            if p != me and p not in present and p not in left and now - tried.get(p, float("-inf")) >= every]


def groups(peers: Sequence[PeerId], rnd: int, run_id: str, size: int) -> list[tuple[PeerId, ...]]:
    """`peers` cut into groups of `size` for round `rnd`: a permutation drawn from (run id, round) — each peer
    ordered by a hash of the three — cut in order. Peers left over (fewer than `size`) join the last group, so
    nobody is alone while two peers are up. Every peer that sees the same peers draws the same groups."""
    if size < 2:
        raise ConfigError(f"a gossip group has at least 2 peers, got {size}")

    def draw(p: PeerId) -> bytes:
        return hashlib.sha256(f"{run_id}\0{rnd}\0{p}".encode()).digest()

    order = sorted(set(peers), key=draw)
    cut = [tuple(order[i:i + size]) for i in range(0, len(order), size)]
    if len(cut) > 1 and len(cut[-1]) < size:
        cut[-2:] = [cut[-2] + cut[-1]]
    return [tuple(sorted(g)) for g in cut]


def group_of(me: PeerId, peers: Sequence[PeerId], rnd: int, run_id: str, size: int) -> tuple[PeerId, ...]:
    """The group `me` is in at round `rnd` (`groups` of `peers` and `me`)."""
    return next(g for g in groups([*peers, me], rnd, run_id, size) if me in g)


FINAL_TAG = "gossip-final"
"""What every peer says it holds when it gathers for a gossip run's final average (one view of all that came, at the
newest round a live peer shows; a group's tag never reads so)."""


def group_tag(rnd: int, group: Sequence[PeerId]) -> str:
    """What a group's members say they hold when they gather (the round protocol closes a view among peers that
    say the same): members that drew different groups never mix."""
    return "gossip-" + hashlib.sha256(f"{rnd}\0{','.join(sorted(group))}".encode()).hexdigest()[:16]


def round_to_run(records: Sequence[PeerRecord], me: PeerId, my_round: int) -> int:
    """The round a peer runs next: its own, unless a live peer shows a round two or more ahead; then the round
    before that newest one (a peer that fell behind jumps, keeping its state, to where the slowest of the
    others are, and draws the same groups as they do). A peer one round behind runs its own round: its
    partner may well be there still, waiting for it."""
    newest = max([my_round, *(r.round for r in serving(records) if r.peer != me)])
    return max(my_round, newest - 1)


@dataclass(frozen=True)
class GroupPlan:
    """A round among a group (`gossip_plan`; run by `Swarm.group_round_async`)."""

    key: RoundKey
    tag: str
    """What the group's members say they hold when they gather (`group_tag`, or `FINAL_TAG`)."""
    others: tuple[PeerId, ...]
    """The group but us."""
    skip: str = ""
    """Why no round runs ("" when one does)."""


def gossip_plan(records: Sequence[PeerRecord], banned: Collection[PeerId], *, me: PeerId, my_round: int, run_id: str,
                size: int, everyone: bool = False, fragments: int = 1) -> GroupPlan:
    """Our gossip round from the records: the round to run (ours, or the newest a live peer shows: `round_to_run`) and
    our group (`group_of`, among live peers we did not ban). With `everyone`, the run's final average instead: at the
    newest round a live peer shows (ours at least), every live peer (`FINAL_TAG`). With `fragments` P > 1, a round to
    run of another fragment than `my_round`'s (round r is fragment r mod P's) is skipped: our next round is that
    round's successor, of our next fragment or near it."""
    rnd = round_to_run(records, me, my_round)
    if everyone:  # the final average: at the newest round a live peer shows, so peers that ended apart meet
        rnd = max([my_round, *(r.round for r in serving(records) if r.peer != me)])
    peers = [r.peer for r in serving(records) if r.peer != me and r.peer not in banned]
    group = tuple(sorted({*peers, me})) if everyone else group_of(me, peers, rnd, run_id, size)
    key = RoundKey(rnd)
    if len(group) < 2:
        return GroupPlan(key, "", (), "no other peer to gossip with")
    if not everyone and rnd % fragments != my_round % fragments:
        return GroupPlan(key, "", (), f"behind: the others are at round {rnd}, another fragment's")
    return GroupPlan(key, FINAL_TAG if everyone else group_tag(rnd, group), tuple(p for p in group if p != me))
