"""Rounds by time (`DiLoCo(round_seconds=S)`): workers of unequal speed each run inner steps until the round's
time is up, and their pseudo-gradients count by the steps they cover. The exact weighted mean is
tests/test_collective.py's subject; here, real wrappers in an in-process swarm."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from diloco import DiLoCo
from diloco.compression.errors import ConfigError
from diloco.fragments import StreamingConfig
from diloco.member import Member
from diloco.pace import Pace, adaptive_seconds, planned_steps, scaled_overlap

from test_swarm_inproc import PATIENT, Harness, _batches, _mlp, _run_threads

ROUNDS = 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("streaming", "compression"), [(None, None), (StreamingConfig(fragments=2, overlap=2), None),
                                                       (StreamingConfig(overlap=8), None),
                                                       (None, "topk:64/512+ef:0.9")],
                         ids=["whole", "fragments", "overlap", "error-feedback"])
def test_workers_of_unequal_speed_each_train_until_the_slot_and_end_on_one_digest(streaming, compression):
    """Three workers whose inner steps take 10, 20 and 40 ms train for 0.5 s a round: each round every one of them
    syncs with the steps it managed (the fast one about four times the slow one's), all commit the same rounds
    together, and they end on one global state. With two streaming fragments and τ = 2 each fragment syncs every
    0.5 s (a slot every 0.25 s, the slowest worker's slot coming before its τ steps did: it applies the round
    at the slot), and each fragment's Δ counts by the steps since that fragment's last round. With top-k and error
    feedback, each coordinate's mean weighs the workers that sent it. With τ = 8 and α = 0 (the mix drops the steps
    between a slot and the round's result from the next Δ), τ counts steps of the fastest worker: the slowest, about
    11 steps a round, applies the round 2 of its steps after its slot, not 8, so its Δ still weighs about a quarter of
    the fastest's, within the weight bound (8×), and no contribution is refused."""
    rounds = ROUNDS * (streaming.fragments or 1 if streaming else 1)
    measured: dict[int, float] = {}
    ds, covered, shown = _train_unequal(rounds, streaming=streaming, compression=compression, round_seconds=0.5,
                                        measured=measured)
    assert all(c >= 1 for cs in covered.values() for c in cs), covered
    assert [d.swarm.collective.robust_events["overweight"] for d in ds] == [0, 0, 0], covered
    # the fast worker's Δ counts more steps, as many more as its steps were faster (idle ~4×; 1.9× seen in a busy
    # suite's slow hour, where 2× was asked of the sums), and counts more
    faster = measured[2] / measured[0]
    assert faster > 1.2 and sum(covered[0]) > 0.6 * faster * sum(covered[2]), (covered, measured)
    assert shown[0]["w0"] == covered[0][-1] and all(n is not None and n >= 1 for n in shown[0].values()), shown


@pytest.mark.timeout(120)
def test_a_slow_worker_that_knows_no_other_pace_yet_keeps_half_its_span(monkeypatch):
    """τ = 8 with no other worker's step time ever read (as in the first rounds, before the records arrive): the
    slowest worker (40 ms a step, 0.5 s spans) may not spend τ of its own steps, most of its span, before applying
    the round and (α = 0) dropping them from its Δ: its Δ covered 4 steps against the fastest's 34, and the fastest
    worker's honest Δ was refused as overweight. It applies the round within half its span instead."""
    monkeypatch.setattr(Member, "step_seconds_of_others", lambda self: [])
    ds, covered, _ = _train_unequal(ROUNDS, streaming=StreamingConfig(overlap=8), round_seconds=0.5)
    assert [d.swarm.collective.robust_events["overweight"] for d in ds] == [0, 0, 0], covered
    # about half its span (its first Δ, before any round applied, covers a whole span): 6 of 12 steps of 40 ms
    assert all(c >= covered[2][0] // 3 for c in covered[2][1:]), covered


@pytest.mark.parametrize(("tau", "own", "others", "span", "expected"), [
    (8, 0.04, [0.01], 0.5, 2),  # steps of the fastest worker: a quarter of ours
    (8, 0.04, [], 0.5, 6),  # nobody else known: at most half of our span (0.25 s of 40 ms steps)
    (8, 0.01, [], 0.5, 8),  # ... which τ fits in
    (8, 0.04, [], 0.0, 8),  # the span unknown too: τ itself
    (8, 0.5, [], 0.5, 1),  # at least one step
    (8, None, [0.01], 0.5, 8),  # our own pace unknown
])
def test_scaled_overlap(tau, own, others, span, expected):
    assert scaled_overlap(tau, own, others, 8.0, span) == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fragments", [1, 2])
def test_adaptive_rounds_last_h_steps_of_the_fastest_worker_and_the_others_train_as_many_as_they_manage(fragments):
    """`adaptive=True`, H = 24: nobody gives a time. Each worker publishes its step time in its record; a round lasts
    H steps of the fastest (10 ms a step), so the fastest worker's Δ covers about H steps and the one four times as
    slow about a quarter of that, not H (which would make every round four times as long); with two fragments each
    fragment syncs after H steps of the fastest (a slot every H/2). They commit every round together and end on one
    state."""
    h_steps = 24
    streaming = StreamingConfig(fragments=fragments, overlap=2) if fragments > 1 else None
    published: dict[int, set[float]] = {i: set() for i in range(3)}
    measured: dict[int, float] = {}
    ds, covered, _ = _train_unequal(ROUNDS * fragments, streaming=streaming, adaptive=True, inner_steps=h_steps,
                                    published=published, measured=measured)
    later = {i: cs[fragments:] for i, cs in covered.items()}  # a worker's first span may be paced by its own steps
    fast, slow = sum(later[0]) / len(later[0]), sum(later[2]) / len(later[2])
    # H steps at the pace the fastest published: the three workers share a process, and a stall of it inflates every
    # published step for a span (a busy suite's 1.1 s stall in a span of 12 steps: the next spans 220 steps of 10 ms)
    inflated = max(1.0, max(published[0]) / measured[0])
    assert 0.3 * h_steps <= fast <= 2 * h_steps * inflated, (covered, sorted(published[0]), measured)
    # not H of its own (the round did not wait for it): fewer steps, as many fewer as its steps were slower (idle ~4×;
    # a loaded machine adds the same cost to every step and narrows that)
    slower = measured[2] / measured[0]
    assert slower > 1.2 and slow < fast / (0.6 * slower), (covered, measured)
    seconds = [d.engine.pace.slot_seconds for d in ds]  # every worker's span: H/P steps of the fastest
    assert max(seconds) < 2 * min(seconds), seconds
    # The slowest worker's last span: H/P steps at a step time one of the faster workers published (the fastest it
    # read in their records), not at its own. Not necessarily the one published last: on a loaded machine the fastest
    # worker's published step moved 1.7x after the slowest one's last plan (0.018 s against a span of 0.364 s).
    faster = sorted(published[0] | published[1])
    assert any(seconds[2] == pytest.approx(h_steps / fragments * step, rel=1e-3) for step in faster), (seconds, faster)


def _train_unequal(rounds: int, *, streaming: StreamingConfig | None = None, compression: str | None = None,
                   published: dict[int, set[float]] | None = None, measured: dict[int, float] | None = None,
                   **kwargs) -> tuple[list[DiLoCo], dict[int, list[int]], dict[int, dict[str, int | None]]]:
    """Three workers in an in-process swarm whose inner steps take 10, 20 and 40 ms train `rounds` rounds by time
    (`kwargs` to `DiLoCo`): every one commits every round with three members and they end on one state. Returns
    the wrappers, the steps each worker's Δ covered, by round, and the steps per round its records showed;
    `measured` gets each worker's mean inner step as it ran, its synchronizations left out (a loaded machine adds
    the same cost to every step and narrows the 4× of the sleeps)."""
    h = Harness(PATIENT.with_round(compression=compression) if compression else PATIENT)  # every round must commit
    base, delays = _mlp(7), [0.01, 0.02, 0.04]
    start = threading.Barrier(3, timeout=10)
    covered: dict[int, list[int]] = {i: [] for i in range(3)}
    out: dict[int, DiLoCo] = {}
    shown: dict[int, dict[str, int | None]] = {}

    def peer(i: int):
        def run() -> None:
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            data = _batches(30 + i, 64)
            with DiLoCo(model, opt, swarm=h.swarm(f"w{i}"), streaming=streaming, **kwargs,
                        on_round=lambda r: covered[i].append(d.member.standing.covered)) as d:
                start.wait()
                k, deadline, stepping = 0, time.monotonic() + 60, 0.0
                # not one round more: with τ a stall longer than a span (a busy machine's) brings the next slot
                # before the last round applied, which launched round rounds + 1 among the faster workers only
                while d.round + d.pending_rounds < rounds and time.monotonic() < deadline:
                    began = time.monotonic()
                    x, y = data[k % len(data)]
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    time.sleep(delays[i])  # a slower machine
                    stepping += time.monotonic() - began
                    opt.step()
                    opt.zero_grad()
                    k += 1
                    if published is not None and d.engine.pace.published is not None:
                        published[i].add(d.engine.pace.published)  # each lasts a span: every value is seen
                d.flush()  # the last round, launched at the last slot
                if measured is not None:
                    measured[i] = stepping / max(1, k)
                shown[i] = {r.peer: r.round_steps for r in d.swarm.records()}  # what `diloco status` shows
            out[i] = d
        return run

    try:
        _run_threads([peer(i) for i in range(3)], [start])
    finally:
        h.close()
    ds = [out[i] for i in range(3)]
    assert {d.round for d in ds} == {rounds}, [d.round for d in ds]
    assert len({d.digest for d in ds}) == 1
    for d in ds:
        assert [(r.round, r.committed, r.peers) for r in d.reports] == [(k + 1, True, 3) for k in range(rounds)]
        assert [r.fragment for r in d.reports] == [k % len(d.fragments) for k in range(rounds)]
    return ds, covered, shown


def test_rounds_by_time_refuse_what_they_do_not_support_yet():
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="positive number of seconds"):
        DiLoCo(model, opt, swarm=None, round_seconds=0)
    with pytest.raises(ConfigError, match="outer_overlap"):
        DiLoCo(model, opt, swarm=None, round_seconds=1.0, streaming=StreamingConfig(outer_overlap="eager"))
    with pytest.raises(ConfigError, match="h_schedule"):
        DiLoCo(model, opt, swarm=None, round_seconds=1.0, h_schedule=((2, 10),))
    # H needs no multiple of P by time: the slots count seconds
    DiLoCo(model, opt, swarm=None, round_seconds=1.0, inner_steps=99, streaming=StreamingConfig(fragments=2))
    with pytest.raises(ConfigError, match="give one"):
        DiLoCo(model, opt, swarm=None, round_seconds=1.0, adaptive=True)
    with pytest.raises(ConfigError, match=r"adaptive \(--adaptive\) does not work with outer_overlap"):
        DiLoCo(model, opt, swarm=None, adaptive=True, streaming=StreamingConfig(outer_overlap="eager"))
    with pytest.raises(ConfigError, match="multiple"):  # adaptive rounds count H steps of the fastest: H/P whole
        DiLoCo(model, opt, swarm=None, adaptive=True, inner_steps=99, streaming=StreamingConfig(fragments=2))


def test_the_command_line_refuses_rounds_by_time_with_an_h_schedule_naming_both(monkeypatch):
    """`diloco start --round-seconds 30 --h-schedule 4:10`: exit 2 before any peer starts, naming the options."""
    from cli_util import invoke, refuse_to_start
    refuse_to_start(monkeypatch, "diloco.cli.main._run_peer", "diloco.cli.main._launch")
    result = invoke(["start", "--round-seconds", "30", "--h-schedule", "4:10"])
    said = "".join(result.output.replace("│", "").split())
    assert result.exit_code == 2 and "--round-seconds" in said and "--h-schedule" in said, result.output


def test_a_site_leader_plans_each_span_and_every_rank_stops_at_the_same_step():
    """Two ranks of a site, their clocks apart (rank 1's steps seem three times as long): at the second step of
    each span the leader plans its length from its own pace and the time left, and both ranks end every span at
    that step; the plan follows the leader's pace (0.5 s of training a slot at 0.1 s a step: 5 steps, the slot's own
    work not counted)."""
    leader = Pace(1.0, 2, planned=True, now=0.0)
    other = Pace(1.0, 2, planned=True, now=0.0)
    told: list[int] = []

    def tell(decide):
        told.append(decide())
        return told[-1]

    def hear(decide):
        return told[-1]

    t_leader = t_other = 0.0
    spans: list[tuple[int, int]] = []
    for span in range(4):
        steps = 0
        while True:
            t_leader += 0.1
            t_other += 0.3
            steps += 1
            due_leader, due_other = leader.due(t_leader, tell), other.due(t_other, hear)
            assert due_leader == due_other, (span, steps)
            if due_leader:
                break
        spans.append((steps, told[-1]))
        t_leader += 0.2  # the slot's own work
        t_other += 0.2
        leader.slot(t_leader)
        other.slot(t_other)
    assert [s for s, _ in spans] == [p for _, p in spans]
    assert all(s == 5 for s, _ in spans), spans


def test_an_overlapped_round_starts_the_next_span_when_its_view_closed():
    """With overlap a worker trains on from its slot while the round's gather waits for slower members: its next span
    counts from when the view closed (the same moment for every member), not from its own early slot, so it does not
    stay ahead of them round after round."""
    pace = Pace(5.0, 1, planned=False, now=0.0)
    pace.slot(10.0)  # reached its slot at 10 s and went on training (the exchange in the background)
    pace.align(14.0)  # the view closed at 14 s, once the slowest member was ready
    assert not pace.due(18.9, lambda decide: decide()) and pace.due(19.0, lambda decide: decide())
    pace.align(3.0)  # an earlier moment changes nothing
    assert pace.due(19.5, lambda decide: decide())


def test_a_wait_for_a_rounds_result_is_not_training_time():
    """τ steps after its slot a worker may wait for the round's result: neither its span nor that step's duration
    (the pace a site's leader plans with) counts the wait."""
    pace = Pace(1.0, 1, planned=True, now=0.0)
    pace.slot(0.0)
    told = []
    assert not pace.due(0.1, lambda decide: told.append(decide()) or told[-1])  # step 1: 0.1 s
    pace.pause(0.1, 0.6)  # waited half a second for the result
    assert not pace.due(0.7, lambda decide: told.append(decide()) or told[-1])  # step 2 took 0.1 s of training
    assert pace.step_seconds == pytest.approx(0.1) and told == [10]  # 0.2 s trained of 1.0: 8 more steps of 0.1 s


@pytest.mark.parametrize(("own", "others", "expected"), [
    (0.1, [], 2.0),             # alone: H of our own steps
    (0.1, [0.4, 0.05], 1.0),    # the fastest of the swarm sets the pace
    (0.4, [0.1, 0.2], 2.0),     # a slow worker trains H steps of the fastest's time, not its own
    (0.4, [0.001], 1.0),        # a claim of a machine 400x as fast counts as 8x (the weight bound): 20 * 0.05
])
def test_adaptive_seconds(own, others, expected):
    assert adaptive_seconds(20, own, others, bound=8) == pytest.approx(expected)


def test_an_adaptive_pace_follows_the_fastest_step_time_the_records_show():
    """A lone worker at 0.4 s a step, H = 10: before anyone else's step time is known its span is H of its own steps
    (4 s; its first step, with 0.1 s of set-up, is not timed); once a record shows 0.1 s a step, 1 s; the records
    change between its steps, its span follows."""
    others: list[float] = []
    pace = Pace(None, 1, planned=False, now=0.0, adaptive_steps=10, others=lambda: others, bound=8)
    told = lambda decide: decide()  # noqa: E731
    pace.restart(0.0)  # training begins (the engine's `restart_clock` at attach)
    assert not pace.due(0.5, told) and pace.step_seconds is None  # the first step holds the set-up: not timed
    assert not pace.due(0.9, told) and pace.slot_seconds == pytest.approx(4.0)
    others.append(0.1)
    assert pace.due(1.3, told) and pace.slot_seconds == pytest.approx(1.0)  # 1.3 s since the span began
    with pytest.raises(ValueError, match="one of them"):
        Pace(1.0, 1, planned=False, now=0.0, adaptive_steps=10)


def test_the_fastest_worker_paces_an_adaptive_span_by_the_step_time_its_record_shows():
    """The fastest worker's steps drift from 0.1 s to 0.12 s within a round; the others read 0.1 s in its record until
    its next slot. It counts its own span from that same 0.1 s, not from its live average, so every worker's span is
    H × 0.1 s and they reach the slot together."""
    pace = Pace(None, 1, planned=False, now=0.0, adaptive_steps=10, others=lambda: [0.4], bound=8)
    told = lambda decide: decide()  # noqa: E731
    pace.restart(0.0)
    pace.published = 0.1  # what the engine published at the last slot
    t = 0.0
    for _ in range(5):
        t += 0.12
        pace.due(t, told)
    assert pace.step_seconds > 0.11 and pace.slot_seconds == pytest.approx(1.0)


def test_a_worker_publishes_its_spans_mean_step_not_one_held_up_step():
    """A span of 20 steps of 0.1 s whose last step the scheduler held up for a second: the moving average jumps to
    0.28 s and the span's plain mean to 0.145 s, but the step time a worker publishes (which sizes every worker's next
    adaptive span) is the mean of the span's steps but the slowest, 0.1 s; a pace that is slow every other step
    still counts; the next span starts afresh at the slot, and a wait for a round's result is not a step's time."""
    pace = Pace(None, 1, planned=False, now=0.0, adaptive_steps=20)
    told = lambda decide: decide()  # noqa: E731
    assert not pace.due(0.5, told) and pace.span_step_seconds is None  # the first step (set-up) is not timed
    t = 0.5
    for _ in range(19):
        t += 0.1
        pace.due(t, told)
    t += 1.0
    pace.due(t, told)
    assert pace.step_seconds == pytest.approx(0.28) and pace.span_step_seconds == pytest.approx(0.1)
    pace.slot(t)
    assert pace.span_step_seconds is None
    pace.pause(t, t + 5.0)
    t += 5.2
    pace.due(t, told)
    assert pace.span_step_seconds == pytest.approx(0.2)
    for took in (0.1, 0.3):  # three timed steps: too few to leave one out
        t += took
        pace.due(t, told)
    assert pace.span_step_seconds == pytest.approx(0.2)
    for took in (0.1, 0.3, 0.1, 0.3):  # slow every other step: the slowest one out of seven, the pace kept
        t += took
        pace.due(t, told)
    assert pace.span_step_seconds == pytest.approx((1.4 - 0.3) / 6)


def test_a_sites_leader_plans_an_adaptive_span_from_the_fastest_step_time():
    """A site at 0.3 s a step, H = 20 over 2 fragments, the swarm's fastest at 0.1 s: the leader plans 1 s of
    training a slot (10 steps of the fastest, not 10 of its own): 2 steps taken in 0.6 s, 0.4 s left, one more step,
    3 in all (every rank takes the count)."""
    leader = Pace(None, 2, planned=True, now=0.0, adaptive_steps=20, others=lambda: [0.1], bound=8)
    leader.restart(0.0)
    told: list[int] = []
    tell = lambda decide: told.append(decide()) or told[-1]  # noqa: E731
    t, steps = 0.0, 0
    while True:
        t += 0.3
        steps += 1
        if leader.due(t, tell):
            break
    assert leader.slot_seconds == pytest.approx(1.0) and told == [3] and steps == 3


@pytest.mark.parametrize(("taken", "elapsed", "step", "expected"), [
    (2, 0.2, 0.1, 10),  # 0.8 s left at 0.1 s a step
    (2, 1.5, 0.1, 2),   # the time is up: the slot comes now
    (2, 0.2, 0.0, 2),   # no pace known: now
    (2, 0.2, 0.3, 5),   # 0.8 / 0.3 = 2.7 more
])
def test_planned_steps(taken, elapsed, step, expected):
    assert planned_steps(taken, elapsed, 1.0, step) == expected
