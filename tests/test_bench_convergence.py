"""B1 `diloco bench convergence` on a tiny budget: the rows, the baseline's byte count, the gaps."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from diloco.bench_convergence import SPARSE, Variant, markdown_table, plots, run
from diloco.progress import Reporter
from diloco.train import JobConfig

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
        # the rounds' bytes so far; the total also counts what moved outside rounds (~150 bytes here)
        assert 0.9 * r["bytes_sent"] <= r["curve"][-1]["bytes_sent"] <= r["bytes_sent"]
    # fp32: every round moves the same payload; replies differ by a few dozen bytes with who reached the
    # round first (a ready answered before or after the answerer's own gather began names its peers or not)
    assert plain["curve"][1]["bytes_sent"] == pytest.approx(2 * plain["curve"][0]["bytes_sent"], abs=400)
    written = plots(rows, tmp_path, tokens_per_step=2 * 4 * job.context)
    assert [p.name for p in written] == ["b1-loss-vs-tokens.png", "b1-loss-vs-bytes.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_cli_wants_a_budget_that_both_h_divide():
    out = subprocess.run([sys.executable, "-m", "diloco", "bench", "convergence", "--steps", "150"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "multiple of 100" in out.stderr, out.stderr
