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
    assert h4["syncs"] == [4, 4] and h8["syncs"] == [2, 2] and bare["syncs"] == [0] * 4
    for r in (h4, h8):
        assert r["mean_step_ms"] > 0 and r["sync_ms"] is not None
        assert len(r["runs"]) == len(r["bare_runs"]) == 2
        # each run's overhead is over the bare steps taken in turn with its own
        lo, hi = sorted(w / b - 1 for w, b in zip(r["runs"], r["bare_runs"]))
        assert lo - 1e-9 <= r["overhead"] <= hi + 1e-9
        assert r["beside_steps"] is not None and 0 <= r["beside_steps"] <= 16
    assert sorted(bare["runs"]) == sorted(h4["bare_runs"] + h8["bare_runs"])
    assert ticks[0] == (0, 4, "H=4") and ticks[-1] == (4, 4, "done")
    assert markdown_table(report).count("\n") == 4 and report["params"] > 0


def test_a_run_steps_both_loops_in_turns_and_marks_the_syncs_and_the_steps_beside_the_hash():
    """`_run` steps the bare and the wrapped copy alike (same batches, same seed: the bare copy's weights are those
    of plain training), flags exactly the steps that synchronized, and `_figures` splits the plain steps from the
    syncs."""
    from diloco.bench.wrapper import _figures, _run
    from diloco.job.train import load_corpus

    job = JobConfig(d_model=16, n_layer=1, batch_size=2, context=32, corpus_bytes=1 << 20)
    setup = WrapperSetup(job=job, steps=12, warmup=2)
    x = _run(setup, 3, load_corpus(job))
    assert len(x["bare"]) == len(x["wrapped"]) == len(x["synced"]) == len(x["beside"]) == 12
    # 14 steps after the warm-up's sync, the first 2 untimed: syncs at steps 3, 6, 9 and 12 (timed: 1st, 4th, 7th, 10th)
    assert x["synced"] == [k % 3 == 0 for k in range(3, 15)]
    f = _figures(x)
    assert len(f["syncs"]) == 4
    assert f["overhead"] == pytest.approx(sum(x["wrapped"]) / sum(x["bare"]) - 1)
    plain = [(b, w) for b, w, s in zip(x["bare"], x["wrapped"], x["synced"]) if not s]
    assert f["per_step"] == pytest.approx(sum(w for _, w in plain) / sum(b for b, _ in plain) - 1)


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


def test_a_sync_is_measured_against_the_bare_steps_before_it_not_its_partner_beside_the_hash():
    """The bare step taken in turn with a sync may run beside the hash that sync starts (slower): the sync's cost is
    its time less the median of the plain bare steps just before it; the steps beside the hash are counted per
    sync and compared with the quiet ones."""
    from diloco.bench.wrapper import _figures

    bare = [1.0, 1.2, 0.8, 1.0, 4.0, 2.0, 1.0, 1.0]
    wrapped = [1.0, 1.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0]
    synced = [False, False, False, False, True, False, False, False]
    beside = [False, False, False, False, True, True, False, False]
    f = _figures({"bare": bare, "wrapped": wrapped, "synced": synced, "beside": beside})
    assert f["syncs"] == [9.0 - 1.0]  # the median of 1.0, 1.2, 0.8, 1.0; not 9.0 - 4.0
    assert f["beside_steps"] == 1 and f["beside"] == pytest.approx(2.0 / 1.0 - 1)
    assert f["per_step"] == pytest.approx(7.0 / 8.0 - 1)
    first = _figures({"bare": [3.0, 1.0, 2.0], "wrapped": [5.0, 1.0, 1.0], "synced": [True, False, False],
                      "beside": [False, False, False]})
    assert first["syncs"] == [5.0 - 1.5] and first["beside_steps"] == 0  # no step before it: the ones after
    none = _figures({"bare": [1.0], "wrapped": [1.0], "synced": [False], "beside": [True]})
    assert none["syncs"] == [] and none["beside_steps"] is None


def test_the_floor_and_the_sync_are_timed_with_subnormals_flushed_as_the_loops_are(monkeypatch):
    """`run` times the sync against its floor under the same flushing as the loops (a CPU model's wrapper would
    otherwise warn that its subnormals are not flushed), and restores the caller's setting after."""
    import diloco.bench.wrapper as bench
    from diloco.wrapper import flushes_subnormals

    seen = []
    monkeypatch.setattr(bench, "sync_cost", lambda setup: seen.append(flushes_subnormals()) or {"params": 1})
    before = flushes_subnormals()
    job = JobConfig(d_model=16, n_layer=1, batch_size=2, context=32, corpus_bytes=1 << 20)
    for flush in (True, False):
        run(WrapperSetup(job=job, flush_denormal=flush), loops=False)
    assert seen == [True, False] and flushes_subnormals() == before
