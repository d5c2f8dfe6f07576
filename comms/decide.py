"""Step 4 of a round (`diloco.comms.collective`): vote, and commit once a quorum accepted the value.

`decide` tells every view member that we accepted the value and commits once the members that accepted it form a
quorum; `carry` gets the value a later attempt carries (ours, or fetched from a member that accepted it:
`diloco.value`); `outcome` is a committed round's `RoundOutcome`. `on_vote` and `on_value` answer the others.
Why two peers never commit different values for one round: the module docstring of `diloco.comms.collective`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING, Callable, Collection

import torch

from diloco.compression import PayloadRejected, Reason

from . import messages as msg
from .results import parse_result
from .rounds import Exchange, RoundOutcome, Value, placeholder, short, wait_until
from .spans import RoundKey, make_view, member_token, parse_member, view_id
from .transport import PeerId, TransportError

if TYPE_CHECKING:
    from .collective import Collective

log = logging.getLogger(__name__)

Admit = Callable[[tuple[PeerId, ...]], tuple[bool, str]]
"""`admit(view)` -> (ok, reason): whether a closed view, or the members that accepted a value, may go on."""


async def decide(c: Collective, r: Exchange, value: Value, numel: int, admit: Admit) -> RoundOutcome:
    """Step 4: vote, and commit once the members that accepted `value` form a quorum."""
    rs, key = r.rs, r.key
    votes = rs.votes.setdefault(rs.vid, set())
    votes.add(c.me)
    past: set[PeerId] = set()  # members that will never accept this attempt's value
    elsewhere: list[PeerId] = []  # members that committed this round with another value

    def quorum(members: Collection[PeerId]) -> bool:
        return 2 * len(members) > len(r.view) and admit(make_view(list(members)))[0]

    async def vote(p: PeerId) -> None:
        reply = await c.call(p, "diloco.vote", c.frame(msg.VOTE, key, view=rs.vid))
        if reply is None:
            unreached.add(p)  # unknown, and (`doubtful`) not answering
            rs.changed.set()
            return
        unreached.discard(p)
        if not reply.get("ok", False):
            return  # refused: unknown
        if reply.get("accepted") or (reply.get("committed") and reply.get("value") == value.vid):
            votes.add(p)  # it accepted our value, or committed it (so a quorum accepted it)
        elif reply.get("committed"):
            elsewhere.append(p)
        elif reply.get("past"):
            past.add(p)
        rs.changed.set()

    asked: dict[PeerId, float] = {}  # when each vote still on its way was sent
    unreached: set[PeerId] = set()  # members whose last vote could not be delivered (gone, or cut off)

    def silent(p: PeerId) -> bool:
        """Our vote to `p` has gone unanswered through the answer window, or could not be delivered (or `p` was found
        silent lately): frozen, dead or cut off, as far as this decision can tell; its answer still counts if it
        comes."""
        now = time.monotonic()
        return (p in unreached or (not tasks[p].done() and now - asked[p] >= c.cfg.answer_timeout)
                or c.silent.get(p, 0) > now)

    def doubtful() -> bool:
        """Members moved past the attempt, and no quorum can form without a silent member: the members that
        answer, with the votes we have, are too few. Waiting would wait for the silent one (a frozen member costs
        every member that accepted until it wakes); instead we go on in doubt, and the next attempt, with the
        members that answer, carries the value. While nobody moved past, a silent member may be slow, not gone,
        and its vote may commit the round: we wait for it (to the deadline)."""
        undecided = {p for p in r.view if p not in votes and p not in past and p not in elsewhere}
        return bool(past) and not quorum(votes | {p for p in undecided if not silent(p)})

    def settled() -> bool:
        return quorum(votes) or bool(elsewhere) or not quorum(set(r.view) - past) or doubtful()

    def ask(p: PeerId) -> asyncio.Task[None]:
        asked[p] = time.monotonic()
        return asyncio.create_task(vote(p))

    tasks = {p: ask(p) for p in r.view if p != c.me}
    deadline = max(r.closed_at + c.cfg.result_timeout, time.monotonic()) + c.cfg.call_timeout
    try:
        c.faults.hit("decide", key.round)
        # A member that answered "not accepted (yet)" may give the attempt up later (a result it never gets):
        # ask again a third of an answer window apart, so that we hear it moved past, rather than wait out the
        # deadline (and find a vote unanswered through the window within a third of one).
        while not await wait_until(rs, settled, min(deadline, time.monotonic() + c.cfg.answer_timeout / 3)) \
                and time.monotonic() < deadline:
            for p, t in tasks.items():
                if t.done() and p not in votes and p not in past and p not in elsewhere:
                    tasks[p] = ask(p)
    finally:
        # A quorum decides: we commit without waiting for the replies to our own votes (a round trip), and a
        # vote still on its way goes on in the background: a member waiting for it needs it to decide. A peer
        # that leaves lets them arrive first (`settle`), and lingers while a peer is behind.
        for t in tasks.values():
            if quorum(votes) and not t.done():
                c.background.add(t)
                t.add_done_callback(c.background.discard)
            else:
                t.cancel()
    ran = c.ran.get(rs.vid)
    spent = ran.payload_bytes if ran is not None else 0
    if quorum(votes):
        return outcome(c, key, value, numel, spent, rs.lean)
    if elsewhere:
        return RoundOutcome(key, False, f"late: {short(elsewhere)} committed round {key.round} with another "
                            "value", r.view, payload_bytes=spent)
    if not quorum(set(r.view) - past):
        return RoundOutcome(key, False, f"abandoned: {len(past)} of {len(r.view)} members moved past attempt "
                            f"{key.attempt} without accepting its value", r.view, payload_bytes=spent)
    return RoundOutcome(key, False, f"in doubt: {len(votes)} of {len(r.view)} members confirmed the value; the "
                        "next attempt carries it", r.view, payload_bytes=spent, in_doubt=True)


def outcome(c: Collective, key: RoundKey, value: Value, numel: int, spent: int, lean: bool = False) -> RoundOutcome:
    """A committed round: the aggregate (or, `lean`, the value to read it from span by span), who was
    averaged where, and what of our Δ counted."""
    aggregate = None if lean else assembled(value)
    contributors = [tuple(value.view[j] for j in idx) for _, _, idx in value.results]
    owners: dict[int, set[int]] = {}  # member -> the owners (view indices) that marked it in some span
    for span, marked in enumerate(value.marked):
        for j in marked:
            owners.setdefault(j, set()).add(span % len(value.view))
    offenders = tuple(value.view[j] for j, by in sorted(owners.items()) if 2 * len(by) > len(value.view))
    ran = c.ran.get(value.vid)  # our side of the attempt that computed the value, if we were in it
    sent = torch.zeros(numel) if c.pipeline.spec.ef is not None else None  # for error feedback only
    if ran is not None and sent is not None:
        for i, ((lo, hi), (_, _, idx)) in enumerate(zip(ran.bounds, value.results)):
            if ran.mine in idx:  # the owner of span i included our contribution: it counts as sent
                ours = ran.own[i] if i in ran.own else \
                    c.pipeline.decode(ran.payloads[i], hi - lo)
                sent[lo:hi] = ours.dense(hi - lo)
    reason = "committed" if value.key == key else f"committed the value of attempt {value.key.attempt}"
    return RoundOutcome(key, True, reason, value.view, aggregate, contributors, sent, offenders, spent,
                        value_id=value.vid, value=value if lean else None)


def assembled(value: Value) -> torch.Tensor:
    """The value's results as one Δ̄: the aggregate buffer they were written into, or (a value fetched
    from another member) a concatenation."""
    tensors = [t for _, t, _ in value.results]
    base = tensors[0]._base if tensors and tensors[0]._base is not None else None
    if base is not None and base.numel() == sum(t.numel() for t in tensors) and all(
            t._base is base and t.storage_offset() == off for t, off in
            zip(tensors, itertools.accumulate([0, *(t.numel() for t in tensors[:-1])]))):
        return base
    return torch.cat(tensors)


async def carry(c: Collective, r: Exchange, carried: tuple[int, str], numel: int) -> Value | None:
    """The value our view carries: ours if we accepted it, else fetched from a member that did."""
    _, value_id = carried
    if c.accepted is not None and c.accepted.value.vid == value_id:
        return c.accepted.value
    holders = sorted(p for p in r.view if p != c.me and r.rs.accepted.get(p, (0, ""))[1] == value_id)
    deadline = r.closed_at + c.cfg.result_timeout
    for peer in holders:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        value = await _fetch_value(c, peer, r.key.round, value_id, numel, r.rs.fragment, remaining, r.rs.lean)
        if value is not None:
            return value
    return None


async def _fetch_value(c: Collective, peer: PeerId, rnd: int, value_id: str, numel: int, fragment: int,
                       timeout: float, lean: bool = False) -> Value | None:
    """Download value `value_id` of round `rnd` from `peer` and check it; None when it cannot be had."""
    request = msg.encode(msg.VALUE, run=c.run_id, sender=c.me, schema=c.schema, key=RoundKey(rnd),
                         view=value_id)
    try:
        reply = await c.transport.call(peer, "diloco.value", request, timeout)
    except TransportError as e:
        log.info("event=value_fetch_failed peer=%s reason=%s", peer, e)
        return None
    try:
        return read_value(c, peer, reply, rnd, value_id, numel, fragment, lean)
    except PayloadRejected as e:
        if e.reason is Reason.WRONG_KIND:  # an ack: it no longer holds the value
            log.info("event=value_fetch_refused peer=%s", peer)
        else:
            c.count_rejection(peer, e)
        return None


def read_value(c: Collective, peer: PeerId, data: bytes, rnd: int, value_id: str, numel: int, fragment: int,
               lean: bool = False) -> Value:
    """A served value, checked: its members hash to its id, and every span's result frame is the
    one its owner would have sent for that view (size, span, attempt), with values that admit."""
    header, body, key = msg.decode(data, run=c.run_id, kind=msg.VALUE, caller=peer,
                                   max_body=c.cfg.max_payload, schema=c.schema)
    items = msg.unpack_bundle(body, max_items=msg.MAX_NAMES + 1)
    if key.round != rnd or header.view != value_id or items[0][0] != 0 or \
            [i for i, _ in items[1:]] != list(range(1, len(items))):
        raise PayloadRejected(Reason.WRONG_VIEW, f"served value is not {value_id} of round {rnd}")
    try:
        parsed = [parse_member(t) for t in bytes(items[0][1]).decode().split("\n")]
    except (UnicodeDecodeError, ValueError) as e:
        raise PayloadRejected(Reason.BAD_HEADER, f"value members are not peer ids: {e}") from None
    members, incarnations = tuple(p for p, _ in parsed), {p: inc for p, inc in parsed if inc}
    if view_id(key, members, fragment, incarnations=incarnations) != value_id:
        raise PayloadRejected(Reason.WRONG_VIEW, f"served members do not hash to value {value_id}")
    bounds = c.bounds(numel, len(members))
    if len(bounds) != len(items) - 1:
        raise PayloadRejected(Reason.WRONG_VIEW, f"served value has {len(items) - 1} spans, a Δ of {numel} "
                                                 f"among {len(members)} members has {len(bounds)}")
    frames, results, marked = [], [], []
    for i, (_, raw) in enumerate(items[1:]):
        frame = bytes(raw)
        h, b, k = msg.decode(frame, run=c.run_id, kind=msg.RESULT, caller=members[i % len(members)],
                             max_body=c.cfg.max_payload, schema=c.schema)
        if k != key or h.view != value_id or h.span != i or h.numel != bounds[i][1] - bounds[i][0]:
            raise PayloadRejected(Reason.WRONG_SPAN, f"served result {i} is not span {i} of value {value_id}")
        idx, mk, tensor = parse_result(c, h, b, len(members))
        frames.append(frame)
        results.append((members[i % len(members)], placeholder(tensor.numel()) if lean else tensor, idx))
        marked.append(mk)
    return Value(key, value_id, members, frames, results, marked, incarnations)


async def on_vote(c: Collective, caller: PeerId, data: bytes) -> bytes:
    """A member accepted the value of its view `header.view` in attempt `key`: count it, and say
    whether we accepted it too, committed the round already, or moved past that attempt."""
    try:
        header, _, key = c.decode_from(caller, data, msg.VOTE, 0)
        if key.round <= c.committed_through:
            ballot, value = c.decided.get(key.round, ("", ""))
            if ballot == header.view:  # we accepted that very attempt's value, then committed it
                return msg.ack(run=c.run_id, sender=c.me, accepted=True)
            return msg.ack(run=c.run_id, sender=c.me, committed=True, value=value)
        acc = c.accepted
        accepted = acc is not None and acc.ballot == key and acc.vid == header.view
        if key < c.floor:  # an attempt we left: we accepted its value then, or we never will
            return msg.ack(run=c.run_id, sender=c.me, accepted=accepted, past=not accepted)
        rs = c.accepting(key)
        if rs.view is None:  # our gather is still open: keep the vote, boundedly, until our view closes
            rs.check_buffered(header.view)
        elif rs.vid != header.view or caller not in rs.view:
            raise PayloadRejected(Reason.WRONG_VIEW, f"vote for view {header.view}, ours is {rs.vid or 'none'}")
        rs.votes.setdefault(header.view, set()).add(caller)
        rs.changed.set()
        return msg.ack(run=c.run_id, sender=c.me, accepted=accepted)
    except PayloadRejected as e:
        return c.reject(caller, e)


async def on_value(c: Collective, caller: PeerId, data: bytes) -> bytes:
    """Serve the value we accepted (its members and every span's result frame) to a member whose
    view carries it."""
    try:
        header, _, key = c.decode_from(caller, data, msg.VALUE, 0)
    except PayloadRejected as e:
        return c.reject(caller, e)
    acc = c.accepted
    if acc is None or acc.ballot.round != key.round or acc.value.vid != header.view:  # committed, or moved on
        return msg.ack(run=c.run_id, sender=c.me, ok=False, reason="value not held")
    v = acc.value
    members = "\n".join(member_token(p, v.incarnations.get(p, 0)) for p in v.view)
    body = msg.pack_bundle([(0, members.encode()), *((i + 1, f) for i, f in enumerate(v.frames))])
    return msg.encode(msg.VALUE, run=c.run_id, sender=c.me, schema=c.schema, key=v.key, view=v.vid,
                      body=body)
