"""`RoundEngine`: one worker's rounds on one swarm — the life of a synchronization from slot to outer step.

At a synchronization slot the engine forms the pseudo-gradient Δ = θ − θ_local of the next fragment, hands it
to the swarm's collective (in the background), and applies the averaged Δ̄ with the outer optimizer when the
round completes: at once, τ inner steps later (streaming), or at the next slot (a whole outer step
overlapped, eager or delayed). A round that fails leaves θ as it was (the local model keeps its progress);
a Δ that is not finite rolls the model back to θ and sends nothing; a swarm that moved past us is caught up
with by downloading its state (`diloco.catchup`). Compression's error feedback keeps, per fragment, what a
round did not deliver.

The engine knows nothing of the model or of the training loop: it reads the local parameters through a
function, and the caller (`DiLoCo`, or a region's global level, `diloco.regions`) counts the inner steps.
What the worker holds and how it stands in the swarm is its `Member`'s (`diloco.member`); on a
torch.distributed site every rank runs the same engine, the leader deciding wherever the swarm is asked and
the other ranks applying its decisions (`diloco.sitelink`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from diloco.comms import RoundKey, RoundOutcome
from diloco.comms.rounds import Handoff
from diloco.comms.robust import RobustConfig
from diloco.compression.codecs import all_finite as finite
from diloco.compression.pipeline import Pipeline, Spec
from diloco.peers import stragglers
from diloco.peers.membership import Voters

from .fragments import Fragment, HSchedule, StreamingConfig, fragment_of_round, inner_steps_at
from .holding import views
from .member import Member
from .outer import copy_into, is_pinned, mix_into, outer_step, pseudo_gradient, pseudo_gradient_pieces
from .pace import Pace, scaled_overlap
from .perfragment import PerFragment
from .report import RoundReport
from .shards import ShardedHandoff
from .swarm import Banned

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A round in flight: what we sent (error-feedback accumulator) and when it must be applied."""

    fragment: Fragment
    acc: torch.Tensor | None
    """What we sent, kept only when something needs it after the round (error feedback, a failed whole-step
    overlap's carry); otherwise the round drops Δ once it is encoded."""
    due: int  # inner step at which the result is applied
    started: float
    slot: int = 0
    """The inner step of the slot that sent it: once it commits, the fragment's next Δ covers the steps after it."""
    future: concurrent.futures.Future[RoundOutcome] | None = None
    source: ShardedHandoff | None = None  # an FSDP2 site leader's Δ, read span by span by the round
    key: RoundKey = RoundKey(0)
    outcome: RoundOutcome | None = None
    blocked: bool = False


FIRST_PUBLISHED = 4
"""Inner steps into its first span after which a worker publishes its step time (adaptive rounds read it)."""


class RoundEngine:
    """The rounds of one worker (see the module docstring). `swarm` is None for a lone worker (no network)."""

    def __init__(self, member: Member, *, fragments: Sequence[Fragment], streaming: StreamingConfig,
                 inner_steps: int, h_schedule: HSchedule, outer_lr_schedule: Callable[[int], float], spec: Spec,
                 on_rollback: Callable[[], None] = lambda: None, round_seconds: float | None = None,
                 adaptive: bool = False, voters: Voters | None = None) -> None:
        """`member`: the worker in its swarm (state, standing, catching up). `on_rollback()`: after a non-finite Δ
        rolled the model back (the inner optimizer's state holds the same NaN). `voters`: what our rounds' quorum
        counts of their peers (`Swarm.exchange_async`; a merge of regions: their regions)."""
        self.voters = voters
        self.member = member
        self.holding, self.standing, self.link, self.local = member.holding, member.standing, member.link, member.local
        self.fragments = list(fragments)
        self.streaming = streaming
        self.inner_steps, self.h_schedule = inner_steps, h_schedule
        self.outer_lr_schedule = outer_lr_schedule
        self._on_rollback = on_rollback
        self.error_feedback = spec.ef is not None
        self.local_pipeline = Pipeline(spec)  # a lone worker's rounds encode as a swarm's would (what `usage` counts)
        self.per_fragment = PerFragment(self.fragments, spec.ef)
        """What we keep per fragment between rounds (`diloco.perfragment`)."""
        self.rollbacks = 0
        """Syncs at which our own pseudo-gradient was not finite: rolled back to θ, nothing sent."""
        self.pending: _Pending | None = None
        self.start: list[torch.Tensor] | None = None  # eager: where this phase started (≠ θ)
        self.last_view = 1
        by_time = round_seconds is not None or adaptive
        self.pace = Pace(round_seconds, len(self.fragments), planned=self.link.site is not None, now=time.monotonic(),
                         plan_at=streaming.overlap + 1, adaptive_steps=inner_steps if adaptive else None,
                         others=member.step_seconds_of_others, bound=RobustConfig().max_weight) \
            if by_time else None
        """Rounds by time (each fragment syncs every `round_seconds`, or adaptive: H steps of the swarm's fastest
        worker): when our slots come (`diloco.pace`), and our Δ counts in the round's means by the steps it covers.
        None: every H inner steps."""
        self.clock: Callable[[], float] = time.monotonic
        """The seconds rounds by time count (the simulator gives each worker a clock of its simulated steps)."""

    @property
    def residuals(self) -> list[torch.Tensor] | None:
        """The error-feedback residual of each fragment (what compression has not delivered yet), or None without
        error feedback."""
        return self.per_fragment.residuals() if self.error_feedback else None

    # ------------------------------------------------------------------ the schedule

    @property
    def overlapped(self) -> bool:
        """A whole outer step overlapped (`outer_overlap` eager or delayed): a round completes at the next slot."""
        return self.streaming.outer_overlap != "none"

    @property
    def inner_steps_now(self) -> int:
        """H of the next round: `inner_steps`, or what `h_schedule` says after the rounds committed (those on
        the wire count: a schedule's change applies from the slot after the round it names)."""
        return inner_steps_at(self.holding.round + self.pending_rounds, self.inner_steps, self.h_schedule)

    @property
    def period(self) -> int:
        """Inner steps between synchronization slots now (H/P)."""
        return max(1, self.inner_steps_now // len(self.fragments))  # by time, H need not be a multiple of P

    @property
    def pending_rounds(self) -> int:
        """Rounds started but not applied yet (0 or 1): `round + pending_rounds` is how many rounds this peer
        has put on the wire."""
        return 1 if self.pending is not None else 0

    def after_step(self) -> bool:
        """One inner step was taken: apply a round that is due, and synchronize at a slot (True when this step
        was one)."""
        s = self.standing
        s.steps += 1
        if self.link.site is None and (signum := self.member.stop_requested()) is not None:
            raise SystemExit(128 + signum)  # leave now: `with` applies what is in flight (a site: at its slot)
        if self.pending is not None and self.pending.due <= s.steps and not self.overlapped:
            self.complete(self.pending)
        if not self._slot_due():
            return False
        s.last_slot = s.steps
        try:
            over = self.member.check_standing(self.member.round + self.pending_rounds)
        except Banned:
            self.pending = None  # the exchange in flight can only fail: nobody takes our rounds any more
            raise
        if over:  # the whole swarm's run ended (`diloco.ending`): no round past it; leaving applies one in flight
            return True
        if self.overlapped:
            self.overlapped_slot()
        else:
            if self.pending is not None:  # rounds by time: a slow worker's slot came before the last one's τ steps
                self.complete(self.pending)
            self.launch()
        if self.pace is not None:
            self.pace.slot(self.clock())
        return True

    # ------------------------------------------------------------------ a slot

    def _slot_due(self) -> bool:
        if self.pace is None:
            return self.standing.position >= self.period
        due = self.pace.due(self.clock(), self.link.agree)
        # the first time we publish: once a few steps are timed (the first ones warm up), or at the slot
        settled = due or (self.standing.step_seconds is None and self.pace.span > FIRST_PUBLISHED)
        if settled and (mean := self.pace.span_step_seconds) is not None:
            first = self.standing.step_seconds is None
            # published with our record (adaptive rounds read it, ours included: `Pace.published`): the span's mean
            self.standing.step_seconds = self.pace.published = mean
            if first and self.member.swarm is not None:
                self.member.publish("training", now=False)  # the first: with the next heartbeat, not after a round
        return due

    def restart_clock(self) -> None:
        """We start from θ whole (joined, or took another peer's state): every fragment's Δ covers the steps from
        here, and with rounds by time the span of inner steps to the next slot begins now."""
        self.per_fragment.restart(self.standing.steps)
        if self.pace is not None:
            self.pace.restart(self.clock())

    def covered(self, frag: Fragment) -> int:
        """Inner steps the Δ of `frag` formed now covers (at least one): since its last committed round, or since
        we last started from θ whole."""
        return self.per_fragment.covered(frag, self.standing.steps)

    def sync(self) -> RoundReport:
        """Synchronize the next fragment now and wait for its result (`DiLoCo.sync`)."""
        self.flush()
        report = self.launch(force_complete=True)
        assert report is not None
        return report

    def flush(self) -> RoundReport | None:
        """Apply the exchange still in flight (waiting for it if needed); None when there is none."""
        if self.pending is None:
            return None
        report = self.complete(self.pending, in_step=False)
        if self.overlapped and report is not None:
            copy_into(self.local(), self.holding.params)  # the phase is over: continue from θ
            self.start = None
        return report

    def launch(self, force_complete: bool = False) -> RoundReport | None:
        """A synchronization slot: resync if the swarm moved on, else start the next fragment's round in the
        background (it is applied τ steps later, or at once when τ = 0)."""
        started = time.monotonic()
        topology = self.member.topology
        if topology is not None and topology.own_slots:  # gossip: a round of its own (on a site, the leader's)
            own = self.link.settle(self.member, lambda: topology.slot(started))
            assert own is not None
            return own if self.link.talks else self.member.report(own)
        resync = self.member.maybe_resync(started, cached=True)
        if resync is not None:
            return resync
        frag = self.fragments[fragment_of_round(self.holding.round, len(self.fragments))]
        self.standing.covered = self.covered(frag)
        global_frag, local_frag = views(self.holding.params, frag.params), views(self.local(), frag.params)
        delta: torch.Tensor | list[torch.Tensor]
        if self.lean:  # in pieces the round frees as it encodes them (SIZE.md)
            delta = pseudo_gradient_pieces(global_frag, local_frag)
            ok = all(finite(p) for p in delta)
        else:
            delta = pseudo_gradient(global_frag, local_frag, out=self._buffer(frag))
            ok = finite(delta)
        if not self.link.all_true(ok):  # on an FSDP2 site every rank judges its own piece
            return self.roll_back(started)
        pending = self.start_exchange(frag, delta, started)
        del delta  # the round has it; holding it here would keep a copy of the model alive through the round
        if self.streaming.overlap == 0 or force_complete:
            return self.complete(pending)
        return None

    def overlapped_slot(self) -> None:
        """Whole-step overlap (P = 1): finish the round sent one slot ago, send this phase's Δ, and continue
        from θ (delayed) or from θ plus our fresh contribution (eager)."""
        started = time.monotonic()
        frag = self.fragments[0]
        start = self.start if self.start is not None else self.holding.params
        delta = pseudo_gradient(start, self.local())  # before the late aggregate moves θ
        if not finite(delta):
            if self.pending is not None:
                self.complete(self.pending)
            self.roll_back(started)
            self.start = None
            return
        before = self.holding.clone() if self.streaming.outer_overlap == "eager" else None
        aggregate = None
        if self.pending is not None:
            pending = self.pending
            report = self.complete(pending)
            if report is not None and report.committed and pending.outcome is not None:
                aggregate = pending.outcome.aggregate
            elif report is not None and report.resynced:
                self.start = None
                return  # the swarm's θ replaced ours: this phase's Δ is not comparable; start over
        kept = self.per_fragment[frag]
        carry, kept.carry = kept.carry, None
        if carry is not None:  # the round just finished failed: its Δ is still ours to deliver
            delta = delta + carry
        resync = self.member.maybe_resync(started, cached=True)
        if resync is not None:
            self.start = None
            return
        self.standing.covered = self.covered(frag)
        kept.since = self.standing.steps  # each phase's Δ is its own (a failed one's comes as the carry)
        self.start_exchange(frag, delta, started)
        if before is None:
            copy_into(self.local(), self.holding.params)
            self.start = None
            return
        # Eager (Kale et al.): step from the state before the late aggregate arrived, with that aggregate plus
        # our own fresh contribution — exactly their per-worker update for outer SGD without momentum —
        # anchored to the shared θ every phase, so no peer drifts from the others.
        params, outer = before
        grad = delta / self.last_view if aggregate is None else aggregate.to(delta.device) + delta / self.last_view
        outer_step(outer, params, grad, self.outer_lr_scale())
        copy_into(self.local(), params)
        self.start = params

    def outer_lr_scale(self) -> float:
        """The outer lr's factor for the step that commits the next global round."""
        return self.outer_lr_schedule(self.holding.round + 1)

    def roll_back(self, started: float) -> RoundReport:
        """Our pseudo-gradient holds NaN or Inf (a diverged inner step): contribute nothing this round, restart
        from the global θ, and drop the inner optimizer's per-parameter state (its moments hold the same NaN).
        The swarm goes on without us; we catch up at the next slot if it moved."""
        self.rollbacks += 1
        log.warning("event=non_finite_update round=%d reason=our pseudo-gradient holds NaN or Inf: rolled back to "
                    "the global state, sent nothing (lower the inner lr or clip gradients if this repeats)",
                    self.holding.round)
        copy_into(self.local(), self.holding.params)
        self.per_fragment.restart(self.standing.steps)
        self._on_rollback()
        return self.member.report(RoundReport(self.holding.round, False, "non-finite pseudo-gradient: rolled back, "
                                              "sent nothing", 1, 0, 0, time.monotonic() - started, self.standing.steps))

    def _buffer(self, frag: Fragment) -> torch.Tensor | None:
        """Where a lone worker forms Δ of `frag`: the same buffer every slot (`PerFragment.buffer`). Only without a
        swarm and without a whole outer step overlapped: there nothing holds the last slot's Δ by the time this
        fragment's next slot comes (τ < H/P)."""
        if self.member.swarm is not None or self.overlapped or self.link.site is not None:
            return None
        return self.per_fragment.buffer(frag, self.holding.device, any(is_pinned(p) for p in self.holding.params))

    @property
    def lean(self) -> bool:
        """Whether our rounds take Δ in pieces and keep Δ̄ as their frames (`PiecewiseHandoff`): a lone peer in a
        swarm (a site's leader hands the whole outcome to its ranks; error feedback and overlap read Δ and Δ̄
        whole)."""
        return self.member.swarm is not None and self.link.site is None and not self.error_feedback and \
            not self.overlapped

    # ------------------------------------------------------------------ the exchange

    def overlap_now(self) -> int:
        """τ of the round we send now, in our own inner steps: `streaming.overlap`, or with rounds by time that many
        steps of the swarm's fastest worker (`pace.scaled_overlap`; a site's ranks take the leader's count)."""
        tau, pace = self.streaming.overlap, self.pace
        if tau == 0 or pace is None or self.overlapped:
            return tau
        return self.link.agree(lambda: scaled_overlap(tau, pace.step_seconds, pace.others(), pace.bound,
                                                      pace.slot_seconds))

    def start_exchange(self, frag: Fragment, delta: torch.Tensor | list[torch.Tensor], started: float) -> _Pending:
        """Send `delta` (Δ of `frag`) on its round, in the background; it is due τ steps later (or at the next
        slot, with a whole outer step overlapped). A lone worker's round completes here, through its codec."""
        key = RoundKey(self.holding.round, self.standing.attempt)
        steps = self.standing.steps
        tau = self.overlap_now()
        if isinstance(delta, list):  # a lean round's Δ in pieces: only the round reads it
            self.pending = _Pending(frag, None, steps + tau, started, steps,
                                    future=self._exchange(frag, delta), key=key)
            return self.pending
        ef = self.per_fragment[frag].ef
        acc = ef.accumulate(delta) if ef is not None else delta
        due = steps + (self.inner_steps_now if self.overlapped else tau)
        if self.link.follows:  # the leader sends; we apply the outcome it tells us (`complete`)
            self.pending = _Pending(frag, acc, due, started, steps, key=key)
            return self.pending
        if self.member.swarm is None:
            sent, size = self._locally(acc)
            outcome = RoundOutcome(RoundKey(self.holding.round), True, "local", (), sent, [()], sent,
                                   payload_bytes=size)
            self.pending = _Pending(frag, acc, due, started, steps, outcome=outcome)
            return self.pending
        source = self.link.handoff(acc, frag.params)
        future = self._exchange(frag, source or acc)
        keep = self.error_feedback or self.overlapped
        self.pending = _Pending(frag, acc if keep else None, due, started, steps, future=future, source=source,
                                key=key)
        return self.pending

    def _locally(self, acc: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A lone worker's round: what its codec would deliver of `acc`, and the bytes it would send. Plain fp32
        delivers `acc` itself in 4 bytes a value: nothing is encoded (it would cost a copy out and one back);
        a lossy codec is applied, as a swarm's peers would apply it (with its error feedback)."""
        if self.local_pipeline.spec.text == "fp32":
            return acc, 4 * acc.numel()
        payload = self.local_pipeline.encode_parts([acc])
        onto = acc.device if acc.device.type != "cpu" else None  # θ on a GPU: the bytes decode there
        return self.local_pipeline.decode(payload, acc.numel(), onto).dense(acc.numel()), len(payload)

    def _exchange(self, frag: Fragment, delta: torch.Tensor | list[torch.Tensor] | Handoff,
                  ) -> concurrent.futures.Future[RoundOutcome]:
        swarm, s = self.member.swarm, self.standing
        assert swarm is not None
        weight = s.covered if self.pace is not None else 1
        return swarm.exchange_async(self.holding.round, s.attempt, self.holding.digest, delta, fragment=frag.index,
                                    previous=s.members, skip=s.stragglers, weight=weight, voters=self.voters)

    def complete(self, pending: _Pending, in_step: bool = True) -> RoundReport | None:
        """Wait for the exchange in flight and apply it; waiting inside an inner step (not in `flush`) is
        counted as time the training loop was blocked."""
        self.pending = None
        outcome = pending.outcome
        if outcome is None:
            self.link.serve_piece(pending.acc, pending.fragment.params)  # an FSDP2 rank: the leader reads it
            waited = time.monotonic()
            outcome, pending.blocked = self.link.agree(lambda: self._outcome_of(pending, in_step))
            if pending.blocked:
                self.member.accounting.blocked(time.monotonic() - waited)
            pending.outcome = outcome
            if self.pace is not None and self.clock is time.monotonic:  # rounds by time count training time only
                if outcome.gathered_at is not None:
                    self.pace.align(outcome.gathered_at)  # an overlapped round: the span counts from its view's close
                if in_step:
                    self.pace.pause(waited, time.monotonic())  # the wait for its result (τ steps on) is not training
        report = self._apply(pending, outcome)
        members, topology = self.standing.members, self.member.topology
        if outcome.committed and topology is not None and members:
            if topology.reshapes:  # a region's merge: on a site the leader's, and every rank takes its state
                self.link.settle(self.member, lambda: topology.after_commit(members))
            else:
                topology.after_commit(members)
        if not outcome.committed and self.member.in_swarm:
            resync = self.member.maybe_resync(pending.started)  # maybe the others committed without us: now
            if resync is not None:
                return resync
        return report

    def _outcome_of(self, pending: _Pending, in_step: bool) -> tuple[RoundOutcome, bool]:
        """The leader's side of `complete`: the exchange's outcome (waiting for it), and whether the training
        loop had to wait."""
        swarm = self.member.swarm
        assert pending.future is not None and swarm is not None
        blocked = not pending.future.done() and in_step
        try:
            outcome = swarm.finish_exchange(pending.future, pending.key)
        finally:
            if pending.source is not None:
                pending.source.close()  # the ranks serving its spans go on
        self.link.keep_value(outcome)
        if outcome.committed and not swarm.may_apply(outcome.key.round):
            outcome = RoundOutcome(outcome.key, False, "crashed", outcome.view)  # killed in-process before the step
        return outcome, blocked

    def _apply(self, pending: _Pending, outcome: RoundOutcome) -> RoundReport:
        """The outer step of a committed round (θ moves, the local model mixes in), or a failed round's bookkeeping."""
        frag, s, swarm = pending.fragment, self.standing, self.member.swarm
        kept = self.per_fragment[frag]
        if outcome.committed:
            aggregate = self.link.aggregate(frag, outcome, swarm)
            if kept.ef is not None:
                assert outcome.sent is not None and pending.acc is not None
                kept.ef.commit(pending.acc, outcome.sent)
            if self.streaming.outer_overlap == "eager":  # the eager step reads the aggregate again
                aggregate = aggregate.clone()
            scale = self.outer_lr_scale()
            with self.holding.changing(touched=frag.params) as state:
                global_frag = views(state.params, frag.params)
                outer_step(state.outer, global_frag, aggregate, scale)
                state.round += 1
            if swarm is not None:
                swarm.applied(outcome.key.round)
            del aggregate
            s.attempt = 0
            if not self.overlapped:  # with α = 0 the mix below drops the τ steps since the slot: Δ starts anew here
                kept.since = max(kept.since, pending.slot if self.streaming.alpha > 0 else s.steps)
            self.last_view = max(1, len(outcome.view))
            if outcome.view:
                # members the round went on without are not waited for until they make it into a view again
                s.stragglers = stragglers(s.stragglers, s.members or (), outcome.view,
                                          swarm.records(cached=True) if swarm is not None else ())
                s.members = tuple(outcome.view)
            if not self.overlapped:
                mix_into(views(self.local(), frag.params), global_frag, self.streaming.alpha)
            log.info("event=round_committed round=%d fragment=%d peers=%d", self.holding.round, frag.index,
                     len(outcome.view))
            self.member.committed()
        else:
            s.attempt = outcome.key.attempt + 1
            if self.overlapped:  # the local copy no longer carries this Δ: deliver it with the next round
                assert pending.acc is not None
                if kept.ef is not None:
                    kept.ef.commit(pending.acc, torch.zeros_like(pending.acc))
                else:
                    kept.carry = pending.acc
            log.warning("event=round_failed round=%s fragment=%d reason=%s", outcome.key, frag.index, outcome.reason)
        self.member.accounting.round_moved(outcome.bytes_sent + outcome.bytes_received, outcome.seconds)
        return self.member.report(RoundReport(
            self.holding.round, outcome.committed, outcome.reason, max(1, len(outcome.view)), outcome.bytes_sent,
            outcome.bytes_received, time.monotonic() - pending.started, s.steps, payload_bytes=outcome.payload_bytes,
            numel=frag.numel, fragment=frag.index, blocked=pending.blocked, phases=outcome.phases))
