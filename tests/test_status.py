"""`diloco status ADDR`: a real peer, observed from another process; and the pure row builder."""

from __future__ import annotations

import json
import logging
import os
import pty
import secrets
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
import time

import pytest
from cli_util import invoke
from multiproc_util import BACKGROUND, Peers

from diloco.peers import PeerRecord
from diloco.cli import statusview
from diloco.cli.status import Tracker, rates, summarize
from diloco.comms.faults import CLOCK_STEP_FILE


def test_rows_rate_age_and_order():
    a0 = PeerRecord(peer="a", status="training", round=3, step=100, beat=1000.0, bytes_sent=1000, bytes_received=500)
    a1 = PeerRecord(peer="a", status="training", round=3, step=110, beat=1002.0, bytes_sent=3000, bytes_received=1500)
    b0 = PeerRecord(peer="b", status="joining", round=0, step=0)
    b1 = PeerRecord(peer="b", status="joining", round=0, step=4)
    c1 = PeerRecord(peer="c", status="training", round=4, step=7, beat=1002.0)
    rows = summarize([a0, b0], [b1, a1, c1], interval=4.0, now=1003.0)
    assert [r.record.peer for r in rows] == ["c", "a", "b"]  # training first, newest round first
    a = rows[1]  # rates over the time between its two heartbeats (2 s), not between our reads (4 s)
    assert a.steps_per_second == pytest.approx(5.0) and a.bytes_per_second == pytest.approx(1500.0)
    assert a.heartbeat_age == pytest.approx(1.0)
    assert rows[0].steps_per_second is None and rows[0].bytes_per_second is None  # not seen in the first read
    assert rows[2].heartbeat_age is None and rows[2].steps_per_second == pytest.approx(1.0)  # no beat: our interval
    assert rows[2].bytes_per_second is None  # an older peer publishes no byte counters


def test_rates_of_a_restarted_peer_are_unknown_not_negative():
    before = PeerRecord(peer="a", status="training", round=3, step=500, beat=10.0, bytes_sent=9000)
    after = PeerRecord(peer="a", status="training", round=3, step=20, beat=12.0, bytes_sent=100)
    assert rates(before, after, 2.0) == (None, None)


def test_watch_rates_stand_until_the_next_heartbeat():
    """Reads come faster than heartbeats: a read that finds the same record keeps the last rates."""
    t = Tracker()
    rec = lambda beat, step, sent: PeerRecord(peer="a", status="training", round=1, step=step, beat=beat,  # noqa: E731
                                              bytes_sent=sent, bytes_received=sent, utilization=0.9)
    (first,) = t.rows([rec(100.0, 10, 1000)], interval=0.5, now=100.2)
    assert (first.steps_per_second, first.bytes_per_second) == (None, None)
    (second,) = t.rows([rec(101.0, 20, 2000)], interval=0.5, now=101.1)
    assert (second.steps_per_second, second.bytes_per_second) == (10.0, 2000.0)
    (same,) = t.rows([rec(101.0, 20, 2000)], interval=0.5, now=101.6)
    assert (same.steps_per_second, same.bytes_per_second) == (10.0, 2000.0)
    assert same.heartbeat_age == pytest.approx(0.6)
    (third,) = t.rows([rec(103.0, 24, 2000)], interval=0.5, now=103.1)
    assert (third.steps_per_second, third.bytes_per_second) == (2.0, 0.0)


def test_plain_lines_and_json_show_every_column():
    row = summarize([], [PeerRecord(peer="12D3KooWx", status="training", round=2, step=40, loss=2.5, beat=99.0,
                                    bytes_sent=2_000_000, bytes_received=1_000_000, utilization=0.875,
                                    round_steps=37, step_seconds=0.0125)], 1.0, 100.0)[0]
    head, line = statusview.lines([row], "r", 100.0)
    assert "swarm 'r': 1 training" in head
    assert all(f"{k} " in line for k in statusview.COLUMNS)
    assert "util 87.5%" in line and "sent 2.0 MB" in line and "loss 2.500" in line
    assert "steps/round 37" in line  # what its last Δ covered: its weight with rounds by time
    assert "ms/step 12.5" in line  # its published step time: adaptive rounds read it
    parsed = json.loads(statusview.json_line([row], 100.0))
    assert parsed["peers"][0]["utilization"] == 0.875 and parsed["peers"][0]["bytes_sent"] == 2_000_000
    assert parsed["peers"][0]["round_steps"] == 37


def _refreshes(proc: subprocess.Popen, until, timeout: float) -> list[str]:
    """Lines `proc` prints until `until(lines)` holds (or `timeout` passes: an assertion error)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while not until(lines):
        assert time.monotonic() < deadline and proc.poll() is None, (proc.poll(), lines[-20:])
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line:
                lines.append(line.rstrip("\n"))
    return lines


def _ctrl_c(proc: subprocess.Popen) -> int:
    """Ctrl-C `proc` and return its exit status; one that is still running 30 s later fails the test with every
    thread's stack (`diloco` dumps them on SIGUSR1) and what it wrote to stderr."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        masks = _signal_masks(proc.pid)  # is SIGINT (bit 2, 0x2) pending, blocked, ignored or caught?
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"still running 30 s after Ctrl-C ({masks}); its stderr:\n{_stderr(proc)}") from None


def _signal_masks(pid: int) -> str:
    """The signal lines of /proc/PID/status (hex masks; SIGINT is 0x2): what became of a signal the process did not
    act on."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as e:
        return f"no /proc status: {e}"
    return ", ".join(line.replace("\t", " ") for line in lines if line.startswith(("SigPnd", "ShdPnd", "SigBlk",
                                                                                 "SigIgn", "SigCgt")))


def _stderr(proc: subprocess.Popen) -> str:
    """What `proc` wrote to stderr: a file (`_popen`), never a pipe, so a chatty process can never block on it."""
    err = proc.stderr_file  # type: ignore[attr-defined]
    err.seek(0)
    return err.read().decode(errors="replace")


def _popen(args: list[str], **kw) -> subprocess.Popen:
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(args, stderr=err, **kw)
    proc.stderr_file = err  # type: ignore[attr-defined]
    return proc


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_status_and_watch_show_each_peers_round_loss_bandwidth_and_utilization(tmp_path, monkeypatch):
    """Two real peers train; `diloco status ADDR --watch` follows them: every refresh has both peers, their
    rounds advance between refreshes, their bandwidth and utilization are measured, and Ctrl-C ends it
    with status 0: as JSON lines, as plain lines into a pipe, and as a live table on a terminal. One read
    (`diloco status ADDR --json`) lists both; a dead address, a stranger's secret, another run id and no secret
    at all are each refused with what to check (these run the real command in this process: `cli_util.invoke`).
    The first peer also logs to TensorBoard and W&B (`diloco start --tensorboard --wandb`, WANDB_MODE=offline)."""
    from test_sinks import tensorboard_scalars
    from wandb_offline import history

    group = Peers(tmp_path, f"sw-{secrets.token_hex(3)}")
    wandb_env = {"WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "wbconfig"), "HOME": str(tmp_path),
                 "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    try:
        group.spawn(0, ["start", "--rounds", "1000", "-H", "10", *BACKGROUND, "--tensorboard", str(tmp_path / "tb"),
                        "--wandb", "diloco-start"], env=wandb_env)
        addr = group.address(0)
        group.spawn(1, ["join", addr, "--rounds", "1000", "-H", "10", *BACKGROUND])
        deadline = time.monotonic() + 90
        while not [r for r in group.lines(1, "round") if r["committed"] and r["peers"] == 2]:  # training together
            assert time.monotonic() < deadline, group.log(1)
            time.sleep(0.2)
        env = {**os.environ, "DILOCO_SECRET": group.secret, "COLUMNS": "220"}
        status = [sys.executable, "-m", "diloco", "status", addr, "--run-id", group.run_id, "--watch", "--interval", "1"]

        proc = _popen([*status, "--json"], stdout=subprocess.PIPE, text=True, env=env)

        def measured(lines: list[str]) -> bool:
            if len(lines) < 3:
                return False
            peers = json.loads(lines[-1])["peers"]
            return len(peers) == 2 and all(p["bytes_per_second"] and p["utilization"] for p in peers)
        try:
            lines = _refreshes(proc, measured, timeout=90)
            first_round = {p["peer"]: p["round"] for p in json.loads(lines[0])["peers"]}
            lines += _refreshes(proc, lambda more: any(
                all(p["round"] > first_round[p["peer"]] for p in json.loads(x)["peers"]) for x in more), timeout=90)
            proc.send_signal(signal.SIGUSR1)  # what to do when a peer seems hung: it dumps its threads' stacks, goes on
            time.sleep(0.5)
        finally:
            code = _ctrl_c(proc)
        assert code == 0, _stderr(proc)
        assert "most recent call first" in _stderr(proc) and "diloco/cli/status.py" in _stderr(proc)
        refreshes = [json.loads(x) for x in lines]
        assert all(len(r["peers"]) == 2 for r in refreshes) and refreshes[-1]["time"] > refreshes[0]["time"]
        last = {p["peer"]: p for p in refreshes[-1]["peers"]}
        assert addr.endswith(next(iter(sorted(last, key=lambda p: not addr.endswith(p)))))
        for p in last.values():
            assert p["status"] == "training" and p["round"] >= 1 and p["loss"] > 0 and p["bytes_sent"] > 0
            assert 0 < p["utilization"] <= 1
        # rates between a peer's last two heartbeats: one spent in a round's transfer or wait may show no steps, one
        # between two rounds' transfers no bytes (or none yet); each peer showed both in some refresh
        for rate in ("bytes_per_second", "steps_per_second"):
            assert all(any((p[rate] or 0) > 0 for r in refreshes for p in r["peers"] if p["peer"] == peer)
                       for peer in last), rate

        plain = _popen(status, stdout=subprocess.PIPE, text=True, env=env)
        try:
            text = _refreshes(plain, lambda ls: sum("swarm" in x for x in ls) >= 2 and len(ls) >= 6, timeout=60)
        finally:
            assert _ctrl_c(plain) == 0, _stderr(plain)
        assert f"swarm '{group.run_id}': 2 training" in text[0]
        assert sum(" Mbit/s " in x and " util " in x for x in text) >= 4  # both peers, each refresh

        master, slave = pty.openpty()  # a terminal: the live table
        live = _popen(status, stdout=slave, env=env)
        os.close(slave)
        shown = b""
        deadline = time.monotonic() + 60
        try:
            while shown.count(b"Ctrl-C to stop") < 2:  # redrawn in place, refresh after refresh
                assert time.monotonic() < deadline and live.poll() is None, shown[-2000:]
                if select.select([master], [], [], 0.5)[0]:
                    shown += os.read(master, 65536)
        finally:
            code = _ctrl_c(live)
            os.close(master)
        assert code == 0, _stderr(live)
        assert f"swarm '{group.run_id}': 2 training".encode() in shown and "Mbit/s".encode() in shown

        for noisy in ("hivemind", "asyncio"):  # the command quiets them for its own run: restored after the test
            monkeypatch.setattr(logging.getLogger(noisy), "level", logging.getLogger(noisy).level)
        one = invoke(["status", addr, "--run-id", group.run_id, "--json", "--interval", "1"], env=env)
        assert one.exit_code == 0, one.stderr
        rows = json.loads(one.stdout)
        assert sorted(r["peer"] for r in rows) == sorted(last) and all(r["status"] == "training" for r in rows)
        # a rate between its last two heartbeats, measured (0 when it spent them in a round's wait)
        assert all(r["round"] >= 1 and r["steps_per_second"] is not None and r["steps_per_second"] >= 0 for r in rows)
        assert all(0 <= r["heartbeat_age"] < 10 for r in rows), rows
        # from a machine whose clock reads two minutes ahead: the handshake gives the observer the swarm's time, so
        # its directory still holds every record (each lives 30 s) and the ages are the swarm's
        ahead = tmp_path / "observer.clock"
        ahead.write_text("120")
        off = subprocess.run([sys.executable, "-m", "diloco", "status", addr, "--run-id", group.run_id, "--json",
                              "--interval", "1"], env={**env, CLOCK_STEP_FILE: str(ahead)}, capture_output=True,
                             text=True, timeout=120)
        assert off.returncode == 0, off.stderr
        rows = json.loads(off.stdout)
        assert sorted(r["peer"] for r in rows) == sorted(last) and all(0 <= r["heartbeat_age"] < 10 for r in rows), rows
        dead = invoke(["status", "/ip4/127.0.0.1/tcp/9/p2p/" + addr.split("/p2p/")[1], "--run-id", group.run_id],
                      env=env)
        assert dead.exit_code == 1 and "no address answered" in dead.stderr
        # the swarm's DHT answers only holders of its secret: a stranger reads nothing
        stranger = invoke(["status", addr, "--run-id", group.run_id], env={**env, "DILOCO_SECRET": "w" * 32})
        assert stranger.exit_code == 1 and "no address answered" in stranger.stderr, stranger.stdout
        for said in (stranger, invoke(["status", addr, "--run-id", "another"], env=env)):
            assert said.exit_code == 1 and "a wrong --run-id or swarm secret" in said.stderr, said.stderr
            assert "ensure_bootstrap_success" not in said.stderr  # hivemind's option, nothing a user can set
        nothing = invoke(["status", addr, "--run-id", group.run_id], env={**env, "DILOCO_SECRET": None})
        assert nothing.exit_code == 2 and "--secret-file" in nothing.stderr

        group.procs[0].send_signal(signal.SIGTERM)  # the first peer leaves: its sinks are closed
        assert group.procs[0].wait(timeout=60) == 0, group.log(0)
        peer0 = next(p for p in last if addr.endswith(p))
        rounds = [r for r in group.lines(0, "round")]
        tb = tensorboard_scalars(tmp_path / "tb" / peer0)
        assert [step for step, _ in tb["round/loss"]] == [r["step"] for r in rounds if r["loss"] is not None]
        assert tb["final/round"] and tb["final/eval_loss"][0][1] > 0
        (run,) = (tmp_path / "wandb").glob("offline-run-*")
        assert len([row for row in history(run) if "round/loss" in row]) == len(rounds)
    finally:
        group.kill_all()


def test_a_region_members_row_says_its_region_and_the_title_counts_those_on_standby():
    from diloco.cli.status import PeerStatus
    from diloco.peers import PeerRecord

    rows = [PeerStatus(record=PeerRecord(peer="a", status="training", round=3, region="eu"), steps_per_second=None,
                       bytes_per_second=None, heartbeat_age=None),
            PeerStatus(record=PeerRecord(peer="b", status="standby", round=3, region="eu"), steps_per_second=None,
                       bytes_per_second=None, heartbeat_age=None)]
    assert statusview.cells(rows[1])[1] == "standby (eu)"
    assert statusview.title(rows, "geo") == "swarm 'geo': 1 training, 1 on standby"
    rows[1] = PeerStatus(record=PeerRecord(peer="b", status="standby", round=3, region="eu", ends=9),
                         steps_per_second=None, bytes_per_second=None, heartbeat_age=None)
    assert statusview.title(rows, "geo") == "swarm 'geo': 1 training, 1 on standby, the run ends at round 9"


def test_the_data_path_column_says_how_a_peers_calls_travel():
    from diloco.cli.statusview import data_path
    from diloco.peers import PeerRecord

    base = PeerRecord(peer="p1", status="training", round=1)
    assert data_path(base) == "libp2p"  # no data port: --no-direct, or an older peer
    assert data_path(PeerRecord(**{**base.__dict__, "data": "127.0.0.1:4000"})) == "direct"
    assert data_path(PeerRecord(**{**base.__dict__, "data": "127.0.0.1:4000", "libp2p": ("p2", "p3")})) == \
        "direct, 2 via libp2p"
    # behind a NAT: called through one relay, it reached one member through a relay itself; and a relay
    assert data_path(PeerRecord(**{**base.__dict__, "data": "10.0.0.2:4000", "via": ("r",), "relayed": ("p4",)})) == \
        "direct, 1 via relay, called via 1 relay"
    assert data_path(PeerRecord(**{**base.__dict__, "data": "127.0.0.1:4000", "relay": True})) == "direct, relay"
