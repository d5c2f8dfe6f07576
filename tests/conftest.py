"""Test tiers (markers in pyproject.toml) and the guard every test runs under: a test that leaves a
child process behind (a peer, a hivemind p2pd daemon) fails, and the leftovers are killed."""

from __future__ import annotations

import os
import secrets
import time

import psutil
import pytest

# Every process this test session starts (peers, and their p2pd daemons, which copy the environment)
# carries this token, so the guard below never mistakes another run's daemons for ours.
_TOKEN = secrets.token_hex(8)
os.environ["DILOCO_TEST_SESSION"] = _TOKEN


def _p2pd_pids() -> set[int]:
    """Our session's p2pd daemons, wherever they were reparented to."""
    pids = set()
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] == "p2pd" and proc.environ().get("DILOCO_TEST_SESSION") == _TOKEN:
                pids.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return pids


@pytest.fixture(autouse=True)
def no_orphans():
    """Fail the test if it leaves behind children or p2pd daemons (checked after a short grace)."""
    me = psutil.Process(os.getpid())
    daemons_before = _p2pd_pids()
    children_before = {c.pid for c in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + 10
    while True:
        leftover_daemons = _p2pd_pids() - daemons_before
        leftover_children = [c for c in me.children(recursive=True) if c.pid not in children_before]
        leftover_children = [c for c in leftover_children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        if not (leftover_daemons or leftover_children) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in leftover_daemons | {c.pid for c in leftover_children}:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    assert not leftover_daemons, f"test left p2pd daemons running: {sorted(leftover_daemons)}"
    assert not leftover_children, f"test left child processes running: {[c.pid for c in leftover_children]}"
