"""`diloco bench transport` (B3): the plain-TCP baseline moves every byte, and the benchmark's rounds are
those of real peers (two `diloco start/join` processes with their daemons) with the bytes a round moves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diloco.bench.transport import TransportSetup, loopback, markdown, tcp_copy


@pytest.mark.parametrize("peers", [2, 3, 5])
def test_the_plain_tcp_copy_moves_every_share_between_every_pair(peers):
    assert tcp_copy(peers, 3_000_001) > 0  # raises if a byte is missing
    with pytest.raises(ValueError, match="peers must be >= 2"):
        tcp_copy(1, 10)


@pytest.mark.timeout(120)
def test_a_loopback_point_times_rounds_of_real_peers_against_plain_tcp():
    said: list[str] = []
    row = loopback(2, 0.4, TransportSetup(rounds=1, inner_steps=1), said.append)
    assert row["params"] == 100_000 and row["rounds"] >= 1
    # two peers' all-reduce: each sends half of Δ and half of the average: the model's size, plus framing
    assert 400_000 <= row["bytes_sent"] < 1.05 * 400_000, row
    assert 0 < row["tcp_s"] and 0 < row["round_s"] < 60
    assert row["of_tcp"] == pytest.approx(row["tcp_s"] / row["round_s"]) and row["daemon_s"] > 0
    assert said and "2 peers" in said[0]
    phases = row["phases_s"]  # the medians of where the peers' rounds spent their time
    assert list(phases) == ["gather", "encode", "exchange", "decide"] and phases["exchange"] > 0
    assert all(t >= 0 for t in phases.values())
    table = markdown({"setup": {}, "loopback": [row], "wan": []})
    assert "| 2 | 0.4 MB |" in table and "| loopback | 2 | 0.4 MB |" in table


@pytest.mark.parametrize("args, needle", [
    (["--part", "sideways"], "--part must be loopback, wan or all"),
    (["--peers", "1"], "every --peers/--wan-peers >= 2"),
    (["--rate-mbit", "0"], "--rate-mbit must be > 0"),
])
def test_bad_options_exit_2_naming_the_fix(args, needle):
    done = subprocess.run([sys.executable, "-m", "diloco", "bench", "transport", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 2 and needle in done.stderr, done.stderr
