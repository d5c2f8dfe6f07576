"""diloco/bench/procmem.py: resident memory of a process and of everything below it, and its open files,
through psutil and through the /proc fallback used where psutil is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Iterator

import pytest

from diloco.bench import procmem

pytestmark = pytest.mark.unit


@pytest.fixture(params=["psutil", "proc"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs twice: with psutil (installed by the test extra) and with the /proc reader."""
    assert procmem.psutil is not None, 'the test extra installs psutil: pip install -e ".[test]"'
    if request.param == "proc":
        monkeypatch.setattr(procmem, "psutil", None)
    return str(request.param)


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A child process holding 64 MiB it has touched, with a grandchild of its own, which has started (its memory
    stands still from then on: a grandchild still starting its interpreter grew by ~8 MiB between the test's two
    readings of it on a busy machine)."""
    code = ("import subprocess, sys, time; b = bytearray(64 << 20); "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; print(flush=True); time.sleep(30)'], "
            "stdout=subprocess.PIPE); g.stdout.readline(); "
            "print(g.pid, flush=True); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_family_counts_its_children_and_a_gone_process_counts_nothing(backend: str, child) -> None:
    grandchild = int(child.stdout.readline())
    try:
        own, alone = procmem.rss_mib([os.getpid()]), procmem.rss_mib([child.pid])
        deadline = time.monotonic() + 20
        while alone < 64:  # until the child has touched its 64 MiB
            assert time.monotonic() < deadline and child.poll() is None, alone
            time.sleep(0.05)
            alone = procmem.rss_mib([child.pid])
        assert set(procmem.family(child.pid)) == {child.pid, grandchild}
        # ours is read on both sides of the family's reading: this test process's resident memory moves by tens
        # of MiB late in a suite (memory freed and given back), so `own` from above is no bound for it now
        before = procmem.rss_mib([os.getpid()])
        family, just_child = procmem.family_rss_mib([os.getpid(), child.pid])
        after = procmem.rss_mib([os.getpid()])
        assert own > 10 and just_child >= 64 + 3  # the grandchild's interpreter is counted too
        assert family >= min(before, after) + just_child - 5  # ours plus the child's family below it
    finally:
        os.kill(grandchild, 9)
        child.kill()
        child.wait()
    assert procmem.rss_mib([child.pid]) == 0 and procmem.family_rss_mib([child.pid]) == [0.0]
    assert procmem.family(child.pid) == []


def test_open_files_are_counted(backend: str, tmp_path) -> None:
    before = procmem.open_fds(os.getpid())
    files = [open(tmp_path / f"f{i}", "w") for i in range(5)]
    try:
        assert procmem.open_fds(os.getpid()) == before + 5
    finally:
        for f in files:
            f.close()
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert procmem.open_fds(dead.pid) == 0


def test_both_readers_agree_on_a_process(child) -> None:
    """On a process whose memory stands still (the child, once it holds its 64 MiB; this test process's own
    moves by tens of MiB between two readings late in a suite)."""
    assert procmem.psutil is not None
    grandchild = int(child.stdout.readline())  # it has made its 64 MiB and started its grandchild
    try:
        with_psutil = procmem.rss_mib([child.pid])
        from_proc = procmem._proc.rss_kib([child.pid]) / 1024
        assert with_psutil >= 64 and abs(with_psutil - from_proc) < 8, (with_psutil, from_proc)
    finally:
        os.kill(grandchild, 9)


def test_processes_are_found_by_name(backend: str, child) -> None:
    grandchild = int(child.stdout.readline())
    try:
        family = procmem.family(child.pid)
        python = os.path.basename(sys.executable)[:15]  # the name it was started by; the kernel keeps 15 characters
        assert set(procmem.named(family, python)) == {child.pid, grandchild}
        assert procmem.named(family, "p2pd") == []
    finally:
        os.kill(grandchild, 9)


def test_peak_memory_of_this_process_is_at_least_what_it_holds_now() -> None:
    held = bytearray(32 << 20)
    held[::4096] = b"x" * len(held[::4096])  # touch every page
    now = procmem.rss_mib([os.getpid()])  # read before the peak: memory taken in between raises both
    assert procmem.peak_rss_mib() >= now - 1 >= 32
