"""`diloco bench size` end to end at a small size: two real peers (`diloco start`/`join` processes with
their daemons) run a round of a 1M-parameter model and the report carries the round time, the bytes a
peer sent (one fp32 Δ of the model, plus the round's messages) and the peak memory beyond the model.
The catch-up half needs root and network namespaces; its machinery is diloco.bench.wan's (tests/test_wan.py)
and the download's is tests/test_statesync.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_util import invoke, refuse_to_start


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_small_size_reports_round_time_bytes_and_memory(tmp_path):
    out = tmp_path / "size.json"
    proc = subprocess.run([sys.executable, "-m", "diloco", "bench", "size", "--sizes", "1M", "--codec", "fp32",
                           "--rounds", "1", "--part", "rounds", "--json", str(out)],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rounds"]
    assert row["params"] == 1_000_000 and row["codec"] == "fp32" and row["rounds_together"] == 1
    assert 0 < row["round_s_median"] < 60
    assert 4_000_000 <= row["bytes_sent_per_round"] < 4_100_000  # fp32 Δ of 1M values, then messages
    assert row["peak_extra_bytes"] > 8 * 1_000_000  # at least the global copy and the outer momentum
    assert row["daemon_peak_bytes"] > 0
    assert "| 1M | fp32 |" in proc.stdout


@pytest.mark.unit
def test_bad_sizes_are_refused_naming_the_format(monkeypatch):
    refuse_to_start(monkeypatch, "diloco.bench.size.run")  # past its checks the benchmark would start peers
    out = invoke(["bench", "size", "--sizes", "lots"])
    assert out.exit_code == 2 and "10M" in out.stderr, (out.output, out.exception)
