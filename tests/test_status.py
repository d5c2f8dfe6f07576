"""`diloco status ADDR`: a real peer, observed from another process; and the pure row builder."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import pytest
from multiproc_util import TINY, Peers

from diloco.peers import PeerRecord
from diloco.status import summarize


def test_rows_rate_age_and_order():
    a0 = PeerRecord(peer="a", status="training", round=3, step=100, beat=1000.0)
    a1 = PeerRecord(peer="a", status="training", round=3, step=110, beat=1001.5)
    b1 = PeerRecord(peer="b", status="joining", round=0, step=0)
    c1 = PeerRecord(peer="c", status="training", round=4, step=7, beat=1002.0)
    rows = summarize([a0], [b1, a1, c1], interval=2.0, now=1003.0)
    assert [r.record.peer for r in rows] == ["c", "a", "b"]  # training first, newest round first
    assert rows[1].steps_per_second == pytest.approx(5.0) and rows[1].heartbeat_age == pytest.approx(1.5)
    assert rows[0].steps_per_second is None  # not seen in the first read
    assert rows[2].heartbeat_age is None  # no heartbeat time in its record


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_status_shows_a_running_peer(tmp_path):
    group = Peers(tmp_path, f"st-{secrets.token_hex(3)}")
    try:
        group.spawn(0, ["start", "--rounds", "1000", "-H", "10", *TINY])
        addr = group.address(0)
        deadline = time.monotonic() + 60
        while not group.lines(0, "round") and time.monotonic() < deadline:  # it is training
            time.sleep(0.2)
        env = {**os.environ, "DILOCO_SECRET": group.secret}
        out = subprocess.run([sys.executable, "-m", "diloco", "status", addr, "--run-id", group.run_id, "--json",
                              "--interval", "1"], capture_output=True, text=True, timeout=90, env=env)
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        assert len(rows) == 1 and rows[0]["peer"] in addr and rows[0]["status"] == "training"
        assert rows[0]["round"] >= 1 and rows[0]["steps_per_second"] > 0 and 0 <= rows[0]["heartbeat_age"] < 10
        dead = subprocess.run([sys.executable, "-m", "diloco", "status", "/ip4/127.0.0.1/tcp/9/p2p/" + addr.split("/p2p/")[1],
                               "--run-id", group.run_id], capture_output=True, text=True, timeout=90, env=env)
        assert dead.returncode == 1 and "no address answered" in dead.stderr
        # the swarm's DHT answers only holders of its secret: a stranger reads nothing
        stranger = subprocess.run([sys.executable, "-m", "diloco", "status", addr, "--run-id", group.run_id],
                                  capture_output=True, text=True, timeout=90,
                                  env={**os.environ, "DILOCO_SECRET": "w" * 32})
        assert stranger.returncode == 1 and "no address answered" in stranger.stderr, stranger.stdout
        nothing = subprocess.run([sys.executable, "-m", "diloco", "status", addr, "--run-id", group.run_id],
                                 capture_output=True, text=True, timeout=90,
                                 env={k: v for k, v in os.environ.items() if k != "DILOCO_SECRET"})
        assert nothing.returncode == 2 and "--secret-file" in nothing.stderr
    finally:
        group.kill_all()
