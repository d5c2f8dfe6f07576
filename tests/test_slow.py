"""Long runs, excluded from `make test`; run with `make test-slow`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.mark.timeout(900)
def test_default_demo_end_to_end(tmp_path):
    """`diloco demo` with its defaults (4 peers, 8 rounds, e3m0): every peer finishes with the same
    global state, the model learned (docs/BENCHMARKS.md: 2.1329), and bytes match the protocol."""
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "diloco", "demo", "--no-live", "--workdir", str(tmp_path / "run"),
                           "--json", str(summary_path)], capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(summary_path.read_text())
    assert s["ok"] and s["peers_finished"] == 4 and s["rounds"] == 8 and s["digests_agree"]
    assert s["heldout_loss"] < 2.3  # from 5.545 untrained; measured 2.1329
    assert s["bits_per_param_sync"] == pytest.approx(4.0, abs=0.01)
    # 2·(N−1)/N × 0.5 bytes × params per peer per round, 32 peer-rounds, plus small frame headers
    expected = 32 * 1.5 * 0.5 * s["params"]
    assert expected <= s["bytes_sent_total"] < 1.01 * expected
