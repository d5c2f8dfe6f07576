"""Rounds by time (`DiLoCo(round_seconds=S)`, `--round-seconds S`): when a worker's synchronization slot comes.

With P fragments a worker trains S/P seconds between two slots (each fragment syncs after every S seconds of
training), however many inner steps that is; the time counts from the end of the previous slot's work, so a
synchronization that takes long (a slow link, waiting for the others) does not eat into the next span's steps,
and workers that leave a round together reach the next slot together.

- **A lone process** reads its clock after every inner step: the slot is due once S/P seconds passed and at least
  one step was taken.
- **A torch.distributed site** steps in lockstep (DDP), but each rank has its own clock, so no rank may decide
  from its own: they would stop at different steps and the site's collectives would hang. The leader plans
  instead, at the second step of every span of steps (a point every rank reaches together; with overlap τ, the
  step after the last round was applied): from its clock it knows the time left until the slot and its pace (a
  moving average of its steps' durations, the slot's own work left out), and every rank takes the count it planned
  (`SiteLink.agree`, one broadcast per slot). A site's slot therefore comes after at least two steps.
- **With overlap** (τ > 0) a worker trains on while its round's exchange runs, so nothing makes the workers leave a
  round together: one that reached its slot early (it waited for the others in the round's gather while training)
  would stay that much ahead round after round, and wait for them every time. Its span therefore counts from the
  moment the round's view closed, the same for every member (`align`).

- **Adaptive rounds** (`DiLoCo(adaptive=True)`, `--adaptive`): a span lasts H/P inner steps of the swarm's
  fastest worker, whatever its machine: the fastest of our own step time and those the other workers publish in
  their records (`PeerRecord.step_seconds`), so nobody has to know the machines' speeds in seconds. A lone process
  recomputes it at every step (the others' step times arrive with the heartbeat); a site's leader when it plans.
  Before the first record arrives a worker paces itself by its own steps (its first span is H of its own). A record
  cannot make a span shorter than H/P steps of a machine `bound` times as fast as ours (the weight bound,
  `RobustConfig.max_weight`): one implausibly fast claim does not shrink every round to a step.

- **Overlap τ** (`--overlap`) counts steps of the fastest worker too (`scaled_overlap`): a worker k times as slow
  applies a round τ/k of its own steps after its slot, so every worker applies it about the same time after the
  slot, as long as the exchange takes on the link. While it knows no other worker's step time, at most half its span.

The pace decides only where the slots fall (and when a round applies); what a worker's pseudo-gradient weighs (the
inner steps it covers) is the engine's (`RoundEngine`).
"""

from __future__ import annotations

from typing import Callable, Sequence

PLAN_AT = 2
"""The step of a span at which a site's leader plans the span's length: by then it has timed one whole step."""

TOLERANCE = 1e-9
"""Seconds a slot may be short by: a clock that counts whole steps (the simulator's) lands on it up to rounding."""

SMOOTHING = 0.2
"""Weight of the latest step's duration in the moving average of a step's seconds."""

ROBUST_FROM = 4
"""Timed steps a span needs before its slowest one is left out of the step time a worker publishes."""


def adaptive_seconds(steps: float, own: float, others: Sequence[float], bound: float) -> float:
    """An adaptive span's seconds: `steps` inner steps at the fastest pace among ours (`own` seconds a step) and the
    `others`' published ones, where no other counts as more than `bound` times as fast as we are (0: no bound)."""
    fastest = min(own, *others) if others else own
    if bound:
        fastest = max(fastest, own / bound)
    return steps * fastest


def scaled_overlap(tau: int, own: float | None, others: Sequence[float], bound: float,
                   span_seconds: float = 0.0) -> int:
    """τ in a worker's own steps with rounds by time: a round's exchange takes as long for every worker, so τ counts
    steps of the swarm's fastest worker, and a worker k times as slow applies the round τ/k of its own steps after its
    slot (at least one; τ itself while its pace is unknown). Counting τ in every worker's own steps instead, a slow
    worker would train past most of its span before applying the round, and with α = 0 drop those steps from its Δ:
    at 4× slower and τ near its steps a round, its weight fell to a tenth of the fastest's, under the weight bound's
    floor (docs/BENCHMARKS.md, "Workers of unequal speed").

    Whenever no other worker's step time is known (their records not read yet: the first rounds, or every round when
    rounds are short beside the heartbeat; a worker alone) we may be the slowest, so τ takes at most half of our span of
    `span_seconds` (0: unknown): τ of our own steps took a slow worker's whole span, its Δ covered one step, and the
    fastest worker's honest Δ was refused as overweight (tests/test_round_seconds.py,
    `test_a_slow_worker_that_knows_no_other_pace_yet_keeps_half_its_span`)."""
    if tau <= 0 or own is None or not own > 0:
        return tau
    if not others:
        return max(1, min(tau, int(span_seconds / (2 * own)))) if span_seconds > 0 else tau
    fastest = adaptive_seconds(1, own, others, bound)
    return max(1, min(tau, round(tau * fastest / own)))


def planned_steps(taken: int, elapsed: float, slot_seconds: float, step_seconds: float) -> int:
    """How many inner steps a span should have in all so that its slot comes `slot_seconds` after it began:
    `taken` steps already, in `elapsed` seconds, then as many steps of `step_seconds` as fit in the time left
    (none when it is up: the slot comes now)."""
    left = slot_seconds - elapsed
    if left <= 0 or not step_seconds > 0:
        return taken
    return taken + round(left / step_seconds)


class Pace:
    """When the slots of one worker's rounds by time come (see the module docstring). `planned`: a site, whose
    leader plans each span's length for every rank; otherwise a lone process reading its clock."""

    def __init__(self, round_seconds: float | None, fragments: int, *, planned: bool, now: float,
                 plan_at: int = PLAN_AT, adaptive_steps: int | None = None,
                 others: Callable[[], Sequence[float]] = lambda: (), bound: float = 0.0) -> None:
        """`round_seconds`: S; or, with `adaptive_steps` (H) instead, a round lasts H steps of the fastest worker,
        `others()` giving the other workers' published step times and `bound` the weight bound (see the module
        docstring)."""
        if (round_seconds is None) == (adaptive_steps is None):
            raise ValueError("give round_seconds or adaptive_steps, one of them")
        self.adaptive = adaptive_steps / fragments if adaptive_steps is not None else None
        """Adaptive rounds: inner steps of the fastest worker between two slots (None: a fixed time)."""
        self.slot_seconds = round_seconds / fragments if round_seconds is not None else 0.0
        """Seconds of training between two slots (each fragment syncs after every `round_seconds` of it); adaptive,
        as last computed."""
        self.others, self.bound = others, bound
        """`others()`: the other workers' step times (their records'); `bound`: how many times as fast as ours one
        may count (the weight bound; 0: no bound)."""
        self.published: float | None = None
        """Our step time as our record tells the others (the engine sets it when it publishes, `span_step_seconds`: after the
        first few steps, then at every slot). An adaptive span reads ours from here rather than from the live average, so that the
        fastest worker and those reading its record compute the same span and reach the slot together."""
        self.planned = planned
        self.plan_at = max(PLAN_AT, plan_at)
        """A site: the step of each span at which the leader plans it."""
        self.span = 0
        """Inner steps since the last slot (or since training began): the same count on every rank of a site,
        which `due` and `slot` alone change (never `restart`, which only the leader of a site runs)."""
        self.plan: int | None = None
        """A site: the span's length the leader planned at its step `PLAN_AT` (None before)."""
        self.step_seconds: float | None = None
        """The leader's moving average of an inner step's duration (the slot's own work left out)."""
        self._timed_seconds, self._timed_steps, self._slowest = 0.0, 0, 0.0
        """Seconds, count and the slowest of the timed steps of this span (`span_step_seconds`)."""
        self._start = now
        self._last: float | None = None

    def restart(self, now: float) -> None:
        """The worker's span of inner steps begins now: it joined, or took another peer's state. The step that
        follows is not timed: it holds whatever came between (the script's own set-up, a barrier, a first
        compilation), which would size a whole adaptive span (the pace is timed from the second step on)."""
        self._start, self._last = now, None

    def due(self, now: float, agree: Callable[[Callable[[], int]], int]) -> bool:
        """After an inner step ended at `now`: whether this step is a slot. `agree(decide)` gives every rank of a
        site the leader's `decide()` (for a lone process: `decide()`)."""
        if self._last is not None:
            took = now - self._last
            self.step_seconds = took if self.step_seconds is None else \
                (1 - SMOOTHING) * self.step_seconds + SMOOTHING * took
            self._timed_seconds += took
            self._timed_steps += 1
            self._slowest = max(self._slowest, took)
        self._last = now
        self.span += 1
        if not self.planned:
            if self.adaptive is not None:
                if self.step_seconds is None:
                    return False
                self._adapt(self.step_seconds)
            return now - self._start >= self.slot_seconds - TOLERANCE
        if self.span == self.plan_at:
            self.plan = agree(lambda: self._plan(now))
        return self.plan is not None and self.span >= self.plan

    @property
    def span_step_seconds(self) -> float | None:
        """The mean duration of this span's timed steps but its slowest (from `ROBUST_FROM` of them; None before one
        is timed): the step time a worker publishes, which sizes the next adaptive span of every worker that reads it.
        Not the moving average, which follows the last few steps: one step held up by the scheduler (a busy machine
        preempts a process for tens of ms) would triple it. Nor the plain mean: one stall in a span (a collection
        pause, a page-in, a process of three workers preempted for a second) is no forecast of the next span's pace,
        yet a second's stall in a span of 12 steps of 10 ms multiplied the mean by ten and stretched every worker's
        next span as much. A pace that stalls every few steps (a data loader) still counts: only one step is left out."""
        if not self._timed_steps:
            return None
        if self._timed_steps >= ROBUST_FROM:
            return (self._timed_seconds - self._slowest) / (self._timed_steps - 1)
        return self._timed_seconds / self._timed_steps

    def _adapt(self, own: float) -> None:
        assert self.adaptive is not None
        # ours as our record shows it (what the others read), so that every worker computes the same span
        self.slot_seconds = adaptive_seconds(self.adaptive, self.published or own, self.others(), self.bound)

    def _plan(self, now: float) -> int:
        """The leader's decision: how many steps this span has in all."""
        if self.adaptive is not None and self.step_seconds is not None:
            self._adapt(self.step_seconds)
        taken = planned_steps(self.span, now - self._start, self.slot_seconds, self.step_seconds or 0.0)
        return max(self.plan_at, taken)

    def align(self, closed: float) -> None:
        """The last round's view closed at `closed` (a moment every member shares): the span counts from there if that
        is later than its start (an overlapped round's gather that waited for slower members)."""
        self._start = max(self._start, closed)

    def pause(self, begin: float, end: float) -> None:
        """From `begin` to `end` the worker waited instead of training (for a round's result, τ steps after its slot):
        neither the span's time nor the step's duration counts it."""
        self._start += max(0.0, end - max(begin, self._start))
        if self._last is not None:
            self._last += max(0.0, end - max(begin, self._last))

    def slot(self, ended: float) -> None:
        """A slot's work ended at `ended`: the next span, and the next step's duration, count from then."""
        self.span, self.plan = 0, None
        self._start, self._last = ended, ended
        self._timed_seconds, self._timed_steps, self._slowest = 0.0, 0, 0.0
