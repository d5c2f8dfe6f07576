"""Step 1 of a round (`diloco.comms.collective`): the gather, which closes the round's view.

Each member tells every peer it expects that it is ready (`diloco.ready`, carrying the digest of its global state,
the peers it expects and whom of them it waits for, and what it accepted in an earlier attempt) and waits until
they are ready too, or until `gather_timeout`; stragglers get a tenth of it as grace. `close_view` is our side;
`on_ready` answers a peer's ready (and says whether we are ready, closed our view, or committed the round).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Collection

from diloco.compression import PayloadRejected, Reason

from . import messages as msg
from .rounds import RoundOutcome, RoundState, short, wait_until
from .spans import RoundKey, make_view, view_id
from .transport import PeerId

if TYPE_CHECKING:
    from .collective import Collective

log = logging.getLogger(__name__)


async def close_view(c: Collective, rs: RoundState, key: RoundKey, digest: str, others: list[PeerId],
                     wait_for: Collection[PeerId] | None = None) -> RoundOutcome | None:
    """Exchange ready messages and close the view; a RoundOutcome when we turn out to be late.

    Ready is symmetric: a peer ready for this key says so in its reply (or that it closed its view
    with us in it, which it does only with our digest), so one of two ready messages lost to a race
    (the receiver was still catching up and refused it) cannot leave one side waiting. Each ready
    carries whom its sender expects; we ask and wait for those too (`RoundState.named`)."""
    rs.ready[c.me] = digest
    rs.incarnations[c.me] = c.incarnation
    rs.banned = frozenset(c.banned)
    rs.expected = tuple(others)
    rs.wait_for = frozenset(wait_for) if wait_for is not None else None
    replies: dict[PeerId, dict[str, Any] | None] = {}

    async def ask(p: PeerId) -> None:
        frame = msg.encode(msg.READY, run=c.run_id, sender=c.me, schema=c.schema, key=key,
                           fragment=rs.fragment,
                           meta={"digest": digest, "inc": c.incarnation, **accepted_meta(c, key)},
                           body=msg.pack_names(rs.named(c.me), rs.waited(c.me)))
        held = rs.incarnations.get(p) if p in rs.ready else None  # its ready, already here as we ask
        r = await c.call(p, "diloco.ready", frame)
        refused = r is not None and not r.get("ok", False)
        if r is not None and (r.get("reason") == Reason.BANNED.value or r.get("abstains") is True):
            r = None  # it banned us, or takes no part in rounds now: we do not wait for it
        if (rs.view is None and held is not None and rs.incarnations.get(p) == held
                and (r is None or refused or not _same_process(r, held))):
            # the ready we held as we asked (it came before we began) is of a process that cannot take part
            # now: gone, refusing us (a restart still building its model), or restarted since. Its answer was
            # made after it sent that ready, so it is news, not a reordering: no member of our view.
            del rs.ready[p]
            rs.incarnations.pop(p, None)
            log.info("event=ready_withdrawn round=%s peer=%s reason=%s", key, p,
                     "unreachable" if r is None else r.get("reason") if refused else "restarted")
        replies[p] = r
        ready = r.get("ready") if r else None
        if r and r.get("closed") and r.get("in_view"):
            ready = digest
        if isinstance(ready, str) and 0 < len(ready) <= 128:
            try:
                accepted, inc = accepted_of(r or {}, key), incarnation_of(r or {})
            except PayloadRejected as e:
                log.info("event=ready_reply_ignored peer=%s reason=%s", p, e.detail)
                return
            if p not in rs.ready:
                rs.incarnations[p] = inc
            rs.ready.setdefault(p, ready)
            rs.lists.setdefault(p, r.get("expect", frozenset()) if r else frozenset())
            rs.waits.setdefault(p, r.get("waits", frozenset()) if r else frozenset())
            if accepted is not None:
                rs.accepted.setdefault(p, accepted)
        rs.changed.set()

    # everyone we expect, and whoever told us already that it is ready for this key. The replies of
    # those we wait for are awaited; a straggler's counts if it comes in time, so a hung straggler
    # costs the others the grace below in each round its record lives, not a whole call timeout.
    asked = set(others) | (set(rs.ready) - {c.me})
    first = rs.waited(c.me)
    later = {p: asyncio.create_task(ask(p)) for p in asked - first}
    grace = c.cfg.gather_timeout / 10

    since: dict[PeerId, float] = {}  # when each ask still on its way was sent
    muted: dict[PeerId, float] = {}  # left a question unanswered through the answer window, since when

    def ask_again(peers: Collection[PeerId]) -> None:
        """Those of `peers` we wait for that answered "not yet" may have died, left, gone on standby or
        closed their view since (their ready would then never come): ask them again to hear which. One that
        leaves such a question unanswered through the answer window froze after it answered: not waited for."""
        now = time.monotonic()
        for p in set(peers) & rs.waited(c.me) - set(rs.ready):
            if replies.get(p, {}) is None:
                continue
            if p not in later or later[p].done():
                later[p], since[p] = asyncio.create_task(ask(p)), now
            elif now - since.get(p, now) >= c.cfg.answer_timeout:
                replies[p] = None
                muted[p] = now
                c.mark_silent(p)
                log.info("event=peer_silent round=%s peer=%s", key, p)

    def closed(everyone: bool) -> bool:
        """Ask newly named peers, and again those whose records changed (`recheck`); then: did a reply show we
        are late, or is every named peer we wait for ready (or unreachable, or taking no part)?"""
        named = rs.named(c.me)
        for p in named - asked:
            asked.add(p)
            later[p] = asyncio.create_task(ask(p))
        ask_again(rs.recheck)
        rs.recheck.clear()
        if late_outcome(key, replies, named) is not None:
            return True
        # stragglers (ours, or those of the peers that named a peer to us) get only the grace
        waited = named if everyone else rs.waited(c.me)
        return all(p in rs.ready for p in waited if replies.get(p, {}) is not None)

    try:
        # A peer we have heard from before that leaves our ready unanswered through the answer window is frozen
        # or overloaded: not waited for (its reply, or its own ready, still counts if it comes before we close).
        # A first contact (dialing, handshakes) gets the whole call timeout.
        # One found silent lately is not waited for at all until it answers something again.
        asking = {p: asyncio.create_task(ask(p)) for p in asked & first}
        now = time.monotonic()
        fresh = [t for p, t in asking.items() if c.silent.get(p, 0) <= now]
        if fresh:
            await asyncio.wait(fresh, timeout=c.cfg.answer_timeout)
        elif asking:
            await asyncio.wait(asking.values(), timeout=c.cfg.answer_timeout / 20)  # a round trip, no more
        for p, task in asking.items():
            if not task.done() and c.transport.counter.per_peer.get(p, [0, 0])[1] > 0:
                replies[p] = None
                later[p] = task
                muted[p] = time.monotonic()
                c.mark_silent(p)
                log.info("event=peer_silent round=%s peer=%s", key, p)
        # nor does a straggler found silent lately get the stragglers' grace (it froze: every round its record
        # outlives it would wait the grace for it); its answer, if it comes, counts as anyone's
        for p, task in later.items():
            if p not in asking and not task.done() and c.silent.get(p, 0) > now:
                replies[p] = None
        await asyncio.gather(*(t for p, t in asking.items() if p not in later))
        c.faults.hit("gather", key.round)
        # those we wait for are asked again a third of an answer window apart: one that answered "not yet" and then
        # froze is found silent a window after the next question, within a grace (a window and a half, not the two
        # graces of asking a grace apart: 12 s against 4.2 s in a chaos soak)
        deadline, tick = time.monotonic() + c.cfg.gather_timeout, c.cfg.answer_timeout / 3
        while not await wait_until(rs, lambda: closed(False), min(deadline, time.monotonic() + tick)) \
                and time.monotonic() < deadline:
            ask_again(rs.waited(c.me))
        if not closed(True):  # stragglers get a short grace (a tenth of the gather timeout) to get back in
            await wait_until(rs, lambda: closed(True), time.monotonic() + grace)
        # a straggler that told us it is ready may have moved on since (committed, or closed
        # without us): before taking it in, give our call to it the grace to say so
        pending = [t for p, t in later.items() if p in rs.ready and not t.done()]
        if pending and late_outcome(key, replies, rs.named(c.me)) is None:
            await asyncio.wait(pending, timeout=grace)
    finally:
        for t in later.values():
            t.cancel()
    late = late_outcome(key, replies, rs.named(c.me))
    if late is not None:
        rs.view = ()
        return late
    named = rs.named(c.me)
    # a peer whose ready we hold (it may have come before we began) but that has left our question unanswered
    # through the answer window, still unanswered now and with no ready of its own since, is cut off or frozen:
    # it would fail the attempt
    mute = {p for p, since in muted.items() if not later[p].done() and rs.heard.get(p, 0.0) <= since}
    view = make_view([p for p, d in rs.ready.items()
                      if d == digest and (p == c.me or p in named) and p not in mute])
    # what the view carries: the value accepted in the highest earlier attempt any member reports
    reports = [rs.accepted[p] for p in view if p in rs.accepted and p != c.me]
    own = accepted_by_us(c, key)
    rs.carried = max([*reports, *([own] if own else [])], default=None)
    rs.view, rs.vid = view, view_id(key, view, rs.fragment, rs.carried[1] if rs.carried else "", rs.incarnations)
    return None


def late_outcome(key: RoundKey, replies: dict[PeerId, dict[str, Any] | None],
                 named: set[PeerId]) -> RoundOutcome | None:
    """A failed outcome if a reply shows that the round went on without us: anyone committed it, or
    a peer we count on closed its view without us (one nobody expects closing without us is no news)."""
    committed = [p for p, r in replies.items() if r and r.get("committed")]
    if committed:  # someone already committed this round: running another attempt would fork the state
        return RoundOutcome(key, False, f"late: {short(committed)} committed round {key.round} already")
    closed_without_us = [p for p, r in replies.items()
                         if r and r.get("closed") and not r.get("in_view") and p in named]
    if closed_without_us:
        return RoundOutcome(key, False, f"late: {len(closed_without_us)} peer(s) closed round {key} without us")
    return None


def accepted_by_us(c: Collective, key: RoundKey) -> tuple[int, str] | None:
    """(attempt, value id) we accepted in an earlier attempt of `key`'s round, if any."""
    acc = c.accepted
    if acc is None or acc.ballot.round != key.round or acc.ballot >= key:
        return None
    return acc.ballot.attempt, acc.value.vid


def accepted_meta(c: Collective, key: RoundKey) -> dict[str, Any]:
    own = accepted_by_us(c, key)
    return {} if own is None else {"acc_attempt": own[0], "acc_value": own[1]}


async def on_ready(c: Collective, caller: PeerId, data: bytes) -> bytes:
    try:
        header, body, key = c.decode_from(caller, data, msg.READY, msg.MAX_NAMES_BYTES)
        digest = header.meta.get("digest")
        if not isinstance(digest, str) or len(digest) > 128:
            raise PayloadRejected(Reason.BAD_HEADER, "ready needs a string meta.digest")
        inc = incarnation_of(dict(header.meta))
        me = c.incarnation
        if key.round <= c.committed_through:  # we committed this round: the sender must catch up, not fork
            return msg.ack(run=c.run_id, sender=c.me, closed=True, in_view=False, committed=True, inc=me)
        if key < c.floor:  # a round we already finished: tell the late peer at once
            return msg.ack(run=c.run_id, sender=c.me, closed=True, in_view=False, inc=me)
        if c.abstaining:  # not bad input: the sender's records were a moment behind ours
            return msg.ack(run=c.run_id, sender=c.me, closed=False, in_view=False, abstains=True, inc=me)
        expects, waits = msg.unpack_names(body)
        accepted = accepted_of(dict(header.meta), key)
        rs = c.accepting(key)
        names = rs.named(c.me) if rs.expected is not None else set()
        waited = rs.waited(c.me) if rs.expected is not None else set()
        ours = accepted_meta(c, key)
        if rs.view is not None:  # in it only as the process that was ready: a restarted one is late
            in_view = caller in rs.view and rs.incarnations.get(caller, 0) in (0, inc)
            return msg.ack(run=c.run_id, sender=c.me, closed=True, in_view=in_view, names=names,
                           waited=waited, inc=me, **ours)
        rs.ready[caller], rs.incarnations[caller] = digest, inc  # a restart's ready replaces its old process's
        rs.heard[caller] = time.monotonic()
        rs.lists[caller], rs.waits[caller] = expects, waits
        if accepted is not None:
            rs.accepted[caller] = accepted
        rs.changed.set()
        # whether we are ready for this key too (see close_view); "" when not yet: the reply is the same size
        # either way, so a round's bytes do not depend on who asked first
        mine: dict[str, Any] = {"ready": rs.ready.get(c.me, ""), "inc": me}
        return msg.ack(run=c.run_id, sender=c.me, closed=False, in_view=False, names=names, waited=waited,
                       **mine, **ours)
    except PayloadRejected as e:
        return c.reject(caller, e)


def accepted_of(meta: dict[str, Any], key: RoundKey) -> tuple[int, str] | None:
    """The (attempt, value id) a ready message or its reply reports as accepted earlier in `key`'s
    round; None when it reports none. Raises PayloadRejected when the report is malformed."""
    attempt, value = meta.get("acc_attempt"), meta.get("acc_value")
    if attempt is None and value is None:
        return None
    if not isinstance(attempt, int) or isinstance(attempt, bool) or not 0 <= attempt < key.attempt \
            or not isinstance(value, str) or not 0 < len(value) <= 64:
        raise PayloadRejected(Reason.BAD_HEADER, f"accepted report ({attempt!r}, {value!r}) does not fit attempt {key}")
    return attempt, value


def incarnation_of(meta: dict[str, Any]) -> int:
    """The sender's incarnation a ready message or its reply carries (0: none said, as a peer without one, e.g. a
    test's puppet, says). Raises PayloadRejected when it is not a number in [0, 2⁶³)."""
    inc = meta.get("inc", 0)
    if type(inc) is not int or not 0 <= inc < 1 << 63:
        raise PayloadRejected(Reason.BAD_HEADER, f"meta.inc must be an incarnation number, got {inc!r}")
    return inc


def _same_process(reply: dict[str, Any], held: int) -> bool:
    """Whether `reply` came from incarnation `held` (unknown on either side: yes)."""
    try:
        inc = incarnation_of(reply)
    except PayloadRejected:
        return True  # a malformed number is not news of a restart; the reply is judged where it is read
    return inc == 0 or held in (0, inc)
