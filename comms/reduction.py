"""Steps 2 and 3 of a round (`diloco.comms.collective`): the reduce-scatter and the all-gather of results.

Δ is cut into one span per view member; member i owns span i. `exchange` encodes our Δ (off the event loop), sends
each span to its owner (`IN_FLIGHT` frames at a time to each), reduces the spans we own once their contributions are
in (`reduce_span`: robust aggregation, then the mean or a bundle of the payloads) and sends each result to every
member, while the probes of `diloco.comms.watch` find members that are gone. `on_contrib` and `on_result` take the
frames of the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from diloco.compression import PayloadRejected, Reason
from diloco.compression.pipeline import Decoded

from . import messages as msg
from . import results, robust, watch
from .reduce import order_key, summation_order, uneven
from .rounds import Contribution, Exchange, Handoff, RoundState, Value, lap, placeholder, wait_until, weight_ok
from .spans import RoundKey
from .transport import PeerId

if TYPE_CHECKING:
    from .collective import Collective

log = logging.getLogger(__name__)

IN_FLIGHT = 2  # contribution frames on their way to one owner at a time (docs/BENCHMARKS.md, B3)


async def exchange(c: Collective, r: Exchange, handoff: Handoff) -> Value | None:
    """Steps 2 and 3 with our fresh Δ: the value (every span's result), or None if one is missing."""
    rs = r.rs
    c.ran[rs.vid] = r
    # Encoding the whole Δ is the heavy part: off the event loop, so handlers keep answering peers.
    r.payloads = await asyncio.to_thread(partial(_encode, c), handoff, r.bounds, r.key.round)
    encoded = lap(rs, "encode", r.closed_at)
    r.payload_bytes = sum(len(p) for p in r.payloads)
    c.faults.hit("encode", r.key.round)
    for span in r.owned:
        own = r.own[span] = c.pipeline.decode(r.payloads[span], r.numel(span))
        rs.contribs.setdefault((rs.vid, span), {})[c.me] = _contribution(c, r.payloads[span], own, rs.weight)
        if c.pipeline.spec.ef is None:  # only error feedback reads it again; we hold it decoded meanwhile
            r.payloads[span] = b""
    for (view, span), (owner, tensor, idx) in list(rs.results.items()):  # results that came before our view
        if view != rs.vid:
            continue
        if span >= rs.spans or tensor.numel() != r.numel(span):
            del rs.results[(view, span)]
            c.count_rejection(owner, PayloadRejected(Reason.WRONG_SIZE, f"result for span {span} does not "
                                                     "fit the round's partition"))
        else:
            rs.results[(view, span)] = (owner, into_aggregate(rs, span, tensor), idx)

    tasks = [asyncio.create_task(_send_contributions(c, r)), asyncio.create_task(_reduce_and_broadcast(c, r)),
             asyncio.create_task(watch.watch(c, r))]
    try:
        # a member that closed another view, or that is gone, never sends a result for ours: no use waiting
        # out the deadline
        complete = await wait_until(rs, lambda: r.complete() or bool(r.closed_elsewhere() or r.lost()),
                                    r.closed_at + c.cfg.result_timeout) and r.complete() and not r.closed_elsewhere()
        r.missed = [] if complete else [s for s in range(len(r.bounds)) if (rs.vid, s) not in rs.results]
        # Having every result does not mean everyone has ours: let our sends finish (bounded), but those to a
        # member that is gone (the probes go on meanwhile: a frozen member costs a window, not a call timeout).
        # An attempt we give up needs none of them: we accept nothing in it.
        if complete:
            await wait_until(rs, r.delivered, time.monotonic() + c.cfg.call_timeout)
    finally:
        for t in tasks:
            t.cancel()
    lap(rs, "exchange", encoded)
    if not complete:
        return None
    spans = range(len(r.bounds))
    return Value(r.key, rs.vid, r.view, [rs.frames[(rs.vid, i)] for i in spans],
                 [rs.results[(rs.vid, i)] for i in spans], [rs.marked.get((rs.vid, i), ()) for i in spans],
                 {p: rs.incarnations[p] for p in r.view if p in rs.incarnations})


def _encode(c: Collective, handoff: Handoff, bounds: list[tuple[int, int]], round_: int) -> list[bytes | memoryview]:
    # after this, the round holds Δ only as its encoded spans (a poisoning plan scales each span first)
    return [c.pipeline.encode_parts([c.faults.outgoing(round_, part) for part in parts])
            for parts in handoff.span_parts(bounds)]


def _contribution(c: Collective, body: bytes | memoryview, decoded: Decoded, weight: int = 1,
                  crc: int | None = None, norm: float | None = None) -> Contribution:
    return Contribution(order_key(body, crc), decoded, bytes(body) if c.pipeline.sparse else None, weight, norm)


async def _send_contributions(c: Collective, r: Exchange) -> None:
    async def send(owner: PeerId, span: int, window: asyncio.Semaphore) -> None:
        async with window:
            if owner in r.rs.elsewhere:  # it closed another view: the rest of its spans would be refused too
                r.owed[owner] -= 1
                return
            reply = await _deliver(c, r, owner, "diloco.contrib", c.frame(
                msg.CONTRIB, r.key, view=r.rs.vid, span=span, numel=r.numel(span), body=r.payloads[span],
                meta={"weight": r.rs.weight} if r.rs.weight != 1 else None))
            if reply is None:
                r.rs.undeliverable.add(owner)  # a probe from it will hear so: it need not wait for us
            elif reply.get("reason") == Reason.WRONG_VIEW.value:
                r.rs.mark_elsewhere(owner)
            elif c.pipeline.spec.ef is None:  # only error feedback reads it again (what of Δ was sent)
                r.payloads[span] = b""

    # A few frames at a time to each owner, in span order (the transport copies a frame while it is on its way,
    # so a model cut into many spans costs IN_FLIGHT spans per owner): over a long path one stream is held
    # back by its flow-control window, two keep the link busy; a slow owner holds up only its own spans.
    windows = {p: asyncio.Semaphore(IN_FLIGHT) for p in r.view if p != c.me}
    r.owed.update(r.owner(span) for span in range(len(r.bounds)) if r.owner(span) != c.me)
    await asyncio.gather(*(send(r.owner(span), span, windows[r.owner(span)])
                           for span in range(len(r.bounds)) if r.owner(span) != c.me))
    c.faults.hit("send", r.key.round)


async def _reduce_and_broadcast(c: Collective, r: Exchange) -> None:
    """Owner's side: each span we own, in order, once every member's contribution to it is in (or at the
    deadline): reduce it and send its result while the next span's contributions are still arriving."""
    def arrived(span: int) -> bool:  # every member's contribution is in, refused, or will never come
        got = r.rs.contribs.get((r.rs.vid, span), {})
        rs = r.rs
        return all(p in got or p in rs.gone or p in rs.owes_nothing or p in rs.refused.get(span, ())
                   for p in r.view)

    sends = []
    window = asyncio.Semaphore(IN_FLIGHT)  # results on their way, as for contributions: each one a copy in flight
    try:
        for span in r.owned:
            await wait_until(r.rs, partial(arrived, span), r.closed_at + c.cfg.reduce_timeout)
            frame = reduce_span(c, r, span)
            r.owed.update(p for p in r.view if p != c.me)
            await window.acquire()
            sends.append(asyncio.create_task(_broadcast(c, r, frame, window)))
        await asyncio.gather(*sends)
    finally:
        for t in sends:
            t.cancel()


def reduce_span(c: Collective, r: Exchange, span: int) -> bytes:
    """Reduce the contributions to `span` into its result: kept as ours, and returned as the frame to send."""
    got = r.rs.contribs.setdefault((r.rs.vid, span), {})
    refused = r.rs.refused.setdefault(span, set())
    if c.me in got and got[c.me].norm is None:
        size, why = robust.assess(got[c.me].decoded, c.cfg.robust)
        if why:
            log.warning("event=own_contribution_refused round=%s reason=%s", r.key, why)
            del got[c.me]
            refused.add(c.me)
        else:
            got[c.me] = dataclasses.replace(got[c.me], norm=size)
    senders = [p for p in r.view if p in got]
    for i in robust.overweight([got[p].weight for p in senders], c.cfg.robust.max_weight):
        p, floor = senders[i], min(got[q].weight for q in senders)
        log.warning("event=contribution_overweight round=%s span=%d peer=%s weight=%g lowest=%g max_weight=%g",
                    r.key, span, p, got[p].weight, floor, c.cfg.robust.max_weight)
        c.robust_events["overweight"] += 1
        del got[p]
        refused.add(p)
    senders = [p for p in senders if p in got]
    idx = tuple(r.view.index(p) for p in senders)
    weights = [got[p].weight for p in senders]
    weighted = uneven(weights)
    numel = r.numel(span)
    order = summation_order([got[p].order for p in senders])
    combined = robust.combine([got[senders[i]].decoded for i in order], numel, c.cfg.robust,
                              [weights[i] for i in order] if weighted else None,
                              [got[senders[i]].norm for i in order])
    outliers = _judge(c, [senders[i] for i in order], combined.norms, r.key)
    marked = tuple(sorted(r.view.index(p) for p in (outliers | refused) if p in r.view))
    r.rs.marked[(r.rs.vid, span)] = marked
    exact = None  # the result's values as every member decodes them, when that is the mean itself
    body: bytes | memoryview
    if c.pipeline.sparse:  # every member combines the bundle itself, the same way
        body = msg.pack_bundle([(i, got[p].body or b"") for i, p in zip(idx, senders)])
        kind = "bundle"
    else:
        # fp32: the mean's own bytes (the frame below copies them) decode to the mean, bit for bit
        exact = combined.values if c.mean_pipeline.exact else None
        body = c.mean_pipeline.encode_view(combined.values)
        kind = "mean"
    del combined, got  # the span's contributions are not needed past its result
    r.rs.contribs.pop((r.rs.vid, span), None)
    c.faults.hit("reduce", r.key.round)
    if exact is not None:
        results.admit(c, Decoded(None, exact), "result")
    result = into_aggregate(r.rs, span, exact if exact is not None else results.decode_result(
        c, kind, memoryview(body), numel, idx, weights if weighted else None))
    r.rs.results[(r.rs.vid, span)] = (c.me, result, idx)
    if c.pipeline.spec.ef is None:
        r.own.pop(span, None)  # our decoded contribution is needed past here only for error feedback
    r.rs.changed.set()
    meta: dict[str, Any] = {"contributors": list(idx), "result": kind, "marked": list(marked)}
    if weighted:  # a bundle's members weigh its payloads by these; a mean says what it was weighted by
        meta["weights"] = weights
    frame = c.frame(msg.RESULT, r.key, view=r.rs.vid, span=span, numel=numel, body=body, meta=meta)
    r.rs.frames[(r.rs.vid, span)] = frame
    return frame


def _judge(c: Collective, senders: list[PeerId], norms: list[float], key: RoundKey) -> set[PeerId]:
    """Log and count what robust aggregation does to this span's contributions; the far outliers."""
    cfg = c.cfg.robust
    for i, scale in enumerate(robust.clip_scales(norms, cfg.clip)):
        if scale != 1.0:
            c.robust_events["clipped"] += 1
            log.warning("event=contribution_clipped round=%s peer=%s norm=%.4g scale=%.3g", key, senders[i],
                        norms[i], scale)
    med = robust.median(norms) if norms else 0.0
    out = set()
    for i in robust.offenders(norms, cfg.strike):
        out.add(senders[i])
        log.warning("event=contribution_outlier round=%s peer=%s norm=%.4g median=%.4g", key, senders[i],
                    norms[i], med)
    return out


async def _broadcast(c: Collective, r: Exchange, frame: bytes, window: asyncio.Semaphore) -> None:
    try:
        await asyncio.gather(*(_deliver(c, r, p, "diloco.result", frame) for p in r.view if p != c.me))
    finally:
        window.release()


async def _deliver(c: Collective, r: Exchange, peer: PeerId, name: str, frame: bytes) -> dict[str, Any] | None:
    """`Collective.call` for a frame we owe `peer` (`Exchange.owed`, counted when it fell due)."""
    try:
        return await c.call(peer, name, frame)
    finally:
        r.owed[peer] -= 1
        r.rs.changed.set()


def into_aggregate(rs: RoundState, span: int, tensor: torch.Tensor) -> torch.Tensor:
    """Move a result of our view into the round's aggregate buffer; the buffer's slice, which replaces it."""
    if not rs.bounds:
        return tensor
    if rs.lean:
        return placeholder(tensor.numel())
    if rs.aggregate is None:  # allocated with the first result: it is not needed while spans are reduced
        rs.aggregate = torch.empty(rs.bounds[-1][1], dtype=torch.float32)
    lo, hi = rs.bounds[span]
    slot = rs.aggregate[lo:hi]
    slot.copy_(tensor)
    return slot


async def on_contrib(c: Collective, caller: PeerId, data: bytes) -> bytes:
    try:
        header, body, rs = c.span_frame(caller, data, msg.CONTRIB, owner=c.me)
        results.check_codec(c, header)
        weight = header.meta.get("weight", 1)
        if not weight_ok(weight):
            raise PayloadRejected(Reason.BAD_HEADER, f"weight {weight!r} must be a whole number of inner steps >= 1")
        bucket = rs.contribs.setdefault((header.view, header.span), {})
        if caller in bucket or caller in rs.refused.get(header.span, ()):  # one a span: a refused one counts
            raise PayloadRejected(Reason.DUPLICATE, f"second contribution from {caller} for span {header.span}")
        decoded = c.pipeline.decode(body, header.numel)
        try:
            size = results.admit(c, decoded, "contribution")
        except PayloadRejected:  # a member's own pseudo-gradient: our result marks it (see `Collective._strike`)
            rs.refused.setdefault(header.span, set()).add(caller)
            rs.changed.set()
            raise
        bucket[caller] = _contribution(c, body, decoded, weight, crc=header.crc32, norm=size)  # unpack verified it
        rs.changed.set()
        return msg.ack(run=c.run_id, sender=c.me)
    except PayloadRejected as e:
        return c.reject(caller, e)


async def on_result(c: Collective, caller: PeerId, data: bytes) -> bytes:
    try:
        header, body, rs = c.span_frame(caller, data, msg.RESULT, owner=caller)
        if rs.bounds and header.view == rs.vid:
            lo, hi = rs.bounds[header.span]
            if header.numel != hi - lo:
                raise PayloadRejected(Reason.WRONG_SIZE, f"result for span {header.span} holds {header.numel} "
                                                         f"values, the span has {hi - lo}")
        idx, marked, tensor = results.parse_result(c, header, body, len(rs.view) if rs.view else None)
        if (header.view, header.span) in rs.results:
            raise PayloadRejected(Reason.DUPLICATE, f"second result for span {header.span}")
        if header.view == rs.vid and rs.view is not None:
            tensor = into_aggregate(rs, header.span, tensor)
        rs.results[(header.view, header.span)] = (caller, tensor, idx)
        rs.marked[(header.view, header.span)] = marked
        rs.frames[(header.view, header.span)] = data  # ours to keep (`Handler`): no copy
        rs.changed.set()
        return msg.ack(run=c.run_id, sender=c.me)
    except PayloadRejected as e:
        return c.reject(caller, e)
