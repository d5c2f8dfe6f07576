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
3. **Gather results.** A member holds the round's *value* when it has a result for every span, all
   tagged with its view id, by `result_timeout`. Each result names the members it averaged. A member
   of our view that shows it closed another view (it refuses our contribution as of the wrong view, or
   sends us a frame of its own view) never sends a result for ours: we give the attempt up then.
4. **Decide.** Holding the value, a member *accepts* it and votes: it tells every view member, and
   commits (applies the value) once the members that accepted it form a quorum: `admit` of them
   (the caller's rule, e.g. a strict majority of the last round's members) and a strict majority of
   the view. A member that cannot learn this in time is *in doubt*: it applies nothing and reports
   what it accepted (attempt, value id) in its ready messages of every later attempt of the round.
   A later attempt whose view holds such a report *carries* the value accepted in the highest
   attempt instead of exchanging new pseudo-gradients: members fetch that value from a member that
   holds it (`value`), accept it and vote again. The value id is bound into the view id, so members
   that disagree on what they carry cannot mix.

Why two peers never commit different values for one round (Paxos, with attempts as ballots): a
value is committed only after a quorum accepted it. A later attempt that can commit needs a view
that is itself a quorum, so it shares a member with that one; the member reports the value (or one
it accepted later, which by the same argument is that value), and the highest report wins. A
member reports what it accepted before its view closes, and from then on refuses every frame of an
earlier attempt, so no report goes stale. A peer frozen after receiving every result, whose own
span's result reached nobody, therefore cannot commit alone: the others retry without it and it
wakes in doubt, applies nothing, and learns that the round was committed (test_collective.py,
"frozen"). The argument needs quorums that intersect: it holds once a swarm has a previous
membership and `SwarmConfig.majority` is on; a fresh swarm's first round only has the view majority.

Failure semantics:
- A dead or slow member is not waited for past a deadline: a missing contribution is left out
  of its span's mean (the result lists who was averaged); a missing *owner* means its span has
  no result, so nobody with that view commits the round, and all of them retry it as the next
  attempt of the same round (their local progress is kept: the next Δ covers it). A member that
  dies after some members accepted the value leaves them in doubt at worst; the next attempt
  carries that value.
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
import itertools
import logging
import secrets
import time
from collections import Counter
from functools import partial
from typing import Any, Callable, Collection, Iterator, TypeGuard

import torch

from diloco.compression import Header, PayloadRejected, Reason
from diloco.compression.pipeline import Decoded, Pipeline

from . import messages as msg
from .faults import NO_FAULTS, Faults
from . import robust
from .reduce import canonical_order, order_key, summation_order, uneven
from .rounds import Accepted, CollectiveConfig, Contribution, Exchange, Handoff, RoundOutcome, RoundState, Value
from .spans import MAX_SPANS, RoundKey, make_view, member_token, parse_member, span_bounds, spans_for, view_id
from .transport import CallTimedOut, PeerId, Transport, TransportError

log = logging.getLogger(__name__)

_MAX_VIEWS_PER_ROUND = 8  # bounded buffering of frames from views other than ours
_DECIDED_KEPT = 16  # rounds whose committed value id we still tell a late voter
IN_FLIGHT = 2  # contribution frames on their way to one owner at a time (docs/BENCHMARKS.md, B3)
Admit = Callable[[tuple[PeerId, ...]], tuple[bool, str]]


class Collective:
    """The round protocol of one peer over a `Transport`. Create with `await Collective.create(...)`."""

    def __init__(self, transport: Transport, run_id: str, cfg: CollectiveConfig, faults: Faults = NO_FAULTS) -> None:
        self.transport = transport
        self.run_id = run_id
        self.cfg = cfg
        self.pipeline = Pipeline(cfg.compression)
        self.mean_pipeline = self.pipeline.dense_only()
        self.schema = ""
        """Digest of the model schema and compression spec; frames with another schema are rejected."""
        self.me = transport.peer_id
        self.incarnation = secrets.randbits(62) | 1
        """This process's number among the processes that ever ran under our peer id (drawn at start): views name
        it, so a peer that restarted mid-round is another member than the one its old process joined as."""
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
        self._decided: dict[int, tuple[str, str]] = {}  # (ballot's view id, value id) of the last rounds we committed
        self._background: set[asyncio.Task[Any]] = set()  # votes still on their way after we decided (`settle`)
        self._accepted: Accepted | None = None
        """The value we accepted in the latest attempt of the current round, until the round is over."""
        self._ran: dict[str, Exchange] = {}
        """Our side of the current round's attempts, by view id: what of our Δ a value includes."""
        self.faults = faults
        """Fault hooks (`diloco.comms.faults`): nothing, unless a test, the simulator or an entry point
        reading DILOCO_FAULTS passed a plan."""
        self.abstaining = False
        """We take no part in this namespace's rounds for now (a region's member on standby in the swarm's records,
        `diloco.regions`): a peer asking us to be ready is told so and does not wait for us."""
        self.crashed = False
        self._silent: dict[PeerId, float] = {}
        """Peers found dead or frozen (a probe or a ready unanswered through the answer window), until when we do
        not wait for their answer again: while a frozen peer's record lives, each gather asks it, and without this
        each one would wait the window for it anew. Any reply from it clears it."""
        """Set by an in-process kill (`Swarm.crash`): as with a SIGKILLed process, nothing we were doing
        may still take effect, so no round commits from now on."""

    @classmethod
    async def create(cls, transport: Transport, run_id: str, cfg: CollectiveConfig,
                     faults: Faults = NO_FAULTS) -> Collective:
        self = cls(transport, run_id, cfg, faults)
        await transport.register("diloco.ready", self._on_ready)
        await transport.register("diloco.contrib", self._on_contrib)
        await transport.register("diloco.result", self._on_result)
        await transport.register("diloco.vote", self._on_vote)
        await transport.register("diloco.value", self._on_value)
        await transport.register("diloco.probe", self._on_probe)
        return self

    def advance_to(self, key: RoundKey) -> None:
        """We jumped to round `key` (downloaded state): frames for earlier rounds are stale from now on,
        and frames for this round and the next are accepted."""
        if key > self._floor:
            self._floor = key
            self._forget_before(key)
        self._committed_through = max(self._committed_through, key.round - 1)

    async def settle(self, timeout: float) -> None:
        """Let the votes still on their way after we decided arrive (at most `timeout` seconds): before we leave, a
        member may still need ours to commit."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    # ---------------------------------------------------------------- the round, from our side

    async def run_round(
        self, key: RoundKey, digest: str, expected: list[PeerId], delta: torch.Tensor | Handoff, fragment: int = 0,
        admit: Admit | None = None,
        wait_for: Collection[PeerId] | None = None,
        weight: int = 1,
    ) -> RoundOutcome:
        """Run round `key` with our pseudo-gradient `delta` (1-D fp32; a `Handoff` lets the round drop it
        once encoded) of model fragment `fragment`;
        never blocks past the deadlines. The fragment is bound into the view id, so peers that
        disagree on which fragment a round is cannot mix their data. `admit(view)` -> (ok, reason)
        decides whether the closed view may go on (default: at least `min_peers` members); a view
        that may not sends nothing and commits nothing; the same rule decides whether the members
        that accepted the value may commit it (step 4). All `expected` peers are asked; the gather
        waits only for those in `wait_for` (default: all), so a straggler is taken in when it is
        ready in time but not waited for. `weight` is what our contribution counts in every span's mean against
        the others' (the inner steps Δ covers: workers of unequal speed, `Contribution.weight`)."""
        if not _weight_ok(weight):
            raise ValueError(f"weight must be a whole number of inner steps >= 1, got {weight!r}")
        started, (sent0, recv0) = time.monotonic(), self.transport.counter.snapshot()
        if key.round < self._floor.round:
            raise ValueError(f"round {key} is older than the last round run ({self._floor}); round keys must grow")
        if key < self._floor:  # an attempt of this round we ran already (e.g. our state was reloaded): go on from it
            key = self._floor
        self._floor = key
        self._forget_before(key)
        others = [p for p in expected if p != self.me and p not in self.banned]
        rs = self._state(key)
        rs.weight = weight
        try:
            handoff = delta if isinstance(delta, Handoff) else Handoff(delta)
            del delta
            outcome = await self._run(rs, key, digest, others, handoff, fragment, admit, wait_for)
        finally:
            self._floor = RoundKey(key.round, key.attempt + 1)
            self._forget_before(self._floor)
        if outcome.committed and self.crashed:
            outcome = RoundOutcome(key, False, "crashed", outcome.view)
        if outcome.committed:
            self._committed_through = max(self._committed_through, key.round)
            self._decided[key.round] = (self._accepted.vid if self._accepted else "", outcome.value_id)
            self._accepted, self._ran = None, {}  # the round is over: its value and our payloads can go
            for old in sorted(self._decided)[:-_DECIDED_KEPT]:
                del self._decided[old]
            for p in outcome.offenders:
                self._strike(p, f"round {key.round}: marked by a majority of the view's {len(outcome.view)} owners")
        sent, recv = self.transport.counter.snapshot()
        outcome.bytes_sent, outcome.bytes_received = sent - sent0, recv - recv0
        outcome.seconds, outcome.phases = time.monotonic() - started, dict(rs.phases)
        outcome.gathered_at = rs.gathered_at
        return outcome

    async def _run(self, rs: RoundState, key: RoundKey, digest: str, others: list[PeerId], delta: Handoff,
                   fragment: int, admit: Admit | None, wait_for: Collection[PeerId] | None) -> RoundOutcome:
        rs.fragment, rs.lean = fragment, not delta.keeps_aggregate
        began = time.monotonic()
        late = await self._gather(rs, key, digest, others, wait_for)
        closed = rs.gathered_at = _lap(rs, "gather", began)
        if late is not None:
            return late
        assert rs.view is not None
        if admit is None:
            min_peers = self.cfg.min_peers
            admit = lambda view: (len(view) >= min_peers, f"only {len(view)} of min_peers={min_peers} ready")  # noqa: E731
        ok, why = admit(rs.view)
        if not ok:
            return RoundOutcome(key, False, why, rs.view)
        r = Exchange(key, rs, self.me, self._bounds(delta.numel, len(rs.view)), closed_at=closed)
        rs.spans, rs.bounds = len(r.bounds), r.bounds
        if rs.carried is None:
            value = await self._exchange(r, delta)
            if value is None and self._elsewhere(r):
                return RoundOutcome(key, False, f"{_short(self._elsewhere(r))} closed another view of round {key}",
                                    rs.view, payload_bytes=r.payload_bytes)
            if value is None and r.lost():
                lost = r.lost()
                return RoundOutcome(key, False, f"{_short(lost)} will send no result for round {key} "
                                    f"({rs.gone[lost[0]]}): given up without waiting for the deadline",
                                    rs.view, payload_bytes=r.payload_bytes)
            if value is None:
                owners = list(dict.fromkeys(r.owner(s) for s in r.missed))  # as the deadline found them
                return RoundOutcome(key, False, f"no result for {len(r.missed)} span(s) by the deadline (owners "
                                    f"{_short(owners)})", rs.view, payload_bytes=r.payload_bytes)
        else:
            value = await self._carry(r, rs.carried, delta.numel)
            _lap(rs, "fetch", closed)
            if value is None:
                return RoundOutcome(key, False, f"could not fetch the value accepted in attempt {rs.carried[0]} "
                                    "from any member holding it", rs.view)
        self._accepted = Accepted(key, rs.vid, value)
        voting = time.monotonic()
        outcome = await self._decide(r, value, delta.numel, admit)
        _lap(rs, "decide", voting)
        return outcome

    async def _exchange(self, r: Exchange, handoff: Handoff) -> Value | None:
        """Steps 2 and 3 with our fresh Δ: the value (every span's result), or None if one is missing."""
        rs = r.rs
        self._ran[rs.vid] = r
        # Encoding the whole Δ is the heavy part: off the event loop, so handlers keep answering peers.
        r.payloads = await asyncio.to_thread(self._encode, handoff, r.bounds, r.key.round)
        encoded = _lap(rs, "encode", r.closed_at)
        r.payload_bytes = sum(len(p) for p in r.payloads)
        self.faults.hit("encode", r.key.round)
        for span in r.owned:
            own = r.own[span] = self.pipeline.decode(r.payloads[span], r.numel(span))
            rs.contribs.setdefault((rs.vid, span), {})[self.me] = self._contribution(r.payloads[span], own, rs.weight)
            if self.pipeline.spec.ef is None:  # only error feedback reads it again; we hold it decoded meanwhile
                r.payloads[span] = b""
        for (view, span), (owner, tensor, idx) in list(rs.results.items()):  # results that came before our view
            if view != rs.vid:
                continue
            if span >= rs.spans or tensor.numel() != r.numel(span):
                del rs.results[(view, span)]
                self._count_rejection(owner, PayloadRejected(Reason.WRONG_SIZE, f"result for span {span} does not "
                                                             "fit the round's partition"))
            else:
                rs.results[(view, span)] = (owner, self._into_aggregate(rs, span, tensor), idx)

        tasks = [asyncio.create_task(self._send_contributions(r)), asyncio.create_task(self._reduce_and_broadcast(r)),
                 asyncio.create_task(self._watch(r))]
        try:
            # a member that closed another view, or that is gone, never sends a result for ours: no use waiting
            # out the deadline
            complete = await self._wait(rs, lambda: r.complete() or bool(self._elsewhere(r) or r.lost()),
                                        r.closed_at + self.cfg.result_timeout) and r.complete() and not self._elsewhere(r)
            r.missed = [] if complete else [s for s in range(len(r.bounds)) if (rs.vid, s) not in rs.results]
            # Having every result does not mean everyone has ours: let our sends finish (bounded), but those to a
            # member that is gone (the probes go on meanwhile: a frozen member costs a window, not a call timeout).
            # An attempt we give up needs none of them: we accept nothing in it.
            if complete:
                await self._wait(rs, r.delivered, time.monotonic() + self.cfg.call_timeout)
        finally:
            for t in tasks:
                t.cancel()
        _lap(rs, "exchange", encoded)
        if not complete:
            return None
        spans = range(len(r.bounds))
        return Value(r.key, rs.vid, r.view, [rs.frames[(rs.vid, i)] for i in spans],
                     [rs.results[(rs.vid, i)] for i in spans], [rs.marked.get((rs.vid, i), ()) for i in spans],
                     {p: rs.incarnations[p] for p in r.view if p in rs.incarnations})

    async def _carry(self, r: Exchange, carried: tuple[int, str], numel: int) -> Value | None:
        """The value our view carries: ours if we accepted it, else fetched from a member that did."""
        _, value_id = carried
        if self._accepted is not None and self._accepted.value.vid == value_id:
            return self._accepted.value
        holders = sorted(p for p in r.view if p != self.me and r.rs.accepted.get(p, (0, ""))[1] == value_id)
        deadline = r.closed_at + self.cfg.result_timeout
        for peer in holders:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            value = await self._fetch_value(peer, r.key.round, value_id, numel, r.rs.fragment, remaining, r.rs.lean)
            if value is not None:
                return value
        return None

    @staticmethod
    def _elsewhere(r: Exchange) -> list[PeerId]:
        """Members of our view that closed another view of this round (see `RoundState.elsewhere`)."""
        return sorted(r.rs.elsewhere & set(r.view))

    def _contribution(self, body: bytes | memoryview, decoded: Decoded, weight: int = 1,
                      crc: int | None = None) -> Contribution:
        return Contribution(order_key(body, crc), decoded, bytes(body) if self.pipeline.sparse else None, weight)

    def _encode(self, handoff: Handoff, bounds: list[tuple[int, int]], round_: int) -> list[bytes]:
        # after this, the round holds Δ only as its encoded spans (a poisoning plan scales each span first)
        return [self.pipeline.encode_parts([self.faults.outgoing(round_, part) for part in parts])
                for parts in handoff.span_parts(bounds)]

    async def _decide(self, r: Exchange, value: Value, numel: int, admit: Admit) -> RoundOutcome:
        """Step 4: vote, and commit once the members that accepted `value` form a quorum."""
        rs, key = r.rs, r.key
        votes = rs.votes.setdefault(rs.vid, set())
        votes.add(self.me)
        past: set[PeerId] = set()  # members that will never accept this attempt's value
        elsewhere: list[PeerId] = []  # members that committed this round with another value

        def quorum(members: Collection[PeerId]) -> bool:
            return 2 * len(members) > len(r.view) and admit(make_view(list(members)))[0]

        async def vote(p: PeerId) -> None:
            reply = await self._call(p, "diloco.vote", self._frame(msg.VOTE, key, view=rs.vid))
            if reply is None or not reply.get("ok", False):
                return  # unreachable or refused: unknown
            if reply.get("accepted") or (reply.get("committed") and reply.get("value") == value.vid):
                votes.add(p)  # it accepted our value, or committed it (so a quorum accepted it)
            elif reply.get("committed"):
                elsewhere.append(p)
            elif reply.get("past"):
                past.add(p)
            rs.changed.set()

        def settled() -> bool:
            return quorum(votes) or bool(elsewhere) or not quorum(set(r.view) - past)

        tasks = {p: asyncio.create_task(vote(p)) for p in r.view if p != self.me}
        deadline = max(r.closed_at + self.cfg.result_timeout, time.monotonic()) + self.cfg.call_timeout
        try:
            self.faults.hit("decide", key.round)
            # A member that answered "not accepted (yet)" may give the attempt up later (a result it never gets):
            # ask again an answer window apart, so that we hear it moved past, rather than wait out the deadline.
            while not await self._wait(rs, settled, min(deadline, time.monotonic() + self.cfg.answer_timeout)) \
                    and time.monotonic() < deadline:
                for p, t in tasks.items():
                    if t.done() and p not in votes and p not in past and p not in elsewhere:
                        tasks[p] = asyncio.create_task(vote(p))
        finally:
            # A quorum decides: we commit without waiting for the replies to our own votes (a round trip), and a
            # vote still on its way goes on in the background: a member waiting for it needs it to decide. A peer
            # that leaves lets them arrive first (`settle`), and lingers while a peer is behind.
            for t in tasks.values():
                if quorum(votes) and not t.done():
                    self._background.add(t)
                    t.add_done_callback(self._background.discard)
                else:
                    t.cancel()
        ran = self._ran.get(rs.vid)
        spent = ran.payload_bytes if ran is not None else 0
        if quorum(votes):
            return self._outcome(key, value, numel, spent, rs.lean)
        if elsewhere:
            return RoundOutcome(key, False, f"late: {_short(elsewhere)} committed round {key.round} with another "
                                "value", r.view, payload_bytes=spent)
        if not quorum(set(r.view) - past):
            return RoundOutcome(key, False, f"abandoned: {len(past)} of {len(r.view)} members moved past attempt "
                                f"{key.attempt} without accepting its value", r.view, payload_bytes=spent)
        return RoundOutcome(key, False, f"in doubt: {len(votes)} of {len(r.view)} members confirmed the value; the "
                            "next attempt carries it", r.view, payload_bytes=spent, in_doubt=True)

    async def _gather(self, rs: RoundState, key: RoundKey, digest: str, others: list[PeerId],
                      wait_for: Collection[PeerId] | None = None) -> RoundOutcome | None:
        """Exchange ready messages and close the view; a RoundOutcome when we turn out to be late.

        Ready is symmetric: a peer ready for this key says so in its reply (or that it closed its view
        with us in it, which it does only with our digest), so one of two ready messages lost to a race
        (the receiver was still catching up and refused it) cannot leave one side waiting. Each ready
        carries whom its sender expects; we ask and wait for those too (`RoundState.named`)."""
        rs.ready[self.me] = digest
        rs.incarnations[self.me] = self.incarnation
        rs.banned = frozenset(self.banned)
        rs.expected = tuple(others)
        rs.wait_for = frozenset(wait_for) if wait_for is not None else None
        replies: dict[PeerId, dict[str, Any] | None] = {}

        async def ask(p: PeerId) -> None:
            frame = msg.encode(msg.READY, run=self.run_id, sender=self.me, schema=self.schema, key=key,
                               fragment=rs.fragment,
                               meta={"digest": digest, "inc": self.incarnation, **self._accepted_meta(key)},
                               body=msg.pack_names(rs.named(self.me), rs.waited(self.me)))
            held = rs.incarnations.get(p) if p in rs.ready else None  # its ready, already here as we ask
            r = await self._call(p, "diloco.ready", frame)
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
                    accepted, inc = _accepted_of(r or {}, key), _incarnation_of(r or {})
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
        asked = set(others) | (set(rs.ready) - {self.me})
        first = rs.waited(self.me)
        later = {p: asyncio.create_task(ask(p)) for p in asked - first}
        grace = self.cfg.gather_timeout / 10

        since: dict[PeerId, float] = {}  # when each ask still on its way was sent
        muted: dict[PeerId, float] = {}  # left a question unanswered through the answer window, since when

        def ask_again(peers: Collection[PeerId]) -> None:
            """Those of `peers` we wait for that answered "not yet" may have died, left, gone on standby or
            closed their view since (their ready would then never come): ask them again to hear which. One that
            leaves such a question unanswered through the answer window froze after it answered: not waited for."""
            now = time.monotonic()
            for p in set(peers) & rs.waited(self.me) - set(rs.ready):
                if replies.get(p, {}) is None:
                    continue
                if p not in later or later[p].done():
                    later[p], since[p] = asyncio.create_task(ask(p)), now
                elif now - since.get(p, now) > self.cfg.answer_timeout:
                    replies[p] = None
                    muted[p] = now
                    self._mark_silent(p)
                    log.info("event=peer_silent round=%s peer=%s", key, p)

        def closed(everyone: bool) -> bool:
            """Ask newly named peers, and again those whose records changed (`recheck`); then: did a reply show we
            are late, or is every named peer we wait for ready (or unreachable, or taking no part)?"""
            named = rs.named(self.me)
            for p in named - asked:
                asked.add(p)
                later[p] = asyncio.create_task(ask(p))
            ask_again(rs.recheck)
            rs.recheck.clear()
            if self._late(key, replies, named) is not None:
                return True
            # stragglers (ours, or those of the peers that named a peer to us) get only the grace
            waited = named if everyone else rs.waited(self.me)
            return all(p in rs.ready for p in waited if replies.get(p, {}) is not None)

        try:
            # A peer we have heard from before that leaves our ready unanswered through the answer window is frozen
            # or overloaded: not waited for (its reply, or its own ready, still counts if it comes before we close).
            # A first contact (dialing, handshakes) gets the whole call timeout.
            # One found silent lately is not waited for at all until it answers something again.
            asking = {p: asyncio.create_task(ask(p)) for p in asked & first}
            now = time.monotonic()
            fresh = [t for p, t in asking.items() if self._silent.get(p, 0) <= now]
            if fresh:
                await asyncio.wait(fresh, timeout=self.cfg.answer_timeout)
            elif asking:
                await asyncio.wait(asking.values(), timeout=self.cfg.answer_timeout / 20)  # a round trip, no more
            for p, task in asking.items():
                if not task.done() and self.transport.counter.per_peer.get(p, [0, 0])[1] > 0:
                    replies[p] = None
                    later[p] = task
                    muted[p] = time.monotonic()
                    self._mark_silent(p)
                    log.info("event=peer_silent round=%s peer=%s", key, p)
            # nor does a straggler found silent lately get the stragglers' grace (it froze: every round its record
            # outlives it would wait the grace for it); its answer, if it comes, counts as anyone's
            for p, task in later.items():
                if p not in asking and not task.done() and self._silent.get(p, 0) > now:
                    replies[p] = None
            await asyncio.gather(*(t for p, t in asking.items() if p not in later))
            self.faults.hit("gather", key.round)
            deadline = time.monotonic() + self.cfg.gather_timeout
            while not await self._wait(rs, lambda: closed(False), min(deadline, time.monotonic() + grace)) \
                    and time.monotonic() < deadline:
                ask_again(rs.waited(self.me))  # a grace apart
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
        # a peer whose ready we hold (it may have come before we began) but that has left our question unanswered
        # through the answer window, still unanswered now and with no ready of its own since, is cut off or frozen:
        # it would fail the attempt
        mute = {p for p, since in muted.items() if not later[p].done() and rs.heard.get(p, 0.0) <= since}
        view = make_view([p for p, d in rs.ready.items()
                          if d == digest and (p == self.me or p in named) and p not in mute])
        # what the view carries: the value accepted in the highest earlier attempt any member reports
        reports = [rs.accepted[p] for p in view if p in rs.accepted and p != self.me]
        own = self._accepted_by_us(key)
        rs.carried = max([*reports, *([own] if own else [])], default=None)
        rs.view, rs.vid = view, view_id(key, view, rs.fragment, rs.carried[1] if rs.carried else "", rs.incarnations)
        return None

    def _accepted_by_us(self, key: RoundKey) -> tuple[int, str] | None:
        """(attempt, value id) we accepted in an earlier attempt of `key`'s round, if any."""
        acc = self._accepted
        if acc is None or acc.ballot.round != key.round or acc.ballot >= key:
            return None
        return acc.ballot.attempt, acc.value.vid

    def _accepted_meta(self, key: RoundKey) -> dict[str, Any]:
        own = self._accepted_by_us(key)
        return {} if own is None else {"acc_attempt": own[0], "acc_value": own[1]}

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

    def _bounds(self, numel: int, members: int) -> list[tuple[int, int]]:
        """The span partition of a Δ of `numel` values among `members` (`spans.spans_for`)."""
        chunk = self.pipeline.spec.chunk
        return span_bounds(numel, spans_for(numel, members), align=chunk.chunk if chunk else 1)

    async def _deliver(self, r: Exchange, peer: PeerId, name: str, frame: bytes) -> dict[str, Any] | None:
        """`_call` for a frame we owe `peer` (`Exchange.owed`, counted when it fell due)."""
        try:
            return await self._call(peer, name, frame)
        finally:
            r.owed[peer] -= 1
            r.rs.changed.set()

    async def _send_contributions(self, r: Exchange) -> None:
        async def send(owner: PeerId, span: int, window: asyncio.Semaphore) -> None:
            async with window:
                if owner in r.rs.elsewhere:  # it closed another view: the rest of its spans would be refused too
                    r.owed[owner] -= 1
                    return
                reply = await self._deliver(r, owner, "diloco.contrib", self._frame(
                    msg.CONTRIB, r.key, view=r.rs.vid, span=span, numel=r.numel(span), body=r.payloads[span],
                    meta={"weight": r.rs.weight} if r.rs.weight != 1 else None))
                if reply is None:
                    r.rs.undeliverable.add(owner)  # a probe from it will hear so: it need not wait for us
                elif reply.get("reason") == Reason.WRONG_VIEW.value:
                    self._closed_elsewhere(r.rs, owner)
                elif self.pipeline.spec.ef is None:  # only error feedback reads it again (what of Δ was sent)
                    r.payloads[span] = b""

        # A few frames at a time to each owner, in span order (the transport copies a frame while it is on its way,
        # so a model cut into many spans costs IN_FLIGHT spans per owner): over a long path one stream is held
        # back by its flow-control window, two keep the link busy; a slow owner holds up only its own spans.
        windows = {p: asyncio.Semaphore(IN_FLIGHT) for p in r.view if p != self.me}
        r.owed.update(r.owner(span) for span in range(len(r.bounds)) if r.owner(span) != self.me)
        await asyncio.gather(*(send(r.owner(span), span, windows[r.owner(span)])
                               for span in range(len(r.bounds)) if r.owner(span) != self.me))
        self.faults.hit("send", r.key.round)

    async def _reduce_and_broadcast(self, r: Exchange) -> None:
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
                await self._wait(r.rs, partial(arrived, span), r.closed_at + self.cfg.reduce_timeout)
                frame = self._reduce_span(r, span)
                r.owed.update(p for p in r.view if p != self.me)
                await window.acquire()
                sends.append(asyncio.create_task(self._broadcast(r, frame, window)))
            await asyncio.gather(*sends)
        finally:
            for t in sends:
                t.cancel()

    async def _watch(self, r: Exchange) -> None:
        """While we wait on members of our view (their results, their contributions to our spans), ask them every
        third of an answer window (at least 1 s) whether they still run it (`diloco.probe`). One that cannot be
        reached (killed), stays silent through the window while nothing else came from it (frozen), no longer runs
        this attempt (gave it up), or answers from another process (restarted) is `gone`: its contributions are not
        waited for, and a span it owns gets no result, so every member of the view gives the attempt up within a
        probe interval of each other instead of at the result deadline (with the default timeouts a killed member
        is found ~1 s into the exchange, a frozen one ~4 s). Giving an attempt up is always safe: we accepted nothing in it. One
        that answers that its contribution to us could not be delivered is not waited for as a contributor
        (`owes_nothing`)."""
        window = self.cfg.answer_timeout
        while True:
            await asyncio.sleep(max(1.0, window / 3))
            awaited = r.awaited() - r.rs.gone.keys() - r.rs.elsewhere
            await asyncio.gather(*(self._probe(r, p, window) for p in awaited))

    async def _probe(self, r: Exchange, peer: PeerId, window: float) -> None:
        rs = r.rs
        heard = self.transport.counter.per_peer.get(peer, [0, 0])[1]
        try:
            reply = await self.transport.call(peer, "diloco.probe", self._frame(msg.PROBE, r.key, view=rs.vid), window)
            meta = msg.read_ack(reply, run=self.run_id, caller=peer)
        except CallTimedOut:
            if self.transport.counter.per_peer.get(peer, [0, 0])[1] != heard:
                return  # its reply is queued behind the bytes it is sending us: busy, not frozen
            why = f"silent for {window:.1f} s"
            self._mark_silent(peer)
        except TransportError as e:
            why = f"unreachable: {e}"
            self._mark_silent(peer)
        except PayloadRejected as e:
            why = f"its reply to our probe was refused: {e.detail}"
        else:
            self._silent.pop(peer, None)
            inc, joined = meta.get("inc"), rs.incarnations.get(peer, 0)
            if meta.get("ok", False) and joined and type(inc) is int and inc != joined:
                why = "restarted since it joined this attempt (another process under its peer id)"
            elif meta.get("ok", False) and meta.get("running") is True:
                if meta.get("undelivered") is True and peer not in rs.owes_nothing:  # our span: reduce without it
                    rs.owes_nothing.add(peer)
                    rs.changed.set()
                    log.info("event=contribution_undeliverable round=%s peer=%s", r.key, peer)
                return
            else:
                why = "no longer runs this attempt" if meta.get("ok", False) else \
                    f"refused our probe ({meta.get('reason')})"
        if peer not in rs.gone and rs.vid:
            rs.gone[peer] = why
            rs.changed.set()
            log.info("event=member_gone round=%s peer=%s reason=%s", r.key, peer, why)

    def _mark_silent(self, peer: PeerId) -> None:
        """Do not wait for `peer`'s answer in our gathers for a while (`_silent`): twice the gather timeout (at least a
        call timeout), about as long as its record may outlive it; any reply from it ends this sooner."""
        self._silent[peer] = time.monotonic() + max(self.cfg.call_timeout, 2 * self.cfg.gather_timeout)

    async def _broadcast(self, r: Exchange, frame: bytes, window: asyncio.Semaphore) -> None:
        try:
            await asyncio.gather(*(self._deliver(r, p, "diloco.result", frame) for p in r.view if p != self.me))
        finally:
            window.release()

    def _reduce_span(self, r: Exchange, span: int) -> bytes:
        """Reduce the contributions to `span` into its result: kept as ours, and returned as the frame to send."""
        got = r.rs.contribs.setdefault((r.rs.vid, span), {})
        refused = r.rs.refused.setdefault(span, set())
        if self.me in got and not robust.admit(got[self.me].decoded, self.cfg.robust)[0]:
            log.warning("event=own_contribution_refused round=%s reason=%s", r.key,
                        robust.admit(got.pop(self.me).decoded, self.cfg.robust)[1])
            refused.add(self.me)
        senders = [p for p in r.view if p in got]
        for i in robust.overweight([got[p].weight for p in senders], self.cfg.robust.max_weight):
            p, floor = senders[i], min(got[q].weight for q in senders)
            log.warning("event=contribution_overweight round=%s span=%d peer=%s weight=%g lowest=%g max_weight=%g",
                        r.key, span, p, got[p].weight, floor, self.cfg.robust.max_weight)
            self.robust_events["overweight"] += 1
            del got[p]
            refused.add(p)
        senders = [p for p in senders if p in got]
        idx = tuple(r.view.index(p) for p in senders)
        weights = [got[p].weight for p in senders]
        weighted = uneven(weights)
        numel = r.numel(span)
        order = summation_order([got[p].order for p in senders])
        combined = robust.combine([got[senders[i]].decoded for i in order], numel, self.cfg.robust,
                                  [weights[i] for i in order] if weighted else None)
        outliers = self._judge([senders[i] for i in order], combined.norms, r.key)
        marked = tuple(sorted(r.view.index(p) for p in (outliers | refused) if p in r.view))
        r.rs.marked[(r.rs.vid, span)] = marked
        exact = None  # the result's values as every member decodes them, when that is the mean itself
        body: bytes | memoryview
        if self.pipeline.sparse:  # every member combines the bundle itself, the same way
            body = msg.pack_bundle([(i, got[p].body or b"") for i, p in zip(idx, senders)])
            kind = "bundle"
        else:
            # fp32: the mean's own bytes (the frame below copies them) decode to the mean, bit for bit
            exact = combined.values if self.mean_pipeline.exact else None
            body = self.mean_pipeline.encode_view(combined.values)
            kind = "mean"
        del combined, got  # the span's contributions are not needed past its result
        r.rs.contribs.pop((r.rs.vid, span), None)
        self.faults.hit("reduce", r.key.round)
        if exact is not None:
            self._admit(Decoded(None, exact), "result")
        result = self._into_aggregate(r.rs, span, exact if exact is not None else self._decode_result(
            kind, memoryview(body), numel, idx, weights if weighted else None))
        r.rs.results[(r.rs.vid, span)] = (self.me, result, idx)
        if self.pipeline.spec.ef is None:
            r.own.pop(span, None)  # our decoded contribution is needed past here only for error feedback
        r.rs.changed.set()
        meta: dict[str, Any] = {"contributors": list(idx), "result": kind, "marked": list(marked)}
        if weighted:  # a bundle's members weigh its payloads by these; a mean says what it was weighted by
            meta["weights"] = weights
        frame = self._frame(msg.RESULT, r.key, view=r.rs.vid, span=span, numel=numel, body=body, meta=meta)
        r.rs.frames[(r.rs.vid, span)] = frame
        return frame

    def _outcome(self, key: RoundKey, value: Value, numel: int, spent: int, lean: bool = False) -> RoundOutcome:
        """A committed round: the aggregate (or, `lean`, the value to read it from span by span), who was
        averaged where, and what of our Δ counted."""
        aggregate = None if lean else self._assembled(value)
        contributors = [tuple(value.view[j] for j in idx) for _, _, idx in value.results]
        owners: dict[int, set[int]] = {}  # member -> the owners (view indices) that marked it in some span
        for span, marked in enumerate(value.marked):
            for j in marked:
                owners.setdefault(j, set()).add(span % len(value.view))
        offenders = tuple(value.view[j] for j, by in sorted(owners.items()) if 2 * len(by) > len(value.view))
        ran = self._ran.get(value.vid)  # our side of the attempt that computed the value, if we were in it
        sent = torch.zeros(numel) if self.pipeline.spec.ef is not None else None  # for error feedback only
        if ran is not None and sent is not None:
            for i, ((lo, hi), (_, _, idx)) in enumerate(zip(ran.bounds, value.results)):
                if ran.mine in idx:  # the owner of span i included our contribution: it counts as sent
                    ours = ran.own[i] if i in ran.own else \
                        self.pipeline.decode(ran.payloads[i], hi - lo)
                    sent[lo:hi] = ours.dense(hi - lo)
        reason = "committed" if value.key == key else f"committed the value of attempt {value.key.attempt}"
        return RoundOutcome(key, True, reason, value.view, aggregate, contributors, sent, offenders, spent,
                            value_id=value.vid, value=value if lean else None)

    def value_spans(self, value: Value, into: torch.Tensor | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(lo, hi, Δ̄[lo:hi]) for every span of a committed `value`, decoded from its result frames one at a
        time: the bytes every member applies (a lean round's `RoundOutcome.value`). With `into` (Δ̄'s size), each
        span is decoded into `into[lo:hi]`, which is what it yields."""
        for (lo, hi), frame, (owner, _, _) in zip(self._bounds(value.numel, len(value.view)), value.frames,
                                                  value.results):
            header, body, _ = msg.decode(frame, run=self.run_id, kind=msg.RESULT, caller=owner,
                                         max_body=self.cfg.max_payload, schema=self.schema)
            yield lo, hi, self._parse_result(header, body, len(value.view),
                                             into[lo:hi] if into is not None else None)[2]

    def _frame(self, kind: str, key: RoundKey, **fields: Any) -> bytes:
        fragment = self._rounds[key].fragment if key in self._rounds else 0
        return msg.encode(kind, run=self.run_id, sender=self.me, schema=self.schema, key=key,
                          codec=self.pipeline.name, fragment=fragment, **fields)

    @staticmethod
    def _into_aggregate(rs: RoundState, span: int, tensor: torch.Tensor) -> torch.Tensor:
        """Move a result of our view into the round's aggregate buffer; the buffer's slice, which replaces it."""
        if not rs.bounds:
            return tensor
        if rs.lean:
            return _placeholder(tensor.numel())
        if rs.aggregate is None:  # allocated with the first result: it is not needed while spans are reduced
            rs.aggregate = torch.empty(rs.bounds[-1][1], dtype=torch.float32)
        lo, hi = rs.bounds[span]
        slot = rs.aggregate[lo:hi]
        slot.copy_(tensor)
        return slot

    @staticmethod
    def _assembled(value: Value) -> torch.Tensor:
        """The value's results as one Δ̄: the aggregate buffer they were written into, or (a value fetched
        from another member) a concatenation."""
        tensors = [t for _, t, _ in value.results]
        base = tensors[0]._base if tensors and tensors[0]._base is not None else None
        if base is not None and base.numel() == sum(t.numel() for t in tensors) and all(
                t._base is base and t.storage_offset() == off for t, off in
                zip(tensors, itertools.accumulate([0, *(t.numel() for t in tensors[:-1])]))):
            return base
        return torch.cat(tensors)

    def _decode_result(self, kind: str, body: memoryview, numel: int, idx: tuple[int, ...],
                       weights: list[int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The span's aggregate from a result body (a bundle's payloads weighed by `weights`, in `idx`'s order),
        written into `out` when given (numel values); identical on every peer for identical bytes."""
        if kind == "mean" and not self.pipeline.sparse:
            values = self.mean_pipeline.decode(body, numel).dense(numel) if out is None \
                else self.mean_pipeline.decode_into(body, numel, out)
        elif kind == "bundle" and self.pipeline.sparse:
            items = msg.unpack_bundle(body, max_items=1 << 15)
            if tuple(i for i, _ in items) != idx:
                raise PayloadRejected(Reason.BAD_HEADER, "bundle contributors differ from the frame's list")
            payloads = [p for _, p in items]
            order = canonical_order(payloads)
            parts = [self.pipeline.decode(payloads[i], numel) for i in order]
            for part in parts:
                self._admit(part, "a bundled contribution")
            values = robust.combine(parts, numel, self.cfg.robust,
                                    [weights[i] for i in order] if weights else None).values
            if out is not None:
                values = out.copy_(values)
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
            inc = _incarnation_of(dict(header.meta))
            me = self.incarnation
            if key.round <= self._committed_through:  # we committed this round: the sender must catch up, not fork
                return msg.ack(run=self.run_id, sender=self.me, closed=True, in_view=False, committed=True, inc=me)
            if key < self._floor:  # a round we already finished: tell the late peer at once
                return msg.ack(run=self.run_id, sender=self.me, closed=True, in_view=False, inc=me)
            if self.abstaining:  # not bad input: the sender's records were a moment behind ours
                return msg.ack(run=self.run_id, sender=self.me, closed=False, in_view=False, abstains=True, inc=me)
            expects, waits = msg.unpack_names(body)
            accepted = _accepted_of(dict(header.meta), key)
            rs = self._accepting(key)
            names = rs.named(self.me) if rs.expected is not None else set()
            waited = rs.waited(self.me) if rs.expected is not None else set()
            ours = self._accepted_meta(key)
            if rs.view is not None:  # in it only as the process that was ready: a restarted one is late
                in_view = caller in rs.view and rs.incarnations.get(caller, 0) in (0, inc)
                return msg.ack(run=self.run_id, sender=self.me, closed=True, in_view=in_view, names=names,
                               waited=waited, inc=me, **ours)
            rs.ready[caller], rs.incarnations[caller] = digest, inc  # a restart's ready replaces its old process's
            rs.heard[caller] = time.monotonic()
            rs.lists[caller], rs.waits[caller] = expects, waits
            if accepted is not None:
                rs.accepted[caller] = accepted
            rs.changed.set()
            # whether we are ready for this key too (see _gather); "" when not yet: the reply is the same size
            # either way, so a round's bytes do not depend on who asked first
            mine: dict[str, Any] = {"ready": rs.ready.get(self.me, ""), "inc": me}
            return msg.ack(run=self.run_id, sender=self.me, closed=False, in_view=False, names=names, waited=waited,
                           **mine, **ours)
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
            weight = header.meta.get("weight", 1)
            if not _weight_ok(weight):
                raise PayloadRejected(Reason.BAD_HEADER, f"weight {weight!r} must be a whole number of inner steps >= 1")
            bucket = rs.contribs.setdefault((header.view, header.span), {})
            if caller in bucket or caller in rs.refused.get(header.span, ()):  # one a span: a refused one counts
                raise PayloadRejected(Reason.DUPLICATE, f"second contribution from {caller} for span {header.span}")
            decoded = self.pipeline.decode(body, header.numel)
            try:
                self._admit(decoded, "contribution")
            except PayloadRejected:  # a member's own pseudo-gradient: our result marks it (see _strike)
                rs.refused.setdefault(header.span, set()).add(caller)
                rs.changed.set()
                raise
            bucket[caller] = self._contribution(body, decoded, weight, crc=header.crc32)  # unpack verified it
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
            if rs.bounds and header.view == rs.vid:
                lo, hi = rs.bounds[header.span]
                if header.numel != hi - lo:
                    raise PayloadRejected(Reason.WRONG_SIZE, f"result for span {header.span} holds {header.numel} "
                                                             f"values, the span has {hi - lo}")
            idx, marked, tensor = self._parse_result(header, body, len(rs.view) if rs.view else None)
            if (header.view, header.span) in rs.results:
                raise PayloadRejected(Reason.DUPLICATE, f"second result for span {header.span}")
            if header.view == rs.vid and rs.view is not None:
                tensor = self._into_aggregate(rs, header.span, tensor)
            rs.results[(header.view, header.span)] = (caller, tensor, idx)
            rs.marked[(header.view, header.span)] = marked
            rs.frames[(header.view, header.span)] = data  # ours to keep (`Handler`): no copy
            rs.changed.set()
            return msg.ack(run=self.run_id, sender=self.me)
        except PayloadRejected as e:
            return self._reject(caller, e)

    def _parse_result(self, header: Header, body: memoryview, members: int | None, out: torch.Tensor | None = None
                      ) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
        """(contributor indices, marked indices, the span's aggregate) of a result frame; raises
        PayloadRejected for anything that does not fit a view of `members` (None: not known yet). With `out`, the
        aggregate is decoded into it."""
        idx = header.meta.get("contributors")
        if not isinstance(idx, list) or not idx or not all(isinstance(i, int) and i >= 0 for i in idx):
            raise PayloadRejected(Reason.BAD_HEADER, "result needs a non-empty list of contributor indices")
        if members and (max(idx) >= members or len(set(idx)) != len(idx)):
            raise PayloadRejected(Reason.BAD_HEADER, f"contributor indices {idx} do not fit a view of {members}")
        marked = header.meta.get("marked", [])
        if not isinstance(marked, list) or not all(isinstance(i, int) and 0 <= i < 1024 for i in marked) \
                or len(set(marked)) != len(marked) or (members and any(i >= members for i in marked)):
            raise PayloadRejected(Reason.BAD_HEADER, f"result's marked list {marked!r} is not unique view indices")
        self._check_codec(header)
        kind = header.meta.get("result")
        weights = header.meta.get("weights")
        if weights is not None and (not isinstance(weights, list) or len(weights) != len(idx)
                                    or not all(_weight_ok(w) for w in weights)):
            raise PayloadRejected(Reason.BAD_HEADER, f"result's weights {weights!r} are not one whole number >= 1 "
                                  "per contributor")
        tensor = self._decode_result(kind if isinstance(kind, str) else "", body, header.numel, tuple(idx), weights,
                                     out)
        return tuple(idx), tuple(marked), tensor

    async def _on_vote(self, caller: PeerId, data: bytes) -> bytes:
        """A member accepted the value of its view `header.view` in attempt `key`: count it, and say
        whether we accepted it too, committed the round already, or moved past that attempt."""
        try:
            self._check_banned(caller)
            header, _, key = msg.decode(data, run=self.run_id, kind=msg.VOTE, caller=caller, max_body=0,
                                        schema=self.schema)
            if key.round <= self._committed_through:
                ballot, value = self._decided.get(key.round, ("", ""))
                if ballot == header.view:  # we accepted that very attempt's value, then committed it
                    return msg.ack(run=self.run_id, sender=self.me, accepted=True)
                return msg.ack(run=self.run_id, sender=self.me, committed=True, value=value)
            acc = self._accepted
            accepted = acc is not None and acc.ballot == key and acc.vid == header.view
            if key < self._floor:  # an attempt we left: we accepted its value then, or we never will
                return msg.ack(run=self.run_id, sender=self.me, accepted=accepted, past=not accepted)
            rs = self._accepting(key)
            if rs.view is None:  # our gather is still open: keep the vote, boundedly, until our view closes
                if header.view not in rs.views_buffered() and len(rs.views_buffered()) >= _MAX_VIEWS_PER_ROUND:
                    raise PayloadRejected(Reason.WRONG_VIEW, "too many distinct views buffered for this round")
            elif rs.vid != header.view or caller not in rs.view:
                raise PayloadRejected(Reason.WRONG_VIEW, f"vote for view {header.view}, ours is {rs.vid or 'none'}")
            rs.votes.setdefault(header.view, set()).add(caller)
            rs.changed.set()
            return msg.ack(run=self.run_id, sender=self.me, accepted=accepted)
        except PayloadRejected as e:
            return self._reject(caller, e)

    async def _on_probe(self, caller: PeerId, data: bytes) -> bytes:
        """A member of a view asks whether we still run it (`_watch`): `running` is true while our attempt of that
        key is under way and either still gathering or closed on that view. No side effect."""
        try:
            self._check_banned(caller)
            header, _, key = msg.decode(data, run=self.run_id, kind=msg.PROBE, caller=caller, max_body=0,
                                        schema=self.schema)
            rs = self._rounds.get(key)
            running = key == self._floor and rs is not None and rs.expected is not None and \
                (rs.view is None or rs.vid == header.view)
            extra: dict[str, Any] = {"undelivered": True} if running and rs is not None and caller in rs.undeliverable \
                else {}
            return msg.ack(run=self.run_id, sender=self.me, running=running, inc=self.incarnation, **extra)
        except PayloadRejected as e:
            return self._reject(caller, e)

    async def _on_value(self, caller: PeerId, data: bytes) -> bytes:
        """Serve the value we accepted (its members and every span's result frame) to a member whose
        view carries it."""
        try:
            self._check_banned(caller)
            header, _, key = msg.decode(data, run=self.run_id, kind=msg.VALUE, caller=caller, max_body=0,
                                        schema=self.schema)
        except PayloadRejected as e:
            return self._reject(caller, e)
        acc = self._accepted
        if acc is None or acc.ballot.round != key.round or acc.value.vid != header.view:  # committed, or moved on
            return msg.ack(run=self.run_id, sender=self.me, ok=False, reason="value not held")
        v = acc.value
        members = "\n".join(member_token(p, v.incarnations.get(p, 0)) for p in v.view)
        body = msg.pack_bundle([(0, members.encode()), *((i + 1, f) for i, f in enumerate(v.frames))])
        return msg.encode(msg.VALUE, run=self.run_id, sender=self.me, schema=self.schema, key=v.key, view=v.vid,
                          body=body)

    async def _fetch_value(self, peer: PeerId, rnd: int, value_id: str, numel: int, fragment: int,
                           timeout: float, lean: bool = False) -> Value | None:
        """Download value `value_id` of round `rnd` from `peer` and check it; None when it cannot be had."""
        request = msg.encode(msg.VALUE, run=self.run_id, sender=self.me, schema=self.schema, key=RoundKey(rnd),
                             view=value_id)
        try:
            reply = await self.transport.call(peer, "diloco.value", request, timeout)
        except TransportError as e:
            log.info("event=value_fetch_failed peer=%s reason=%s", peer, e)
            return None
        try:
            return self._read_value(peer, reply, rnd, value_id, numel, fragment, lean)
        except PayloadRejected as e:
            if e.reason is Reason.WRONG_KIND:  # an ack: it no longer holds the value
                log.info("event=value_fetch_refused peer=%s", peer)
            else:
                self._count_rejection(peer, e)
            return None

    def _read_value(self, peer: PeerId, data: bytes, rnd: int, value_id: str, numel: int, fragment: int,
                    lean: bool = False) -> Value:
        """A served value, checked: its members hash to its id, and every span's result frame is the
        one its owner would have sent for that view (size, span, attempt), with values that admit."""
        header, body, key = msg.decode(data, run=self.run_id, kind=msg.VALUE, caller=peer,
                                       max_body=self.cfg.max_payload, schema=self.schema)
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
        bounds = self._bounds(numel, len(members))
        if len(bounds) != len(items) - 1:
            raise PayloadRejected(Reason.WRONG_VIEW, f"served value has {len(items) - 1} spans, a Δ of {numel} "
                                                     f"among {len(members)} members has {len(bounds)}")
        frames, results, marked = [], [], []
        for i, (_, raw) in enumerate(items[1:]):
            frame = bytes(raw)
            h, b, k = msg.decode(frame, run=self.run_id, kind=msg.RESULT, caller=members[i % len(members)],
                                 max_body=self.cfg.max_payload, schema=self.schema)
            if k != key or h.view != value_id or h.span != i or h.numel != bounds[i][1] - bounds[i][0]:
                raise PayloadRejected(Reason.WRONG_SPAN, f"served result {i} is not span {i} of value {value_id}")
            idx, mk, tensor = self._parse_result(h, b, len(members))
            frames.append(frame)
            results.append((members[i % len(members)], _placeholder(tensor.numel()) if lean else tensor, idx))
            marked.append(mk)
        return Value(key, value_id, members, frames, results, marked, incarnations)

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
            if not 0 <= span < MAX_SPANS:
                raise PayloadRejected(Reason.WRONG_SPAN, f"span {span} out of range")
            return
        if not rs.view or rs.vid != vid:
            self._closed_elsewhere(rs, sender)
            raise PayloadRejected(Reason.WRONG_VIEW, f"frame for view {vid}, ours is {rs.vid or 'none'}")
        if sender not in rs.view:
            raise PayloadRejected(Reason.NOT_MEMBER, f"{sender} is not in this round's view")
        limit = rs.spans or MAX_SPANS  # known once our exchange starts
        if not 0 <= span < limit or rs.view[span % len(rs.view)] != owner:
            raise PayloadRejected(Reason.WRONG_SPAN, f"span {span} is not owned by {owner}")

    @staticmethod
    def _closed_elsewhere(rs: RoundState, peer: PeerId) -> None:
        if peer not in rs.elsewhere:
            rs.elsewhere.add(peer)
            rs.changed.set()

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
        self._count_rejection(caller, e)
        return msg.ack(run=self.run_id, sender=self.me, ok=False, reason=e.reason.value)

    def _count_rejection(self, peer: PeerId, e: PayloadRejected) -> None:
        self.rejections[e.reason.value] += 1
        log.warning("event=payload_rejected reason=%s peer=%s detail=%s", e.reason.value, peer, e.detail)

    async def _call(self, peer: PeerId, name: str, frame: bytes) -> dict[str, Any] | None:
        """Send one frame; the reply's meta, or None when the peer could not be reached."""
        try:
            reply = await self.transport.call(peer, name, frame, self.cfg.call_timeout)
            meta = msg.read_ack(reply, run=self.run_id, caller=peer)
        except (TransportError, PayloadRejected) as e:
            log.info("event=call_failed handler=%s peer=%s reason=%s", name, peer, e)
            return None
        self._silent.pop(peer, None)
        if not meta.get("ok", False):
            log.info("event=frame_refused handler=%s peer=%s reason=%s", name, peer, meta.get("reason"))
            if meta.get("reason") == Reason.BANNED.value:
                self.banned_by.add(peer)  # its own sealed reply: nobody else can say this for it
        return meta

    def gathering(self, peer: PeerId, rnd: int) -> bool:
        """Whether `peer` sent us a `ready` for an attempt at round `rnd` (it is gathering that round). Called on
        our loop."""
        return any(key.round == rnd and peer in rs.ready for key, rs in self._rounds.items())

    def recheck(self, peers: Collection[PeerId]) -> None:
        """`peers` say in their records that they take no part in rounds now (standby, left): the gather we are
        running asks those it waits for again at once (they answer so, and are not waited for), rather than a
        grace later. Called on our loop."""
        rs = self._rounds.get(self._floor)
        if rs is None or rs.expected is None or rs.view is not None:
            return
        waiting = set(peers) & rs.waited(self.me) - rs.ready.keys()
        if waiting:  # the gather wakes only for peers it still waits for
            rs.recheck.update(waiting)
            rs.changed.set()

    def _state(self, key: RoundKey) -> RoundState:
        if key not in self._rounds:
            self._rounds[key] = RoundState()
        return self._rounds[key]

    def _forget_before(self, key: RoundKey) -> None:
        for k in [k for k in self._rounds if k < key]:
            del self._rounds[k]
        self._ran = {v: r for v, r in self._ran.items() if r.key.round >= key.round}
        if self._accepted is not None and self._accepted.ballot.round < key.round:
            self._accepted = None

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


def _lap(rs: RoundState, phase: str, since: float) -> float:
    """Record the seconds since `since` as `phase` of the attempt; returns now."""
    now = time.monotonic()
    rs.phases[phase] = now - since
    return now


def _placeholder(numel: int) -> torch.Tensor:
    """A result's stand-in in a lean round: its size, no storage (the frame holds the values)."""
    return torch.zeros(1).expand(numel)


def _accepted_of(meta: dict[str, Any], key: RoundKey) -> tuple[int, str] | None:
    """The (attempt, value id) a ready message or its reply reports as accepted earlier in `key`'s
    round; None when it reports none. Raises PayloadRejected when the report is malformed."""
    attempt, value = meta.get("acc_attempt"), meta.get("acc_value")
    if attempt is None and value is None:
        return None
    if not isinstance(attempt, int) or isinstance(attempt, bool) or not 0 <= attempt < key.attempt \
            or not isinstance(value, str) or not 0 < len(value) <= 64:
        raise PayloadRejected(Reason.BAD_HEADER, f"accepted report ({attempt!r}, {value!r}) does not fit attempt {key}")
    return attempt, value


def _incarnation_of(meta: dict[str, Any]) -> int:
    """The sender's incarnation a ready message or its reply carries (0: none said, as a peer without one, e.g. a
    test's puppet, says). Raises PayloadRejected when it is not a number in [0, 2⁶³)."""
    inc = meta.get("inc", 0)
    if type(inc) is not int or not 0 <= inc < 1 << 63:
        raise PayloadRejected(Reason.BAD_HEADER, f"meta.inc must be an incarnation number, got {inc!r}")
    return inc


def _same_process(reply: dict[str, Any], held: int) -> bool:
    """Whether `reply` came from incarnation `held` (unknown on either side: yes)."""
    try:
        inc = _incarnation_of(reply)
    except PayloadRejected:
        return True  # a malformed number is not news of a restart; the reply is judged where it is read
    return inc == 0 or held in (0, inc)


def _weight_ok(w: object) -> TypeGuard[int]:
    """A contribution's weight off the wire: a whole number of inner steps in [1, 10¹²]."""
    return type(w) is int and 1 <= w <= 10**12


def _short(peers: list[PeerId]) -> str:
    return ", ".join(p[-6:] for p in peers)
