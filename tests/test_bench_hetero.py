"""Workers of unequal speed (`diloco bench hetero`): the arithmetic of useful steps (pure), the setup's checks, and
the harness end to end with real throttled peers across an emulated link.

The figures live in docs/BENCHMARKS.md; the end-to-end test checks that the three variants run through real swarms
on one lab with the bench's throttle, not how fast this machine is.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from diloco.bench.hetero import (HeteroSetup, markdown_table, round_overhead_ms, run, useful_share, variants,
                                 worker_rows)
from diloco.sim.simulate import Link
from diloco.bench.lab import stop_stragglers
from diloco.job.train import throttle_seconds


def _round(steps, committed=True):
    return dict(event="round", committed=committed, round_steps=steps)


def _final(steps, wall=10.0, sync=2.0, utilization=0.8):
    return dict(event="final", usage=dict(steps=steps, wall_seconds=wall, sync_seconds=sync, utilization=utilization))


def test_a_workers_useful_steps_are_those_its_committed_rounds_covered():
    """Steps in a round the swarm went on without (not committed for this worker) are lost; a later committed round
    covers only the steps since it took the state again."""
    lines = [_round(50), _round(50, committed=False), _round(50), _final(150)]
    assert useful_share(lines) == pytest.approx(2 / 3)
    rows = worker_rows([lines, [_round(10), _round(30), _final(40, utilization=0.9)]])
    assert rows[0]["useful_utilization"] == pytest.approx(0.8 * 2 / 3) and rows[0]["steps_per_round"] == 50
    assert rows[1]["useful_share"] == 1.0 and rows[1]["steps_per_round"] == 20
    assert rows[0]["step_seconds"] == pytest.approx(8.0 / 150)


def test_a_rounds_own_time_is_its_sync_time_less_its_link_time():
    """The slowest worker's sync time a round (growth of `sync_seconds`) less what its link needed for its bytes
    (6 one-way latencies of 50 ms, 1 MB at 8 Mbit/s: 1.3 s): the median after the first round, in ms."""
    def line(sync, committed=True):
        return dict(event="round", committed=committed, sync_seconds=sync, bytes_sent=1_000_000,
                    bytes_received=900_000)
    link = Link(bandwidth_mbit=8, latency_ms=50)
    lines = [line(9.0), line(10.5), line(11.0, committed=False), line(11.9), line(13.3), _final(40)]
    # increments 1.5 (10.5 - 9.0), 1.4 (11.9 - 10.5: the failed attempt's time is in the committed one's), 1.4
    assert round_overhead_ms(lines, link) == pytest.approx(100.0)
    assert round_overhead_ms([line(1.0), _final(4)], link) is None
    assert round_overhead_ms([line(1.0), line(1.5)], link) == 0.0  # faster than the model: nothing to add


def test_the_variants_share_the_model_and_differ_in_how_a_round_ends():
    fixed, without, by_time, overlapped, adaptive = variants(HeteroSetup(rounds=6, grace=1.5, overlap=20),
                                                             round_seconds=0.75)
    assert fixed.flags[fixed.flags.index("--rounds") + 1] == "6" and "--round-seconds" not in fixed.flags
    assert float(fixed.flags[fixed.flags.index("--gather-timeout") + 1]) >= 600  # waits for the slowest
    assert without.flags[without.flags.index("--gather-timeout") + 1] == "1.5"
    assert without.flags[without.flags.index("--rounds") + 1] == "24"  # 4x as many rounds: 4x as slow at most
    assert by_time.flags[by_time.flags.index("--round-seconds") + 1] == "0.750" and "-H" not in by_time.flags
    assert overlapped.flags[overlapped.flags.index("--overlap") + 1] == "20" and "--round-seconds" in overlapped.flags
    assert "--adaptive" in adaptive.flags and adaptive.flags[adaptive.flags.index("-H") + 1] == "500"
    assert "--round-seconds" not in adaptive.flags
    assert HeteroSetup(inner_steps=500).seconds_of_a_round(0.014) == pytest.approx(7.0)  # the fastest: H steps a round
    assert HeteroSetup(round_seconds=3.0).seconds_of_a_round(0.014) == 3.0
    # fixed H waiting always runs first (the finish line); `compared` picks the others, in the bench's order
    picked = variants(HeteroSetup(compared=("adaptive", "without")), round_seconds=0.75)
    every = {v.key: v for v in variants(HeteroSetup(), round_seconds=0.75)}
    assert list(every) == ["waiting", "without", "time", "overlap", "adaptive"]
    assert picked == [every["waiting"], every["without"], every["adaptive"]]


@pytest.mark.parametrize("bad, says", [
    (dict(slowdowns=(1.0,)), "two workers"),
    (dict(slowdowns=(1.0, 0.5)), "factor >= 1"),
    (dict(slowdowns=(2.0, 1.0)), "fastest"),
    (dict(grace=0), "grace"),
    (dict(overlap=0), "overlap"),
    (dict(round_seconds=0), "round_seconds"),
    (dict(adaptive_steps=0), "adaptive_steps"),
    (dict(compared=("time", "bogus")), "among without, time, overlap, adaptive"),
    (dict(compared=("time", "time")), "distinct"),
])
def test_a_setup_that_cannot_run_is_refused_saying_why(bad, says):
    with pytest.raises(ValueError, match=says):
        HeteroSetup(**bad)


def test_the_throttle_sleeps_for_the_work_a_step_did_not_for_a_freeze():
    """`--slowdown F` sleeps (F − 1) × a step's forward and backward, at most 10× their CPU time on a CPU: a peer
    SIGSTOPped 4 s inside a step (tests/test_multiproc.py's hung peer) slept 28 s more at F = 8 and missed the
    swarm's end. Sharing the cores (a step 3× its CPU time) keeps the wall time: with the CPU time alone a 3× worker
    was ~1.3× as slow as the fast one on a busy machine (the suite's bench hetero test)."""
    assert throttle_seconds(8.0, wall=4.02, cpu=0.02) == pytest.approx(7 * 0.2)  # frozen 4 s: 10x its CPU time
    assert throttle_seconds(3.0, wall=0.03, cpu=0.01) == pytest.approx(2 * 0.03)  # sharing the cores: the wall
    assert throttle_seconds(3.0, wall=0.01, cpu=0.03) == pytest.approx(2 * 0.01)  # two torch threads: the wall
    assert throttle_seconds(3.0, wall=0.05, cpu=None) == pytest.approx(0.1)  # an accelerator: its wall time
    assert throttle_seconds(1.0, wall=0.05, cpu=0.05) == 0.0


def test_a_worker_still_running_after_the_grace_is_stopped_and_one_that_ended_is_left_alone():
    """The bench's straggler rule (`straggle_s`, used by the going-on-without variant): once the fastest worker
    ended, one still running after the grace gets SIGTERM (it ends its run as on Ctrl-C)."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = time.monotonic()
        stop_stragglers([ended, running], after=0.5)
        assert running.wait(timeout=10) == -signal.SIGTERM and ended.returncode == 0
        assert 0.4 < time.monotonic() - started < 5
    finally:
        running.kill()
        running.wait()


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_fixed_h_and_rounds_by_time_run_with_throttled_peers_across_an_emulated_link(tmp_path):
    """Two real peers, the second throttled 3×: fixed H waiting for it, then adaptive rounds (the harness is the same
    for every variant; what each variant's flags do is tested where they are built: test_round_seconds,
    test_straggler, the unit tests above). Both end on one digest (among the workers at the last round); waiting,
    the fast worker's steps a round are H; adaptive, the fast worker covers more steps a round than the throttled one
    (the slow one read the fast one's step time from its record, over the DHT: a heartbeat or two after the fast one
    published it, so the adaptive variant's rounds are long enough, H=400, for its last round to come well after
    that)."""
    # rounds by time of 0.5 s (by default H × the fast step: a few ms at this size, too short to tell the workers apart)
    setup = HeteroSetup(slowdowns=(1.0, 3.0), rate_mbit=50.0, delay_ms=5.0, inner_steps=8, rounds=2, grace=1.0,
                        overlap=1, round_seconds=0.5, adaptive_steps=400, d_model=32, layers=1, context=32,
                        batch_size=2, warmup=2, compared=("adaptive",),
                        timeout_s=150, straggle_s=5)
    lines: list[str] = []
    report = run(setup, workdir=tmp_path, progress=lines.append, measure=False)
    fixed, adaptive = report["results"]
    assert all(r["digests_agree"] for r in report["results"]), report["results"]
    assert fixed["rounds"] == 2 and [w["steps_per_round"] for w in fixed["workers"]] == [8.0, 8.0]
    assert adaptive["rounds"] == 6
    # (the throttle multiplies compute; at this size the rest of a step is not); adaptive, the last round: not H of its
    # own but H of the fast one's steps (the message shows each round's steps and the step times, for a failure). A
    # span lasts H steps at the pace the fast one published, the mean of its last span: on a loaded machine one span
    # at a third of the speed makes the next three times as long (a busy suite's slow worker: 114, 92, 187, 377, 49,
    # 489 steps, the fast one 1,274 in the last), so "fewer than H" is asked of the slow one's fewest of three rounds
    fast, slow = adaptive["workers"]
    assert fast["steps_each_round"][-1] > 1.25 * slow["steps_each_round"][-1], adaptive["workers"]
    assert min(slow["steps_each_round"][-3:]) < 0.8 * 400, adaptive["workers"]
    assert report["round_overhead_ms"] is not None and report["round_overhead_ms"] >= 0
    assert report["round_seconds"] == 0.5 and [s["target"] for s in report["standings"]] == [fixed["eval_loss"]] * 2
    text = markdown_table(report)
    assert "adaptive (H=400" in text and "worker 1 (3×)" in text and "2 hosts in network namespaces" in lines[0]
