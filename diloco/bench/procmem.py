"""Resident memory of processes and their descendants, and their open file descriptors (the demo's
summary, benchmarks and tests): a peer is a Python process plus the p2pd daemon it started, and they
are measured together.

Through psutil where it is installed (`pip install "diloco[psutil]"`), which works on every platform
it supports. psutil is not a core dependency, and the demo reports its peers' peak memory on a core
install too, so a small reader of Linux's /proc stays as the fallback (`_proc`); where neither is
available (no psutil, not Linux) every figure is 0.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

MIB = 1 << 20


def _psutil() -> ModuleType | None:
    try:
        return importlib.import_module("psutil")
    except ImportError:
        return None


psutil = _psutil()
"""The psutil module, or None (then /proc is read)."""


def rss_mib(pids: list[int]) -> float:
    """Resident memory of these processes together, MiB (a process that is gone counts 0)."""
    if psutil is None:
        return _proc.rss_kib(pids) / 1024
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone (or a zombie), or not ours to read
            pass
    return total / MIB


def family(pid: int) -> list[int]:
    """`pid` and every process below it (an empty list when it is gone)."""
    if psutil is None:
        return _proc.family(pid)
    try:
        proc = psutil.Process(pid)
        return [pid, *(child.pid for child in proc.children(recursive=True))]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def named(pids: list[int], name: str) -> list[int]:
    """Those of `pids` whose process is called `name` (as `ps -o comm` shows it), e.g. "p2pd"."""
    if psutil is None:
        return [pid for pid in pids if _proc.name(pid) == name]
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).name() == name:
                out.append(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (getrusage: kilobytes on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024


def family_rss_mib(pids: list[int]) -> list[float]:
    """For each pid: resident memory of it and every process below it (a peer and its daemon), MiB."""
    return [rss_mib(family(pid)) for pid in pids]


def open_fds(pid: int) -> int:
    """File descriptors `pid` holds open now (0 when it is gone or cannot be read)."""
    if psutil is None:
        return _proc.open_fds(pid)
    try:
        return int(psutil.Process(pid).num_fds())
    except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):  # num_fds: POSIX only
        return 0


class _proc:
    """The fallback without psutil: Linux's /proc, read directly (status, stat, fd)."""

    @staticmethod
    def rss_kib(pids: list[int]) -> int:
        total = 0
        for pid in pids:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except (OSError, ValueError):
                pass
        return total

    @staticmethod
    def family(pid: int) -> list[int]:
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
                ppid = int(text[text.rindex(")") + 2:].split()[1])  # after "pid (comm) ": state, ppid, ...
            except (OSError, ValueError, IndexError):  # gone meanwhile, or cut short
                continue
            children.setdefault(ppid, []).append(int(stat.parent.name))
        if not Path(f"/proc/{pid}").exists():
            return []
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo.extend(children.get(p, []))
        return out

    @staticmethod
    def name(pid: int) -> str | None:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return None

    @staticmethod
    def open_fds(pid: int) -> int:
        try:
            return len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            return 0
