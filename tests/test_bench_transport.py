"""`diloco bench transport` (B3): the plain-TCP baseline moves every byte, and the benchmark's rounds are
those of real peers (two `diloco start/join` processes with their daemons) with the bytes a round moves."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from cli_util import invoke, refuse_to_start

from diloco.bench.transport import TransportSetup, daemons_across, loopback, markdown, peer_flags, tcp_copy
from diloco.peers.reaper import tagged


@pytest.mark.parametrize("peers", [2, 3, 5])
def test_the_plain_tcp_copy_moves_every_share_between_every_pair(peers):
    assert tcp_copy(peers, 3_000_001) > 0  # raises if a byte is missing
    with pytest.raises(ValueError, match="peers must be >= 2"):
        tcp_copy(1, 10)


class _Loopback:
    """A stand-in for `WanLab` with every host on this machine's loopback."""

    def __init__(self, hosts: int) -> None:
        self.hosts = hosts

    def address(self, i: int) -> str:
        return "127.0.0.1"

    def popen(self, i: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(cmd, **kwargs)


@pytest.mark.timeout(120)
def test_the_daemons_baseline_sends_every_share_between_real_daemons():
    # three host processes, each with its own daemon, each sending a third of a megabyte to the two others at once
    assert 0 < daemons_across(_Loopback(3), 300_000, repeats=2) < 60


class _FailingHost(_Loopback):
    """Two hosts, the second of which exits once the first has its daemon up, leaving the names in `tmp` then (where
    the first keeps its daemon's sockets) in `tmp`/seen; every process tagged by environment."""

    def __init__(self, tmp: str) -> None:
        super().__init__(2)
        self.tmp, self.procs = tmp, []
        self.env = {**os.environ, "DILOCO_TEST_TAG": os.path.basename(tmp), "TMPDIR": tmp}

    def popen(self, i: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        if i == 1:
            ready, seen = os.path.join(cmd[4], "h0.addr"), os.path.join(self.tmp, "seen")  # daemon-host DIR ...
            cmd = [sys.executable, "-c", "import os, sys, time\n"
                   f"while not os.path.exists({ready!r}): time.sleep(0.05)\n"
                   f"open({seen!r}, 'w').write(' '.join(os.listdir({self.tmp!r})))\nsys.exit(3)"]
        self.procs.append(subprocess.Popen(cmd, env=self.env, **kwargs))
        return self.procs[-1]


@pytest.mark.timeout(120)
def test_a_failed_daemons_baseline_leaves_no_daemon_and_no_socket_behind():
    """A host that exits ends the baseline with an error naming it; the others, terminated, close their daemons."""
    tmp = tempfile.mkdtemp(prefix="dh-")  # short: a unix socket's path must fit in 108 bytes
    try:
        lab = _FailingHost(tmp)
        with pytest.raises(RuntimeError, match="host 1 exited"):
            daemons_across(lab, 1000, repeats=1)
        assert lab.procs[0].returncode == 128 + signal.SIGTERM  # the host's own close, not a death by the signal
        assert tagged("DILOCO_TEST_TAG", lab.env["DILOCO_TEST_TAG"]) == []  # no p2pd (nor host) left running
        assert any(f.startswith("hivemind-") for f in open(os.path.join(tmp, "seen")).read().split())  # sockets, then
        assert not [f for f in os.listdir(tmp) if f.startswith("hivemind-")]  # and none now
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_loopback_point_times_rounds_of_real_peers_against_plain_tcp():
    said: list[str] = []
    row = loopback(2, 0.4, TransportSetup(rounds=1, inner_steps=1), said.append)
    assert row["params"] == 100_000 and row["rounds"] >= 1
    # two peers' all-reduce: each sends half of Δ and half of the average: the model's size, plus framing
    assert 400_000 <= row["bytes_sent"] < 1.05 * 400_000, row
    assert 0 < row["tcp_s"] and 0 < row["round_s"] < 60
    assert row["of_tcp"] == pytest.approx(row["tcp_s"] / row["round_s"]) and row["daemon_s"] > 0
    assert row["paths"] == ["direct"] and row["direct_s"] > 0  # the rounds went on the data plane, measured alone too
    assert said and "2 peers" in said[0]
    phases = row["phases_s"]  # the medians of where the peers' rounds spent their time
    assert list(phases) == ["plan", "gather", "encode", "exchange", "decide"] and phases["exchange"] > 0
    assert all(t >= 0 for t in phases.values())
    table = markdown({"setup": {}, "loopback": [row], "wan": []})
    assert "| 2 | 0.4 MB |" in table and "| loopback | 2 | 0.4 MB |" in table


@pytest.mark.parametrize("args, needle", [
    (["--part", "sideways"], "--part must be loopback, wan or all"),
    (["--peers", "1"], "every --peers/--wan-peers >= 2"),
    (["--part", "wan", "--wan-peers", "1"], "every --peers/--wan-peers >= 2"),
    (["--part", "wan", "--wan-payload-mb", "0"], "every payload > 0"),
    (["--rate-mbit", "0"], "--rate-mbit must be > 0"),
    (["--data-streams", "0"], "--data-streams >= 1"),
])
def test_bad_options_exit_2_naming_the_fix(args, needle, monkeypatch):
    refuse_to_start(monkeypatch, "diloco.bench.transport.run")  # past its checks the benchmark would start peers
    done = invoke(["bench", "transport", *args], env={"COLUMNS": "200"})
    assert done.exit_code == 2 and needle in done.stderr, (done.output, done.exception)


def test_options_of_a_part_that_does_not_run_are_not_checked(monkeypatch):
    setups = []
    monkeypatch.setattr("diloco.bench.transport.run",
                        lambda setup, say: setups.append(setup) or {"setup": {}, "loopback": [], "wan": []})
    done = invoke(["bench", "transport", "--part", "loopback", "--wan-peers", "1", "--wan-payload-mb", "0",
                   "--rate-mbit", "0", "--peers", "3"])
    assert done.exit_code == 0, (done.output, done.exception)
    assert [(s.peers, s.loopback, s.wan) for s in setups] == [((3,), True, False)]


def test_the_peers_take_the_data_planes_settings_of_the_setup(monkeypatch):
    setups = []
    monkeypatch.setattr("diloco.bench.transport.run",
                        lambda setup, say: setups.append(setup) or {"setup": {}, "loopback": [], "wan": []})
    assert invoke(["bench", "transport", "--data-streams", "2"]).exit_code == 0
    flags = peer_flags(3, setups[0])
    assert flags[flags.index("--data-streams") + 1] == "2" and "--direct" in flags
    assert flags[flags.index("--wait-for") + 1] == "3"
    assert "--no-direct" in peer_flags(2, TransportSetup(direct=False))


def test_the_wan_table_sets_each_round_against_the_rate_plain_tcp_and_the_daemons():
    row = dict(peers=2, payload_bytes=20_000_000, bytes_sent=20_000_000, round_s=5.0, goodput_mbit_s=32.0,
               of_rate=0.64, tcp_s=3.6, tcp_mbit_s=44.4, tcp_of_rate=0.889, daemons_s=4.0, daemons_mbit_s=40.0,
               phases_s={"gather": 0.1, "encode": 0.0, "exchange": 4.5, "decide": 0.1})
    table = markdown({"setup": {"rate_mbit": 50.0, "delay_ms": 25.0}, "loopback": [], "wan": [row]})
    assert "| 2 | 20 MB | 20.00 MB | 5.00 s | 32.0 Mbit/s | 64.0% | 3.60 s (44.4 Mbit/s, 88.9% of the rate) | 72.0% " \
           "| 4.00 s (40.0 Mbit/s, 80.0% of the rate) | 80.0% |" in table, table
    assert "| WAN | 2 | 20 MB | 5.000 | – | 0.100 | 0.000 | 4.500 | 0.100 | 0.300 |" in table, table  # no plan phase: a row from before it
    # a baseline that failed leaves the round's figures and says so
    del row["daemons_s"], row["daemons_mbit_s"]
    table = markdown({"setup": {"rate_mbit": 50.0, "delay_ms": 25.0}, "loopback": [], "wan": [dict(row, daemons_error="x")]})
    assert "| 72.0% | failed (`daemons_error` in the JSON) | – |" in table, table
