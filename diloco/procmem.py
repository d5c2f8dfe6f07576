"""Resident memory of processes and their descendants, and their open file descriptors, read from
Linux /proc (benchmarks and tests only).

No dependency for this: a peer is a Python process plus the p2pd daemon it started, and a benchmark
wants their resident set together. Where /proc is missing (not Linux) every figure is 0.
"""

from __future__ import annotations

import os
from pathlib import Path


def rss_mib(pids: list[int]) -> float:
    """Resident memory of these processes together, MiB (a process that is gone counts 0)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError):
            pass
    return total / 1024


def family_rss_mib(pids: list[int]) -> list[float]:
    """For each pid: resident memory of it and every process below it (a peer and its daemon), MiB."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            ppid = int(text[text.rindex(")") + 2:].split()[1])  # after "pid (comm) ": state, ppid, ...
        except (OSError, ValueError, IndexError):  # gone meanwhile, or cut short
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out = []
    for pid in pids:
        family, todo = [], [pid]
        while todo:
            p = todo.pop()
            family.append(p)
            todo.extend(children.get(p, []))
        out.append(rss_mib(family))
    return out


def open_fds(pid: int) -> int:
    """File descriptors `pid` holds open now (0 when it is gone or /proc is missing)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0
