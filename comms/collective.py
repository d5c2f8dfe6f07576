"""One round of the DiLoCo exchange: a deadline-bounded reduce-scatter + all-gather.

Every member holds a flat fp32 pseudo-gradient Δ of the same length. A round runs in three steps:

1. **Gather.** Each member tells every peer it expects that it is ready (`ready`, carrying the
   digest of its global state and the peers it expects) and waits until all of them are ready
   too, or until `gather_timeout`; a peer that an expected peer expects is asked too, and waited
   for if that peer waits for it (stragglers get a tenth of the timeout as grace). The
   round's *view* is the sorted set of ready, expected members with the same digest. So members
   whose records disagree about a newcomer still close the same view, and a peer nobody expects
   yet is left out by everyone. A peer that learns that others closed the round without it gives
   up at once ("late").
2. **Reduce.** Δ is cut into one span per view member; member i owns span i. Everyone sends each
   span, encoded with the compression pipeline, to its owner. The owner waits for all view
   members until `reduce_timeout` and sends the *same bytes* to every member (itself included, by
   decoding them), so all peers apply identical values. For dense pipelines those bytes are the
   fp32 mean re-encoded once; for sparse ones (top-k, random-k) they are a *bundle* of the exact
   payloads it included, which every member decodes and averages per coordinate in view order.
3. **Gather results.** A member commits the round when it holds a result for every span, all
   tagged with its view id, by `result_timeout`. Each result names the members it averaged.

Failure semantics:
- A dead or slow member is not waited for past a deadline: a missing contribution is left out
  of its span's mean (the result lists who was averaged); a missing *owner* means its span has
  no result, so nobody with that view commits the round, and all of them retry it as the next
  attempt of the same round (their local progress is kept: the next Δ covers it).
- Peers whose views differ cannot mix data: frames carry the view id and are rejected otherwise.
  At most one view can commit a given round key, since committing needs a result from every
  member of the view and each member holds exactly one view.
- Malformed or unexpected frames are rejected with a `Reason`, counted in `rejections`, and
  never raise out of a handler.

Robustness against bad-but-authorized peers (`robust.py`): a contribution that is not finite or
whose values are absurdly large is refused at admission (our own included); the owner clips each
contribution to a multiple of the span's median norm (sparse bundles are clipped by every member as
it combines them) and lists in its result whom it refused or found far above the median. A member
that a majority of the view's owners so marked gets a strike when the round commits (every member
computes the same strikes from the same results); after `ban_after` strikes it is banned for the
run: its frames are refused and no view includes it. Every decision is logged with a reason and
counted in `robust_events`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Callable, Collection

import torch

from diloco.compression import Header, PayloadRejected, Reason
from diloco.compression.pipeline import Decoded, Pipeline

from . import messages as msg
from .faults import FaultPlan
from . import robust
from .reduce import canonical_order
from .rounds import CollectiveConfig, Exchange, RoundOutcome, RoundState
from .spans import RoundKey, make_view, span_bounds, view_id
from .transport import PeerId, Transport, TransportError

log = logging.getLogger(__name__)

_MAX_VIEWS_PER_ROUND = 8  # bounded buffering of frames from views other than ours


class Collective:
    """The round protocol of one peer over a `Transport`. Create with `await Collective.create(...)`."""

    def __init__(self, transport: Transport, run_id: str, cfg: CollectiveConfig) -> None:
        self.transport = transport
        self.run_id = run_id
        self.cfg = cfg
        self.pipeline = Pipeline(cfg.compression)
        self.mean_pipeline = self.pipeline.dense_only()
        self.schema = ""
        """Digest of the model schema and compression spec; frames with another schema are rejected."""
        self.me = transport.peer_id
        self.rejections: Counter[str] = Counter()
        self.robust_events: Counter[str] = Counter()
        """clipped (contributions scaled down), strikes, banned (peers)."""
        self.strikes: Counter[PeerId] = Counter()
        self.banned: set[PeerId] = set()
        self.banned_by: set[PeerId] = set()
        """Peers whose authenticated replies refused us as banned (`Swarm.check_standing` reads it)."""
        self._rounds: dict[RoundKey, RoundState] = {}
        self._floor = RoundKey(0, 0)  # frames for earlier keys are stale
        self._committed_through = -1  # the highest round number this peer committed (or downloaded past)
        self.faults = FaultPlan.from_env()
        self.crashed = False
        """Set by an in-process kill (`Swarm.crash`): as with a SIGKILLed process, nothing we were doing
        may still take effect, so no round commits from now on."""

    @classmethod
    async def create(cls, transport: Transport, run_id: str, cfg: CollectiveConfig) -> Collective:
        self = cls(transport, run_id, cfg)
        await transport.register("diloco.ready", self._on_ready)
        await transport.register("diloco.contrib", self._on_contrib)
        await transport.register("diloco.result", self._on_result)
        return self

    def advance_to(self, key: RoundKey) -> None:
        """We jumped to round `key` (downloaded state): frames for earlier rounds are stale from now on,
        and frames for this round and the next are accepted."""
        if key > self._floor:
            self._floor = key
            self._forget_before(key)
        self._committed_through = max(self._committed_through, key.round - 1)

    # ---------------------------------------------------------------- the round, from our side

    async def run_round(
        self, key: RoundKey, digest: str, expected: list[PeerId], delta: torch.Tensor, fragment: int = 0,
        admit: Callable[[tuple[PeerId, ...]], tuple[bool, str]] | None = None,
        wait_for: Collection[PeerId] | None = None,
    ) -> RoundOutcome:
        """Run round `key` with our pseudo-gradient `delta` (1-D fp32) of model fragment `fragment`;
        never blocks past the deadlines. The fragment is bound into the view id, so peers that
        disagree on which fragment a round is cannot mix their data. `admit(view)` -> (ok, reason)
        decides whether the closed view may go on (default: at least `min_peers` members); a view
        that may not sends nothing and commits nothing. All `expected` peers are asked; the gather
        waits only for those in `wait_for` (default: all), so a straggler is taken in when it is
        ready in time but not waited for."""
        started, (sent0, recv0) = time.monotonic(), self.transport.counter.snapshot()
        if key.round < self._floor.round:
            raise ValueError(f"round {key} is older than the last round run ({self._floor}); round keys must grow")
        if key < self._floor:  # an attempt of this round we ran already (e.g. our state was reloaded): go on from it
            key = self._floor
        self._floor = key
        self._forget_before(key)
        others = [p for p in expected if p != self.me and p not in self.banned]
        try:
            outcome = await self._run(key, digest, others, delta, fragment, admit, wait_for)
        finally:
            self._floor = RoundKey(key.round, key.attempt + 1)
            self._forget_before(self._floor)
        if outcome.committed and self.crashed:
            outcome = RoundOutcome(key, False, "crashed", outcome.view)
        if outcome.committed:
            self._committed_through = max(self._committed_through, key.round)
            for p in outcome.offenders:
                self._strike(p, f"round {key.round}: marked by a majority of the view's {len(outcome.view)} owners")
        sent, recv = self.transport.counter.snapshot()
        outcome.bytes_sent, outcome.bytes_received = sent - sent0, recv - recv0
        outcome.seconds = time.monotonic() - started
        return outcome

    async def _run(self, key: RoundKey, digest: str, others: list[PeerId], delta: torch.Tensor,
                   fragment: int, admit: Callable[[tuple[PeerId, ...]], tuple[bool, str]] | None,
                   wait_for: Collection[PeerId] | None) -> RoundOutcome:
        rs = self._state(key)
        rs.fragment = fragment
        late = await self._gather(rs, key, digest, others, wait_for)
        if late is not None:
            return late
        assert rs.view is not None
        ok, why = admit(rs.view) if admit is not None else (
            len(rs.view) >= self.cfg.min_peers, f"only {len(rs.view)} of min_peers={self.cfg.min_peers} ready")
        if not ok:
            return RoundOutcome(key, False, why, rs.view)
        chunk = self.pipeline.spec.chunk
        r = Exchange(key, rs, self.me, span_bounds(delta.numel(), len(rs.view), align=chunk.chunk if chunk else 1),
                      closed_at=time.monotonic())
        # Encoding the whole Δ is the heavy part: off the event loop, so handlers keep answering peers.
        r.payloads = await asyncio.to_thread(lambda: [self.pipeline.encode(delta[lo:hi]) for lo, hi in r.bounds])
        self.faults.hit("encode", key.round)
        own = r.own = self.pipeline.decode(r.payloads[r.mine], r.numel(r.mine))
        rs.contribs.setdefault((rs.vid, r.mine), {})[self.me] = (r.payloads[r.mine], own)

        tasks = [asyncio.create_task(self._send_contributions(r)), asyncio.create_task(self._reduce_and_broadcast(r))]
        try:
            complete = await self._wait(rs, r.complete, r.closed_at + self.cfg.result_timeout)
            # Having every result does not mean everyone has ours: let our sends finish (bounded).
            await asyncio.wait(tasks, timeout=self.cfg.call_timeout)
        finally:
            for t in tasks:
                t.cancel()
        return self._assemble(r, delta) if complete else RoundOutcome(
            key, False, f"no result for {len(r.missing())} span(s) (owners {_short(r.missing())})", rs.view,
            payload_bytes=r.payload_bytes)

    async def _gather(self, rs: RoundState, key: RoundKey, digest: str, others: list[PeerId],
                      wait_for: Collection[PeerId] | None = None) -> RoundOutcome | None:
        """Exchange ready messages and close the view; a RoundOutcome when we turn out to be late.

        Ready is symmetric: a peer ready for this key says so in its reply (or that it closed its view
        with us in it, which it does only with our digest), so one of two ready messages lost to a race
        (the receiver was still catching up and refused it) cannot leave one side waiting. Each ready
        carries whom its sender expects; we ask and wait for those too (`RoundState.named`)."""
        rs.ready[self.me] = digest
        rs.banned = frozenset(self.banned)
        rs.expected = tuple(others)
        rs.wait_for = frozenset(wait_for) if wait_for is not None else None
        replies: dict[PeerId, dict[str, Any] | None] = {}

        async def ask(p: PeerId) -> None:
            frame = msg.encode(msg.READY, run=self.run_id, sender=self.me, schema=self.schema, key=key,
                               fragment=rs.fragment, meta={"digest": digest},
                               body=msg.pack_names(rs.named(self.me), rs.waited(self.me)))
            r = await self._call(p, "diloco.ready", frame)
            if r is not None and r.get("reason") == Reason.BANNED.value:
                r = None  # it banned us: it will not take us in, so we do not wait for it
            replies[p] = r
            ready = r.get("ready") if r else None
            if r and r.get("closed") and r.get("in_view"):
                ready = digest
            if isinstance(ready, str) and len(ready) <= 128:
                rs.ready.setdefault(p, ready)
                rs.lists.setdefault(p, r.get("expect", frozenset()) if r else frozenset())
                rs.waits.setdefault(p, r.get("waits", frozenset()) if r else frozenset())
            rs.changed.set()

        # everyone we expect, and whoever told us already that it is ready for this key. The replies of
        # those we wait for are awaited; a straggler's counts if it comes in time, so a hung straggler
        # costs the others the grace below in each round its record lives, not a whole call timeout.
        asked = set(others) | (set(rs.ready) - {self.me})
        first = rs.waited(self.me)
        later = {p: asyncio.create_task(ask(p)) for p in asked - first}
        grace = self.cfg.gather_timeout / 10

        def closed(everyone: bool) -> bool:
            """Ask newly named peers; then: did a reply show we are late, or is every named peer we wait
            for ready (or unreachable)?"""
            named = rs.named(self.me)
            for p in named - asked:
                asked.add(p)
                later[p] = asyncio.create_task(ask(p))
            if self._late(key, replies, named) is not None:
                return True
            # stragglers (ours, or those of the peers that named a peer to us) get only the grace
            waited = named if everyone else rs.waited(self.me)
            return all(p in rs.ready for p in waited if replies.get(p, {}) is not None)

        try:
            await asyncio.gather(*(ask(p) for p in asked & first))
            self.faults.hit("gather", key.round)
            await self._wait(rs, lambda: closed(False), time.monotonic() + self.cfg.gather_timeout)
            if not closed(True):  # stragglers get a short grace (a tenth of the gather timeout) to get back in
                await self._wait(rs, lambda: closed(True), time.monotonic() + grace)
            # a straggler that told us it is ready may have moved on since (committed, or closed
            # without us): before taking it in, give our call to it the grace to say so
            pending = [t for p, t in later.items() if p in rs.ready and not t.done()]
            if pending and self._late(key, replies, rs.named(self.me)) is None:
                await asyncio.wait(pending, timeout=grace)
        finally:
            for t in later.values():
                t.cancel()
        late = self._late(key, replies, rs.named(self.me))
        if late is not None:
            rs.view = ()
            return late
        named = rs.named(self.me)
        view = make_view([p for p, d in rs.ready.items() if d == digest and (p == self.me or p in named)])
        rs.view, rs.vid = view, view_id(key, view, rs.fragment)
        return None

    @staticmethod
    def _late(key: RoundKey, replies: dict[PeerId, dict[str, Any] | None], named: set[PeerId]) -> RoundOutcome | None:
        """A failed outcome if a reply shows that the round went on without us: anyone committed it, or
        a peer we count on closed its view without us (one nobody expects closing without us is no news)."""
        committed = [p for p, r in replies.items() if r and r.get("committed")]
        if committed:  # someone already committed this round: running another attempt would fork the state
            return RoundOutcome(key, False, f"late: {_short(committed)} committed round {key.round} already")
        closed_without_us = [p for p, r in replies.items()
                             if r and r.get("closed") and not r.get("in_view") and p in named]
        if closed_without_us:
            return RoundOutcome(key, False, f"late: {len(closed_without_us)} peer(s) closed round {key} without us")
        return None

    async def _send_contributions(self, r: Exchange) -> None:
        await asyncio.gather(*(
            self._call(owner, "diloco.contrib", self._frame(
                msg.CONTRIB, r.key, view=r.rs.vid, span=i, numel=r.numel(i), body=r.payloads[i]))
            for i, owner in enumerate(r.view) if owner != self.me
        ))
        self.faults.hit("send", r.key.round)

    async def _reduce_and_broadcast(self, r: Exchange) -> None:
        """Owner's side: wait for contributions to our span until the deadline, then send one result."""
        got = r.rs.contribs.setdefault((r.rs.vid, r.mine), {})
        await self._wait(r.rs, lambda: len(got) + len(r.rs.refused & set(r.view)) >= len(r.view),
                         r.closed_at + self.cfg.reduce_timeout)
        if self.me in got and not robust.admit(got[self.me][1], self.cfg.robust)[0]:
            log.warning("event=own_contribution_refused round=%s reason=%s", r.key,
                        robust.admit(got.pop(self.me)[1], self.cfg.robust)[1])
            r.rs.refused.add(self.me)
        senders = [p for p in r.view if p in got]
        idx = tuple(r.view.index(p) for p in senders)
        numel = r.numel(r.mine)
        order = canonical_order([got[p][0] for p in senders])
        combined = robust.combine([got[senders[i]][1] for i in order], numel, self.cfg.robust)
        outliers = self._judge([senders[i] for i in order], combined.norms, r.key)
        marked = tuple(sorted(r.view.index(p) for p in (outliers | r.rs.refused) if p in r.view))
        r.rs.marked[(r.rs.vid, r.mine)] = marked
        if self.pipeline.sparse:  # every member combines the bundle itself, the same way
            body = msg.pack_bundle([(i, got[p][0]) for i, p in zip(idx, senders)])
            kind = "bundle"
        else:
            body = self.mean_pipeline.encode(combined.values)
            kind = "mean"
        self.faults.hit("reduce", r.key.round)
        r.rs.results[(r.rs.vid, r.mine)] = (self.me, self._decode_result(kind, memoryview(body), numel, idx), idx)
        r.rs.changed.set()
        frame = self._frame(msg.RESULT, r.key, view=r.rs.vid, span=r.mine, numel=numel, body=body,
                            meta={"contributors": list(idx), "result": kind, "marked": list(marked)})
        await asyncio.gather(*(self._call(p, "diloco.result", frame) for p in r.view if p != self.me))

    def _assemble(self, r: Exchange, delta: torch.Tensor) -> RoundOutcome:
        """Every span's result is in: the aggregate, who was averaged where, and what of ours counted."""
        parts = [r.rs.results[(r.rs.vid, i)] for i in range(len(r.view))]
        aggregate = torch.cat([t for _, t, _ in parts])
        contributors = [tuple(r.view[j] for j in idx) for _, _, idx in parts]
        votes = Counter(j for i in range(len(r.view)) for j in r.rs.marked.get((r.rs.vid, i), ()))
        offenders = tuple(r.view[j] for j, n in sorted(votes.items()) if 2 * n > len(r.view))
        sent = torch.zeros_like(delta)
        for i, ((lo, hi), (_, _, idx)) in enumerate(zip(r.bounds, parts)):
            if r.mine in idx:  # the owner of span i included our contribution: it counts as sent
                ours = r.own if i == r.mine and r.own is not None else self.pipeline.decode(r.payloads[i], hi - lo)
                sent[lo:hi] = ours.dense(hi - lo)
        return RoundOutcome(r.key, True, "committed", r.view, aggregate, contributors, sent, offenders,
                            r.payload_bytes)

    def _frame(self, kind: str, key: RoundKey, **fields: Any) -> bytes:
        fragment = self._rounds[key].fragment if key in self._rounds else 0
        return msg.encode(kind, run=self.run_id, sender=self.me, schema=self.schema, key=key,
                          codec=self.pipeline.name, fragment=fragment, **fields)

    def _decode_result(self, kind: str, body: memoryview, numel: int, idx: tuple[int, ...]) -> torch.Tensor:
        """The span's aggregate from a result body; identical on every peer for identical bytes."""
        if kind == "mean" and not self.pipeline.sparse:
            values = self.mean_pipeline.decode(body, numel).dense(numel)
        elif kind == "bundle" and self.pipeline.sparse:
            items = msg.unpack_bundle(body, max_items=1 << 15)
            if tuple(i for i, _ in items) != idx:
                raise PayloadRejected(Reason.BAD_HEADER, "bundle contributors differ from the frame's list")
            payloads = [p for _, p in items]
            parts = [self.pipeline.decode(payloads[i], numel) for i in canonical_order(payloads)]
            for part in parts:
                self._admit(part, "a bundled contribution")
            values = robust.combine(parts, numel, self.cfg.robust).values
        else:
            raise PayloadRejected(Reason.BAD_DTYPE, f"result kind {kind!r} does not fit pipeline {self.pipeline.name}")
        self._admit(Decoded(None, values), "result")
        return values

    def _admit(self, part: Decoded, what: str) -> None:
        ok, why = robust.admit(part, self.cfg.robust)
        if not ok:
            reason = Reason.NON_FINITE if "NaN" in why else Reason.TOO_LARGE
            raise PayloadRejected(reason, f"{what} {why}")

    def _judge(self, senders: list[PeerId], norms: list[float], key: RoundKey) -> set[PeerId]:
        """Log and count what robust aggregation does to this span's contributions; the far outliers."""
        cfg = self.cfg.robust
        for i, scale in enumerate(robust.clip_scales(norms, cfg.clip)):
            if scale != 1.0:
                self.robust_events["clipped"] += 1
                log.warning("event=contribution_clipped round=%s peer=%s norm=%.4g scale=%.3g", key, senders[i],
                            norms[i], scale)
        med = robust.median(norms) if norms else 0.0
        out = set()
        for i in robust.offenders(norms, cfg.strike):
            out.add(senders[i])
            log.warning("event=contribution_outlier round=%s peer=%s norm=%.4g median=%.4g", key, senders[i],
                        norms[i], med)
        return out

    def _strike(self, peer: PeerId, why: str) -> None:
        """A strike agreed by the round (see `RoundOutcome.offenders`); banned after `ban_after`."""
        if peer == self.me:
            log.warning("event=struck_self reason=%s", why)
            return
        self.strikes[peer] += 1
        self.robust_events["strikes"] += 1
        log.warning("event=strike peer=%s strikes=%d reason=%s", peer, self.strikes[peer], why)
        ban_after = self.cfg.robust.ban_after
        if ban_after and self.strikes[peer] >= ban_after and peer not in self.banned:
            self.banned.add(peer)
            self.robust_events["banned"] += 1
            log.warning("event=peer_banned peer=%s strikes=%d reason=%s", peer, self.strikes[peer],
                        f"{self.strikes[peer]} strikes (ban_after={ban_after}); last: {why}")

    # ---------------------------------------------------------------- handlers (from the network)

    async def _on_ready(self, caller: PeerId, data: bytes) -> bytes:
        try:
            self._check_banned(caller)
            header, body, key = msg.decode(data, run=self.run_id, kind=msg.READY, caller=caller,
                                           max_body=msg.MAX_NAMES_BYTES,
                                           schema=self.schema)
            digest = header.meta.get("digest")
            if not isinstance(digest, str) or len(digest) > 128:
                raise PayloadRejected(Reason.BAD_HEADER, "ready needs a string meta.digest")
            if key.round <= self._committed_through:  # we committed this round: the sender must catch up, not fork
                return msg.ack(run=self.run_id, sender=self.me, closed=True, in_view=False, committed=True)
            if key < self._floor:  # a round we already finished: tell the late peer at once
                return msg.ack(run=self.run_id, sender=self.me, closed=True, in_view=False)
            expects, waits = msg.unpack_names(body)
            rs = self._accepting(key)
            names = rs.named(self.me) if rs.expected is not None else set()
            waited = rs.waited(self.me) if rs.expected is not None else set()
            if rs.view is not None:
                return msg.ack(run=self.run_id, sender=self.me, closed=True, in_view=caller in rs.view, names=names,
                               waited=waited)
            rs.ready[caller] = digest
            rs.lists[caller], rs.waits[caller] = expects, waits
            rs.changed.set()
            mine: dict[str, Any] = {"ready": rs.ready[self.me]} if self.me in rs.ready else {}
            # we are ready for this key too: say so (see _gather)
            return msg.ack(run=self.run_id, sender=self.me, closed=False, in_view=False, names=names, waited=waited,
                           **mine)
        except PayloadRejected as e:
            return self._reject(caller, e)

    async def _on_contrib(self, caller: PeerId, data: bytes) -> bytes:
        try:
            self._check_banned(caller)
            header, body, key = msg.decode(data, run=self.run_id, kind=msg.CONTRIB, caller=caller,
                                           max_body=self.cfg.max_payload, schema=self.schema)
            rs = self._accepting(key)
            self._check_view_slot(rs, header.view, caller, owner=self.me, span=header.span)
            self._check_codec(header)
            bucket = rs.contribs.setdefault((header.view, header.span), {})
            if caller in bucket or caller in rs.refused:  # one contribution a round: a refused one counts
                raise PayloadRejected(Reason.DUPLICATE, f"second contribution from {caller} for span {header.span}")
            decoded = self.pipeline.decode(body, header.numel)
            try:
                self._admit(decoded, "contribution")
            except PayloadRejected:  # a member's own pseudo-gradient: our result marks it (see _strike)
                rs.refused.add(caller)
                rs.changed.set()
                raise
            bucket[caller] = (bytes(body), decoded)
            rs.changed.set()
            return msg.ack(run=self.run_id, sender=self.me)
        except PayloadRejected as e:
            return self._reject(caller, e)

    async def _on_result(self, caller: PeerId, data: bytes) -> bytes:
        try:
            self._check_banned(caller)
            header, body, key = msg.decode(data, run=self.run_id, kind=msg.RESULT, caller=caller,
                                           max_body=self.cfg.max_payload, schema=self.schema)
            rs = self._accepting(key)
            self._check_view_slot(rs, header.view, caller, owner=caller, span=header.span)
            idx = header.meta.get("contributors")
            if not isinstance(idx, list) or not idx or not all(isinstance(i, int) and i >= 0 for i in idx):
                raise PayloadRejected(Reason.BAD_HEADER, "result needs a non-empty list of contributor indices")
            if rs.view and (max(idx) >= len(rs.view) or len(set(idx)) != len(idx)):
                raise PayloadRejected(Reason.BAD_HEADER, f"contributor indices {idx} do not fit a view of {len(rs.view)}")
            marked = header.meta.get("marked", [])
            if not isinstance(marked, list) or not all(isinstance(i, int) and 0 <= i < 1024 for i in marked) \
                    or len(set(marked)) != len(marked) or (rs.view and any(i >= len(rs.view) for i in marked)):
                raise PayloadRejected(Reason.BAD_HEADER, f"result's marked list {marked!r} is not unique view indices")
            self._check_codec(header)
            kind = header.meta.get("result")
            tensor = self._decode_result(kind if isinstance(kind, str) else "", body, header.numel, tuple(idx))
            if (header.view, header.span) in rs.results:
                raise PayloadRejected(Reason.DUPLICATE, f"second result for span {header.span}")
            rs.results[(header.view, header.span)] = (caller, tensor, tuple(idx))
            rs.marked[(header.view, header.span)] = tuple(marked)
            rs.changed.set()
            return msg.ack(run=self.run_id, sender=self.me)
        except PayloadRejected as e:
            return self._reject(caller, e)

    # ---------------------------------------------------------------- checks and plumbing

    def _accepting(self, key: RoundKey) -> RoundState:
        """The state of round `key` if frames for it are acceptable now (not stale, not far ahead)."""
        if key < self._floor:
            raise PayloadRejected(Reason.WRONG_ROUND, f"round {key} is over here (now at {self._floor})")
        if key.round > self._floor.round + 1:
            raise PayloadRejected(Reason.WRONG_ROUND, f"round {key} is too far ahead of {self._floor}")
        return self._state(key)

    def _check_view_slot(self, rs: RoundState, vid: str, sender: PeerId, *, owner: PeerId, span: int) -> None:
        if rs.view is None:  # our gather is still open: buffer, boundedly, and check later by view id
            if vid not in rs.views_buffered() and len(rs.views_buffered()) >= _MAX_VIEWS_PER_ROUND:
                raise PayloadRejected(Reason.WRONG_VIEW, "too many distinct views buffered for this round")
            if not 0 <= span < 1024:
                raise PayloadRejected(Reason.WRONG_SPAN, f"span {span} out of range")
            return
        if not rs.view or rs.vid != vid:
            raise PayloadRejected(Reason.WRONG_VIEW, f"frame for view {vid}, ours is {rs.vid or 'none'}")
        if sender not in rs.view:
            raise PayloadRejected(Reason.NOT_MEMBER, f"{sender} is not in this round's view")
        if not 0 <= span < len(rs.view) or rs.view[span] != owner:
            raise PayloadRejected(Reason.WRONG_SPAN, f"span {span} is not owned by {owner}")

    def adopt_bans(self, peers: Collection[PeerId], why: str) -> None:
        """Ban peers that others banned (e.g. a majority of the records we read: we joined after the fact)."""
        for p in peers:
            if p != self.me and p not in self.banned:
                self.banned.add(p)
                self.robust_events["banned"] += 1
                log.warning("event=peer_banned peer=%s reason=%s", p, why)

    def _check_banned(self, caller: PeerId) -> None:
        if caller in self.banned:
            raise PayloadRejected(Reason.BANNED, f"{caller} is banned for this run ({self.strikes[caller]} strikes)")

    def _check_codec(self, header: Header) -> None:
        if header.codec != self.pipeline.name:
            raise PayloadRejected(Reason.BAD_DTYPE, f"codec {header.codec!r}, this swarm uses {self.pipeline.name!r}")

    def _reject(self, caller: PeerId, e: PayloadRejected) -> bytes:
        self.rejections[e.reason.value] += 1
        log.warning("event=payload_rejected reason=%s peer=%s detail=%s", e.reason.value, caller, e.detail)
        return msg.ack(run=self.run_id, sender=self.me, ok=False, reason=e.reason.value)

    async def _call(self, peer: PeerId, name: str, frame: bytes) -> dict[str, Any] | None:
        """Send one frame; the reply's meta, or None when the peer could not be reached."""
        try:
            reply = await self.transport.call(peer, name, frame, self.cfg.call_timeout)
            meta = msg.read_ack(reply, run=self.run_id, caller=peer)
        except (TransportError, PayloadRejected) as e:
            log.info("event=call_failed handler=%s peer=%s reason=%s", name, peer, e)
            return None
        if not meta.get("ok", False):
            log.info("event=frame_refused handler=%s peer=%s reason=%s", name, peer, meta.get("reason"))
            if meta.get("reason") == Reason.BANNED.value:
                self.banned_by.add(peer)  # its own sealed reply: nobody else can say this for it
        return meta

    def _state(self, key: RoundKey) -> RoundState:
        if key not in self._rounds:
            self._rounds[key] = RoundState()
        return self._rounds[key]

    def _forget_before(self, key: RoundKey) -> None:
        for k in [k for k in self._rounds if k < key]:
            del self._rounds[k]

    @staticmethod
    async def _wait(rs: RoundState, done: Callable[[], bool], deadline: float) -> bool:
        """Wait until `done()` or the deadline; True if done. Handlers wake us through `rs.changed`."""
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            rs.changed.clear()
            try:
                await asyncio.wait_for(rs.changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return True


def _short(peers: list[PeerId]) -> str:
    return ", ".join(p[-6:] for p in peers)
