"""B1 `diloco bench convergence` on a tiny budget: the rows, the baseline's byte count, the gaps."""

from __future__ import annotations

import io

import pytest

from cli_util import invoke, refuse_to_start

from diloco.bench.convergence import NAMED, SPARSE, Variant, markdown_table, parse_variant, plots, run
from diloco.progress import Reporter
from diloco.job.train import JobConfig

pytestmark = pytest.mark.swarm


def test_variants_against_data_parallel_on_equal_tokens(tmp_path):
    job = JobConfig(d_model=32, n_layer=2, batch_size=4, eval_batches=2, corpus_bytes=1 << 20)
    out = io.StringIO()
    with Reporter("lines", stream=out) as rep:
        rows = run(job, 2, 8, (Variant("plain", 4), Variant("sparse", 8, SPARSE)), curves=True, reporter=rep)
    # progress: the whole benchmark and each variant, in inner steps of all workers (2 × 8 a variant)
    shown = out.getvalue().splitlines()
    assert shown[0].startswith("convergence: variant 1/3: data-parallel - 2/48 steps (4%)")  # after its first step
    assert [ln for ln in shown if ": done in" in ln and ln.startswith("[")] and \
        [ln.split(":")[0] for ln in shown if ": done in" in ln] == ["[1/3] data-parallel", "[2/3] plain",
                                                                   "[3/3] sparse", "convergence"]
    dp, plain, sparse = rows
    assert [r["variant"] for r in rows] == ["data-parallel", "plain", "sparse"]
    # ring all-reduce of fp32 gradients every step: 2·(M−1)/M · 4 bytes per parameter per worker
    assert dp["bytes_sent"] == 2 * (2 - 1) / 2 * 4 * dp["params"] * 8 * 2
    assert dp["eval_loss"] < 5.5 and dp["loss_gap"] == 0  # it trained (untrained: ln 256 ≈ 5.55)
    assert (plain["syncs"], sparse["syncs"]) == (2, 1)
    assert plain["bits_per_param_sync"] == 32.0 and sparse["bits_per_param_sync"] < 0.25
    for r in (plain, sparse):
        assert len(r["digests"]) == 1
        assert r["loss_gap"] == pytest.approx(r["eval_loss"] / dp["eval_loss"] - 1)
        assert r["bytes_ratio"] == pytest.approx(dp["bytes_sent"] / r["bytes_sent"]) and r["bytes_ratio"] > 1
        assert 0 < r["projected_utilization"] <= 1
    table = markdown_table(rows)
    assert table.count("\n") == 4 and "| sparse |" in table
    # curves: the held-out loss after every round (the last one is the final loss), bytes so far
    assert [c["step"] for c in plain["curve"]] == [4, 8] and [c["step"] for c in sparse["curve"]] == [8]
    for r in rows:
        assert r["curve"][-1]["eval_loss"] == pytest.approx(r["eval_loss"])
        # the rounds' bytes so far; the total also counts what moved outside a round's span: the decide's votes
        # still on their way when a worker committed (`Collective.settle`), a few hundred bytes per worker and
        # round here (515-666 measured), whichever worker reached the quorum first; a round's payload is more
        # (sparse: ~2.3 KB a worker, fp32: ~300 KB), so a round missing from the curve fails this
        outside = r["bytes_sent"] - r["curve"][-1]["bytes_sent"]
        assert 0 <= outside <= 1024 * 2 * r["syncs"] if r is not dp else outside == 0
    # fp32: every round moves the same payload (~300 KB a worker); the control bytes around it differ by a few
    # hundred with who reached the round and its quorum first (a ready answered before or after the answerer's own
    # gather began names its peers or not; votes on their way at commit count in no round: 0-151 measured idle)
    assert plain["curve"][1]["bytes_sent"] == pytest.approx(2 * plain["curve"][0]["bytes_sent"], abs=2 * 1024)
    written = plots(rows, tmp_path, tokens_per_worker_step=4 * job.context)
    assert [p.name for p in written] == ["b1-loss-vs-tokens.png", "b1-loss-vs-bytes.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_cli_wants_a_budget_that_every_h_divides_and_names_it_refuses(monkeypatch):
    refuse_to_start(monkeypatch, "diloco.bench.convergence.run")  # past its checks it would train for minutes
    out = invoke(["bench", "convergence", "--steps", "150"])
    assert out.exit_code == 2 and "multiple of H=100 (DiLoCo H=100)" in out.stderr, (out.output, out.exception)
    out = invoke(["bench", "convergence", "--variant", "h50,outer=1"])
    assert out.exit_code == 2 and "write KNOB=VALUE with KNOB one of H," in out.stderr, (out.output, out.exception)


def test_variants_by_name_with_knobs_changed():
    assert parse_variant("h50") == NAMED["h50"]
    v = parse_variant("h100,H=20,outer_lr=0.5,outer_momentum=0.8,outer_warmup=10,lr=0.004")
    assert (v.name, v.inner_steps, v.outer_lr, v.outer_momentum, v.outer_warmup, v.lr) == \
        ("DiLoCo H=20 (outer_lr=0.5, outer_momentum=0.8, outer_warmup=10, lr=0.004)", 20, 0.5, 0.8, 10, 0.004)
    assert parse_variant("sparse,H=20").name == "Sparse top-k 1.6%, 2-bit, EF (H=20)"  # no H in its name to change
    for bad, said in (("dp", "unknown variant 'dp'"), ("h50,H=x", "'x' is not a int"), ("h50,beta=1", "KNOB=VALUE")):
        with pytest.raises(ValueError, match=said):
            parse_variant(bad)


def test_data_parallel_is_tuned_over_its_lrs_and_gaps_are_to_the_best(tmp_path):
    job = JobConfig(d_model=32, n_layer=2, batch_size=4, eval_batches=2, corpus_bytes=1 << 20, context=32,
                    schedule="cosine", warmup=2)
    rows = run(job, 2, 8, (Variant("plain", 4, outer_lr=0.5, outer_momentum=0.0, lr=1e-3),), dp_lrs=(1e-4, 3e-3),
               reporter=Reporter("quiet"))
    slow, fast, plain = rows
    assert [r["variant"] for r in rows] == ["data-parallel lr=0.0001", "data-parallel lr=0.003", "plain"]
    assert [r["workers"] for r in rows] == [2, 2, 2] and [r["lr"] for r in rows] == [1e-4, 3e-3, 1e-3]
    assert fast["eval_loss"] < slow["eval_loss"]  # 30x the lr over 8 steps: not a close call
    assert (slow["baseline"], fast["baseline"], plain["baseline"]) == (False, True, False)
    assert fast["loss_gap"] == 0 and slow["loss_gap"] > 0
    assert plain["loss_gap"] == pytest.approx(plain["eval_loss"] / fast["eval_loss"] - 1)
    table = markdown_table(rows)
    assert "| 2 | data-parallel lr=0.003 (tuned) |" in table and "| 2 | data-parallel lr=0.0001 |" in table


def test_an_h_schedule_and_a_warm_start_are_knobs_that_fit_the_budget():
    v = parse_variant("h50,h_schedule=80:10+90:5,warm_start=500")
    assert (v.h_schedule, v.warm_start) == (((80, 10), (90, 5)), 500)
    assert v.rounds(80 * 50 + 10 * 10 + 5 * 5) == 95  # 80 outer steps of 50, 10 of 10, then 5 of 5
    with pytest.raises(ValueError, match="counting each H of its schedule"):
        v.rounds(80 * 50 + 7)
    with pytest.raises(ValueError, match="ROUNDS:H"):
        parse_variant("h50,h_schedule=80")


def test_a_warm_start_trains_data_parallel_first_then_diloco_from_its_weights(tmp_path):
    job = JobConfig(d_model=32, n_layer=2, batch_size=4, eval_batches=2, corpus_bytes=1 << 20, context=32, warmup=2)
    dp, warm, cold = run(job, 2, 8, (Variant("warm", 2, warm_start=4), Variant("cold", 2)), curves=True,
                         reporter=Reporter("quiet"))
    # 4 data-parallel steps (their bytes: a ring all-reduce each), then 2 rounds of H=2 from their weights
    assert warm["syncs"] == 4 + 2 and warm["bytes_sent"] > dp["bytes_sent"] / 2
    assert [c["step"] for c in warm["curve"]] == [4, 6, 8] and len(warm["digests"]) == 1
    assert warm["curve"][0]["bytes_sent"] == dp["bytes_sent"] / 2  # half of data-parallel's 8 steps
    assert warm["curve"][-1]["eval_loss"] == pytest.approx(warm["eval_loss"])
    assert warm["eval_loss"] != cold["eval_loss"]
    assert warm["projected_utilization"] is None and 0 < cold["projected_utilization"] <= 1  # no rounds to project


def test_data_parallel_only_extends_an_lr_sweep_without_running_a_variant():
    from typer.testing import CliRunner

    from diloco.cli.main import app

    out = CliRunner().invoke(app, ["bench", "convergence", "--data-parallel-only", "--workers", "1", "--steps", "4",
                                   "--d-model", "32", "--layers", "1", "--context", "32", "--dp-lr", "1e-3", "--dp-lr",
                                   "2e-3", "-q"])
    assert out.exit_code == 0, out.output
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("| 1 |")]
    assert [r.split("|")[2].strip().removesuffix(" (tuned)") for r in rows] == ["data-parallel lr=0.001",
                                                                              "data-parallel lr=0.002"]
