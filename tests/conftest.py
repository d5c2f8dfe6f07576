"""Test tiers (markers in pyproject.toml) and the guard every test runs under: a test that leaves a
child process behind (a peer, a hivemind p2pd daemon) fails, and the leftovers are killed; so does a
test that leaves a daemon's unix socket file behind (and the file is removed). Every Python process
the session starts (xdist's workers, peers, launchers, ranks) runs tests/leanstart/sitecustomize.py
at start-up: torch's optimizers do not import TorchDynamo in a process that compiles nothing."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import pytest

# Every process this test session starts (peers, and their p2pd daemons, which copy the environment)
# carries this token, so the guard below never mistakes another run's daemons for ours.
_TOKEN = secrets.token_hex(8)
os.environ["DILOCO_TEST_SESSION"] = _TOKEN

# ~1.3 CPU-s less at the start of each of the ~150 processes that build an optimizer (tests/leanstart/sitecustomize.py);
# DILOCO_TEST_LEAN=0 starts them as torch does
if os.environ.get("DILOCO_TEST_LEAN", "1") != "0":
    _LEAN = str(Path(__file__).parent / "leanstart")
    os.environ["PYTHONPATH"] = os.pathsep.join([_LEAN, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

# Daemons put their socket files in the temp directory (comms/p2p.py): give this session one of its own,
# inherited by every peer it starts, so a file left there was left by one of our tests, not another run's.
# pytest's own tmp_path stays where it was.
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
_SOCKETS = Path(tempfile.mkdtemp(prefix="diloco-test-"))
os.environ["TMPDIR"] = tempfile.tempdir = str(_SOCKETS)
atexit.register(shutil.rmtree, _SOCKETS, ignore_errors=True)


def _socket_files() -> set[Path]:
    return set(_SOCKETS.glob("hivemind-*.sock"))


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
    """Fail the test if it leaves behind children, p2pd daemons or their socket files (checked after a
    short grace)."""
    me = psutil.Process(os.getpid())
    daemons_before = _p2pd_pids()
    children_before = {c.pid for c in me.children(recursive=True)}
    sockets_before = _socket_files()
    yield
    deadline = time.monotonic() + 10
    while True:
        leftover_daemons = _p2pd_pids() - daemons_before
        leftover_children = [c for c in me.children(recursive=True) if c.pid not in children_before]
        leftover_children = [c for c in leftover_children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        leftover_sockets = sorted(_socket_files() - sockets_before)
        if not (leftover_daemons or leftover_children or leftover_sockets) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in leftover_daemons | {c.pid for c in leftover_children}:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    for path in leftover_sockets:
        path.unlink(missing_ok=True)
    assert not leftover_daemons, f"test left p2pd daemons running: {sorted(leftover_daemons)}"
    assert not leftover_children, f"test left child processes running: {[c.pid for c in leftover_children]}"
    assert not leftover_sockets, f"test left socket files of its p2pd daemons: {[p.name for p in leftover_sockets]}"
