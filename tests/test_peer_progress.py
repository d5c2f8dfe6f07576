"""What `diloco start` / `diloco join` show while they train: a line per round off a terminal (not per
step), flushed as it happens, on stderr; the results stay on stdout."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from diloco.progress import Reporter
from diloco.job.train import JobConfig, round_status, run_job

TINY = JobConfig(rounds=3, inner_steps=4, d_model=16, n_layer=1, batch_size=2, eval_batches=1, corpus_bytes=1 << 20)


@pytest.mark.unit
def test_round_status_says_round_loss_bandwidth_peers_and_bytes_or_why_it_failed():
    assert round_status(6, 10, 2, 0, True, "", 4, 2.3456, 4_200_000, 4_100_000, 106_250.0) == \
        "round 3/10 (fragment 0), loss 2.346, 0.85 Mbit/s, 4 peers, sent 4.2 MB, recv 4.1 MB"
    assert round_status(3, 10, 1, 0, False, "no quorum: 1 of 3", 1, None, 0, 0, 0.0) == \
        "round 3/10, not committed: no quorum: 1 of 3"


@pytest.mark.swarm
def test_a_job_makes_one_progress_line_per_round_not_per_step():
    out = io.StringIO()
    with Reporter("lines", stream=out) as rep, rep.task("training", TINY.rounds, unit="rounds") as task:
        run_job(TINY, None, progress=task.update)
    lines = out.getvalue().splitlines()
    assert [ln.split(",")[0] for ln in lines[:-1]] == ["training: round 1/3", "training: round 2/3",
                                                       "training: round 3/3"]
    assert "3/3 rounds (100%)" in lines[-2] and lines[-1].startswith("training: done in")


@pytest.mark.multiproc
def test_start_prints_a_flushed_line_per_round_on_stderr(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "diloco", "start", "--run-id", "progress", "--rounds", "2", "-H", "2",
                           "--d-model", "16", "--layers", "1", "--batch-size", "2"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rounds = [ln for ln in proc.stderr.splitlines() if ln.startswith("training: round")]
    assert [ln.split(",")[0] for ln in rounds] == ["training: round 1/2", "training: round 2/2"], proc.stderr
    assert "training:" not in proc.stdout and "done: round 2" in proc.stdout
