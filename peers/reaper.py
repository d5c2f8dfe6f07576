"""A tiny watchdog process that takes a peer's children down with it, even on SIGKILL.

hivemind's p2pd daemon is a child of the peer process; if the peer is SIGKILLed the daemon is
reparented to init and keeps running, holding ports and sockets (measured: still alive 40 s
later). The reaper closes that hole without help from the dying process:

    parent  ──stdin pipe──▶  python -m diloco.peers.reaper
            "pid 1234\n"     (remembers pids and files to clean up)
            "file /tmp/x\n"
            "env NAME=VALUE\n"  (and every process whose environment holds NAME=VALUE)
    parent dies (any way) → the pipe's write end closes → reaper reads EOF →
    SIGTERM each pid, SIGKILL after 2 s, delete the files, exit.

Processes are found by environment because the launcher's command (torchrun, say) starts its own
children in sessions of their own: neither parentage nor process groups reach them once their
parent is gone, but they all inherit the variable the launcher set. Linux only (/proc).

The pipe's write end is close-on-exec, so no other child holds it open. The reaper imports only
the standard library, so it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


class Reaper:
    """Handle in the parent: `watch_pid(pid)`, `watch_file(path)`; `close()` on clean exit."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            # -S: no site-packages; the reaper needs only the standard library, so it starts fast.
            [sys.executable, "-S", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the parent's group must not kill the reaper first
            # not tagged as part of a launch: the launcher's sweep must leave it to clean up after its parent
            env={k: v for k, v in os.environ.items() if k != "DILOCO_LAUNCH_ID"},
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _send(self, line: str) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write((line + "\n").encode())
        self._proc.stdin.flush()

    def watch_pid(self, pid: int) -> None:
        self._send(f"pid {pid}")

    def watch_file(self, path: str) -> None:
        self._send(f"file {path}")

    def watch_env(self, name: str, value: str) -> None:
        """Also take down every process of ours whose environment holds `name=value`."""
        self._send(f"env {name}={value}")

    def close(self) -> None:
        """Parent is exiting cleanly: let the reaper do its sweep now and wait for it."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` is still running: it exists (ours or another user's) and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def environ(pid: int) -> dict[str, str]:
    """The environment process `pid` started with (empty when it is gone or not ours)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").partition("=")[::2] for kv in raw.split(b"\0") if b"=" in kv)


def tagged(name: str, value: str) -> list[int]:
    """Pids of this user's processes whose environment holds `name=value` (this process excluded)."""
    needle, me, found = f"{name}={value}".encode(), os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or not ours
            pass
    return found


def kill_tagged(name: str, value: str) -> int:
    """SIGTERM every process tagged `name=value`, SIGKILL those left after 2 s; how many there were."""
    pids = tagged(name, value)
    _sweep(pids, [])
    return len(pids)


def _sweep(pids: list[int], files: list[str]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for path in files:
        try:
            os.remove(path)
        except OSError:
            pass


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only EOF on stdin ends the reaper
    pids: list[int] = []
    files: list[str] = []
    tags: list[tuple[str, str]] = []
    for raw in sys.stdin.buffer:
        kind, _, value = raw.decode(errors="replace").strip().partition(" ")
        if kind == "pid" and value.isdigit():
            pids.append(int(value))
        elif kind == "file" and value:
            files.append(value)
        elif kind == "env" and "=" in value:
            name, _, tag = value.partition("=")
            tags.append((name, tag))
    _sweep(pids + [p for name, tag in tags for p in tagged(name, tag)], files)


if __name__ == "__main__":
    main()
