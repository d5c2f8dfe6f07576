"""Test tiers (markers in pyproject.toml) and the guard every test runs under: a test that leaves a
child process behind (a peer, a hivemind p2pd daemon) fails, and the leftovers are killed."""

from __future__ import annotations

import os
import time

import psutil
import pytest


def _p2pd_pids() -> set[int]:
    pids = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if proc.info["name"] == "p2pd" or any("p2pd" in part for part in (proc.info["cmdline"] or [])[:1]):
                pids.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
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
