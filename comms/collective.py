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

Where each step lives: `Collective` (here) is one peer's memory of rounds (the floor below which frames are stale,
what it accepted and committed, bans, peers found silent) and runs the steps in order (`run_round`); step 1 is
`diloco.comms.gather`, steps 2-3 `diloco.comms.reduction` (with `diloco.comms.watch` probing the members it waits on
meanwhile, and `diloco.comms.results` reading a result off the wire), step 4 `diloco.comms.decide`. Each step's
module also holds the handler that answers its frame from the other members.

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
import logging
import secrets
import time
from collections import Counter
from functools import partial
from typing import Any, Collection, Iterator

import torch

from diloco.compression import Header, PayloadRejected, Reason
from diloco.compression.pipeline import Pipeline

from . import decide, gather, reduction, results, watch
from . import messages as msg
from .decide import Admit
from .faults import NO_FAULTS, Faults
from .rounds import (Accepted, CollectiveConfig, Exchange, Handoff, RoundOutcome, RoundState,
                     Value, lap, short, weight_ok)
from .spans import MAX_SPANS, RoundKey, span_bounds, spans_for
from .transport import PeerId, Transport, TransportError

log = logging.getLogger(__name__)

_DECIDED_KEPT = 16  # rounds whose committed value id we still tell a late voter


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
        self.rounds: dict[RoundKey, RoundState] = {}
        self.floor = RoundKey(0, 0)  # frames for earlier keys are stale
        self.committed_through = -1  # the highest round number this peer committed (or downloaded past)
        self.decided: dict[int, tuple[str, str]] = {}  # (ballot's view id, value id) of the last rounds we committed
        self.background: set[asyncio.Task[Any]] = set()  # votes still on their way after we decided (`settle`)
        self.accepted: Accepted | None = None
        """The value we accepted in the latest attempt of the current round, until the round is over."""
        self.ran: dict[str, Exchange] = {}
        """Our side of the current round's attempts, by view id: what of our Δ a value includes."""
        self.faults = faults
        """Fault hooks (`diloco.comms.faults`): nothing, unless a test, the simulator or an entry point
        reading DILOCO_FAULTS passed a plan."""
        self.abstaining = False
        """We take no part in this namespace's rounds for now (a region's member on standby in the swarm's records,
        `diloco.regions`): a peer asking us to be ready is told so and does not wait for us."""
        self.crashed = False
        """Set by an in-process kill (`Swarm.crash`): as with a SIGKILLed process, nothing we were doing
        may still take effect, so no round commits from now on."""
        self.silent: dict[PeerId, float] = {}
        """Peers found dead or frozen (a probe or a ready unanswered through the answer window), until when we do
        not wait for their answer again: while a frozen peer's record lives, each gather asks it, and without this
        each one would wait the window for it anew. Any reply from it clears it."""

    @classmethod
    async def create(cls, transport: Transport, run_id: str, cfg: CollectiveConfig,
                     faults: Faults = NO_FAULTS) -> Collective:
        self = cls(transport, run_id, cfg, faults)
        await transport.register("diloco.ready", partial(gather.on_ready, self))
        await transport.register("diloco.contrib", partial(reduction.on_contrib, self))
        await transport.register("diloco.result", partial(reduction.on_result, self))
        await transport.register("diloco.vote", partial(decide.on_vote, self))
        await transport.register("diloco.value", partial(decide.on_value, self))
        await transport.register("diloco.probe", partial(watch.on_probe, self))
        return self

    def advance_to(self, key: RoundKey) -> None:
        """We jumped to round `key` (downloaded state): frames for earlier rounds are stale from now on,
        and frames for this round and the next are accepted."""
        if key > self.floor:
            self.floor = key
            self._forget_before(key)
        self.committed_through = max(self.committed_through, key.round - 1)

    async def settle(self, timeout: float) -> None:
        """Let the votes still on their way after we decided arrive (at most `timeout` seconds): before we leave, a
        member may still need ours to commit."""
        if self.background:
            await asyncio.wait(set(self.background), timeout=timeout)

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
        if not weight_ok(weight):
            raise ValueError(f"weight must be a whole number of inner steps >= 1, got {weight!r}")
        started, (sent0, recv0) = time.monotonic(), self.transport.counter.snapshot()
        if key.round < self.floor.round:
            raise ValueError(f"round {key} is older than the last round run ({self.floor}); round keys must grow")
        if key < self.floor:  # an attempt of this round we ran already (e.g. our state was reloaded): go on from it
            key = self.floor
        self.floor = key
        self._forget_before(key)
        others = [p for p in expected if p != self.me and p not in self.banned]
        rs = self.state(key)
        rs.weight = weight
        try:
            handoff = delta if isinstance(delta, Handoff) else Handoff(delta)
            del delta
            outcome = await self._run(rs, key, digest, others, handoff, fragment, admit, wait_for)
        finally:
            self.floor = RoundKey(key.round, key.attempt + 1)
            self._forget_before(self.floor)
        if outcome.committed and self.crashed:
            outcome = RoundOutcome(key, False, "crashed", outcome.view)
        if outcome.committed:
            self.committed_through = max(self.committed_through, key.round)
            self.decided[key.round] = (self.accepted.vid if self.accepted else "", outcome.value_id)
            self.accepted, self.ran = None, {}  # the round is over: its value and our payloads can go
            for old in sorted(self.decided)[:-_DECIDED_KEPT]:
                del self.decided[old]
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
        late = await gather.close_view(self, rs, key, digest, others, wait_for)
        closed = rs.gathered_at = lap(rs, "gather", began)
        if late is not None:
            return late
        assert rs.view is not None
        if admit is None:
            min_peers = self.cfg.min_peers
            admit = lambda view: (len(view) >= min_peers, f"only {len(view)} of min_peers={min_peers} ready")  # noqa: E731
        ok, why = admit(rs.view)
        if not ok:
            return RoundOutcome(key, False, why, rs.view)
        r = Exchange(key, rs, self.me, self.bounds(delta.numel, len(rs.view)), closed_at=closed)
        rs.spans, rs.bounds = len(r.bounds), r.bounds
        if rs.carried is None:
            value = await reduction.exchange(self, r, delta)
            if value is None and r.closed_elsewhere():
                return RoundOutcome(key, False, f"{short(r.closed_elsewhere())} closed another view of round {key}",
                                    rs.view, payload_bytes=r.payload_bytes)
            if value is None and r.lost():
                lost = r.lost()
                return RoundOutcome(key, False, f"{short(lost)} will send no result for round {key} "
                                    f"({rs.gone[lost[0]]}): given up without waiting for the deadline",
                                    rs.view, payload_bytes=r.payload_bytes)
            if value is None:
                owners = list(dict.fromkeys(r.owner(s) for s in r.missed))  # as the deadline found them
                return RoundOutcome(key, False, f"no result for {len(r.missed)} span(s) by the deadline (owners "
                                    f"{short(owners)})", rs.view, payload_bytes=r.payload_bytes)
        else:
            value = await decide.carry(self, r, rs.carried, delta.numel)
            lap(rs, "fetch", closed)
            if value is None:
                return RoundOutcome(key, False, f"could not fetch the value accepted in attempt {rs.carried[0]} "
                                    "from any member holding it", rs.view)
        self.accepted = Accepted(key, rs.vid, value)
        voting = time.monotonic()
        outcome = await decide.decide(self, r, value, delta.numel, admit)
        lap(rs, "decide", voting)
        return outcome

    def bounds(self, numel: int, members: int) -> list[tuple[int, int]]:
        """The span partition of a Δ of `numel` values among `members` (`spans.spans_for`)."""
        chunk = self.pipeline.spec.chunk
        return span_bounds(numel, spans_for(numel, members), align=chunk.chunk if chunk else 1)

    def mark_silent(self, peer: PeerId) -> None:
        """Do not wait for `peer`'s answer in our gathers for a while (`silent`): twice the gather timeout (at least a
        call timeout), about as long as its record may outlive it; any reply from it ends this sooner."""
        self.silent[peer] = time.monotonic() + max(self.cfg.call_timeout, 2 * self.cfg.gather_timeout)

    def value_spans(self, value: Value, into: torch.Tensor | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(lo, hi, Δ̄[lo:hi]) for every span of a committed `value`, decoded from its result frames one at a
        time: the bytes every member applies (a lean round's `RoundOutcome.value`). With `into` (Δ̄'s size), each
        span is decoded into `into[lo:hi]`, which is what it yields."""
        for (lo, hi), frame, (owner, _, _) in zip(self.bounds(value.numel, len(value.view)), value.frames,
                                                  value.results):
            header, body, _ = msg.decode(frame, run=self.run_id, kind=msg.RESULT, caller=owner,
                                         max_body=self.cfg.max_payload, schema=self.schema)
            yield lo, hi, results.parse_result(self, header, body, len(value.view),
                                               into[lo:hi] if into is not None else None)[2]

    def frame(self, kind: str, key: RoundKey, **fields: Any) -> bytes:
        fragment = self.rounds[key].fragment if key in self.rounds else 0
        return msg.encode(kind, run=self.run_id, sender=self.me, schema=self.schema, key=key,
                          codec=self.pipeline.name, fragment=fragment, **fields)

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

    def accepting(self, key: RoundKey) -> RoundState:
        """The state of round `key` if frames for it are acceptable now (not stale, not far ahead)."""
        if key < self.floor:
            raise PayloadRejected(Reason.WRONG_ROUND, f"round {key} is over here (now at {self.floor})")
        if key.round > self.floor.round + 1:
            raise PayloadRejected(Reason.WRONG_ROUND, f"round {key} is too far ahead of {self.floor}")
        return self.state(key)

    def decode_from(self, caller: PeerId, data: bytes, kind: str, max_body: int) -> tuple[Header, memoryview, RoundKey]:
        """A frame of `kind` from `caller` to one of our handlers, checked (run, kind, schema, size; a banned caller
        refused); raises PayloadRejected."""
        self.check_banned(caller)
        return msg.decode(data, run=self.run_id, kind=kind, caller=caller, max_body=max_body, schema=self.schema)

    def span_frame(self, caller: PeerId, data: bytes, kind: str, *, owner: PeerId
                   ) -> tuple[Header, memoryview, RoundState]:
        """A contribution's or a result's frame from `caller` (`kind`), decoded and placed: its round's state, with its
        view and span checked against ours (`owner`: who owns its span); raises PayloadRejected."""
        header, body, key = self.decode_from(caller, data, kind, self.cfg.max_payload)
        rs = self.accepting(key)
        self.check_view_slot(rs, header.view, caller, owner=owner, span=header.span)
        return header, body, rs

    def check_view_slot(self, rs: RoundState, vid: str, sender: PeerId, *, owner: PeerId, span: int) -> None:
        if rs.view is None:  # our gather is still open: buffer, boundedly, and check later by view id
            rs.check_buffered(vid)
            if not 0 <= span < MAX_SPANS:
                raise PayloadRejected(Reason.WRONG_SPAN, f"span {span} out of range")
            return
        if not rs.view or rs.vid != vid:
            rs.mark_elsewhere(sender)
            raise PayloadRejected(Reason.WRONG_VIEW, f"frame for view {vid}, ours is {rs.vid or 'none'}")
        if sender not in rs.view:
            raise PayloadRejected(Reason.NOT_MEMBER, f"{sender} is not in this round's view")
        limit = rs.spans or MAX_SPANS  # known once our exchange starts
        if not 0 <= span < limit or rs.view[span % len(rs.view)] != owner:
            raise PayloadRejected(Reason.WRONG_SPAN, f"span {span} is not owned by {owner}")

    def adopt_bans(self, peers: Collection[PeerId], why: str) -> None:
        """Ban peers that others banned (e.g. a majority of the records we read: we joined after the fact)."""
        for p in peers:
            if p != self.me and p not in self.banned:
                self.banned.add(p)
                self.robust_events["banned"] += 1
                log.warning("event=peer_banned peer=%s reason=%s", p, why)

    def check_banned(self, caller: PeerId) -> None:
        if caller in self.banned:
            raise PayloadRejected(Reason.BANNED, f"{caller} is banned for this run ({self.strikes[caller]} strikes)")

    def reject(self, caller: PeerId, e: PayloadRejected) -> bytes:
        self.count_rejection(caller, e)
        return msg.ack(run=self.run_id, sender=self.me, ok=False, reason=e.reason.value)

    def count_rejection(self, peer: PeerId, e: PayloadRejected) -> None:
        self.rejections[e.reason.value] += 1
        log.warning("event=payload_rejected reason=%s peer=%s detail=%s", e.reason.value, peer, e.detail)

    async def call(self, peer: PeerId, name: str, frame: bytes) -> dict[str, Any] | None:
        """Send one frame; the reply's meta, or None when the peer could not be reached."""
        try:
            reply = await self.transport.call(peer, name, frame, self.cfg.call_timeout)
            meta = msg.read_ack(reply, run=self.run_id, caller=peer)
        except (TransportError, PayloadRejected) as e:
            log.info("event=call_failed handler=%s peer=%s reason=%s", name, peer, e)
            return None
        self.silent.pop(peer, None)
        if not meta.get("ok", False):
            log.info("event=frame_refused handler=%s peer=%s reason=%s", name, peer, meta.get("reason"))
            if meta.get("reason") == Reason.BANNED.value:
                self.banned_by.add(peer)  # its own sealed reply: nobody else can say this for it
        return meta

    def gathering(self, peer: PeerId, rnd: int) -> bool:
        """Whether `peer` sent us a `ready` for an attempt at round `rnd` (it is gathering that round). Called on
        our loop."""
        return any(key.round == rnd and peer in rs.ready for key, rs in self.rounds.items())

    def recheck(self, peers: Collection[PeerId]) -> None:
        """`peers` say in their records that they take no part in rounds now (standby, left): the gather we are
        running asks those it waits for again at once (they answer so, and are not waited for), rather than a
        grace later. Called on our loop."""
        rs = self.rounds.get(self.floor)
        if rs is None or rs.expected is None or rs.view is not None:
            return
        waiting = set(peers) & rs.waited(self.me) - rs.ready.keys()
        if waiting:  # the gather wakes only for peers it still waits for
            rs.recheck.update(waiting)
            rs.changed.set()

    def state(self, key: RoundKey) -> RoundState:
        if key not in self.rounds:
            self.rounds[key] = RoundState()
        return self.rounds[key]

    def _forget_before(self, key: RoundKey) -> None:
        for k in [k for k in self.rounds if k < key]:
            del self.rounds[k]
        self.ran = {v: r for v, r in self.ran.items() if r.key.round >= key.round}
        if self.accepted is not None and self.accepted.ballot.round < key.round:
            self.accepted = None
