"""A tiny watchdog process that takes a peer's children down with it, even on SIGKILL.

hivemind's p2pd daemon is a child of the peer process; if the peer is SIGKILLed the daemon is
reparented to init and keeps running, holding ports and sockets (measured: still alive 40 s
later). The reaper closes that hole without help from the dying process:

    parent  ──stdin pipe──▶  python -m diloco.peers.reaper
            "pid 1234\n"     (remembers pids and files to clean up)
            "file /tmp/x\n"
    parent dies (any way) → the pipe's write end closes → reaper reads EOF →
    SIGTERM each pid, SIGKILL after 2 s, delete the files, exit.

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

    def close(self) -> None:
        """Parent is exiting cleanly: let the reaper do its sweep now and wait for it."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(pids: list[int], files: list[str]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
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
    for raw in sys.stdin.buffer:
        kind, _, value = raw.decode(errors="replace").strip().partition(" ")
        if kind == "pid" and value.isdigit():
            pids.append(int(value))
        elif kind == "file" and value:
            files.append(value)
    _sweep(pids, files)


if __name__ == "__main__":
    main()
