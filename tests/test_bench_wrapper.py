"""B5 `diloco bench wrapper` at a tiny size (the real run: docs/BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from diloco.bench.wrapper import WrapperSetup, markdown_table, run, sync_cost, sync_table
from diloco.job.train import JobConfig

pytestmark = pytest.mark.swarm  # in-process training runs, a few seconds


def test_the_wrapper_benchmark_times_bare_and_wrapped_runs_and_finds_the_syncs():
    """The rows, the syncs it counted, the overhead of each against the bare loop."""
    job = JobConfig(d_model=16, n_layer=1, batch_size=2, context=32, corpus_bytes=1 << 20)
    ticks = []
    report = run(WrapperSetup(job=job, inner_steps=(4, 8), steps=16, warmup=4, repeats=2),
                 tick=lambda done, total, status: ticks.append((done, total, status)))
    bare, h4, h8 = report["rows"]
    assert [r["kind"] for r in report["rows"]] == ["bare", "DiLoCo H=4", "DiLoCo H=8"]
    # 20 steps a run, the first 4 untimed: syncs after steps 4, 8, ... (timed: 8, 12, 16, 20 / 8, 16)
    assert h4["syncs"] == [4, 4] and h8["syncs"] == [2, 2] and bare["syncs"] == [0, 0]
    for r in (h4, h8):
        assert r["mean_step_ms"] > 0 and r["sync_ms"] is not None
        assert r["overhead"] == pytest.approx(r["mean_step_ms"] / bare["mean_step_ms"] - 1)
        assert len(r["runs"]) == 2
    assert ticks[0] == (0, 6, "bare") and ticks[-1] == (6, 6, "done")
    assert markdown_table(report).count("\n") == 4 and report["params"] > 0


def test_the_sync_is_timed_on_the_training_thread_against_its_floor_in_the_same_process():
    """At a tiny size: every round after the first is timed, the floor and the sync are positive, and the ratio
    is theirs (the figure at 85M: docs/BENCHMARKS.md, B5)."""
    job = JobConfig(d_model=32, n_layer=2, batch_size=2, context=32, corpus_bytes=1 << 20)
    cost = sync_cost(WrapperSetup(job=job), inner_steps=4, syncs=3)
    assert cost["syncs"] == 3 and cost["params"] > 0 and cost["floor_ms"] > 0 and cost["plain_step_ms"] > 0
    assert cost["ratio"] == pytest.approx(cost["sync_ms"] / cost["floor_ms"])
    assert cost["round_ratio"] == pytest.approx(cost["round_extra_ms"] / cost["floor_ms"])
    assert sync_table(cost).count("\n") == 2


def test_a_checkpoint_due_is_timed_beside_training_against_the_same_checkpoint_on_the_training_thread():
    """At a tiny size: the syncs that make a checkpoint due are timed, and the same checkpoint written by
    save_checkpoint (the figures at 85M: docs/BENCHMARKS.md, B5)."""
    from diloco.bench.wrapper import checkpoint_cost, checkpoint_table

    job = JobConfig(d_model=32, n_layer=2, batch_size=2, context=32, corpus_bytes=1 << 20)
    cost = checkpoint_cost(WrapperSetup(job=job, checkpoints=True), inner_steps=4, syncs=2)
    assert cost["syncs"] == 2 and cost["save_ms"] > 0
    assert checkpoint_table(cost).count("\n") == 2
