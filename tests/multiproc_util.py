"""Helpers for multi-process tests: run real `diloco` peer processes on 127.0.0.1 and read their
metrics. Every process started here is killed at teardown, whatever happened."""

from __future__ import annotations

import json
import os
import resource
import secrets
import subprocess
import sys
import time
from pathlib import Path

# A tiny model, and a peer that sleeps seven times its compute after each step: tests wait on events (a join, a crash,
# a round), not on how fast a peer trains, and the CPU a peer leaves goes to the processes starting beside it. Two
# such peers training each use 0.2 of a core (0.46 with a sleep of twice the compute: 5.5 rounds a second against 14;
# these tests' CPU 298 against 363 CPU-s, 2026-11-28).
TINY = ["--d-model", "32", "--layers", "1", "--batch-size", "4", "--gather-timeout", "20", "--round-timeout", "6",
        "--slowdown", "8"]
# Peers that only keep a swarm going while the test does something else beside it (watches it, attacks it, starts
# other processes) sleep 23 times their compute: a training peer's CPU is its compute, so two of them use a third as
# much (0.16 of a core against 0.41, 0.65 rounds a second against 1.7; `--rounds 100000 -H 10`, 2026-11-29): the
# status test and the two stalled-connection tests 27.3 against 35.8 CPU-s (the same hour, one run each).
BACKGROUND = [*TINY[:-2], "--slowdown", "24"]


def new_peer_ids(paths: list[Path]) -> list[str]:
    """Make a key file at each of `paths` (`--identity`) and return their peer ids: a test knows its peers' ids
    before they start."""
    from diloco.comms.identity import Identity

    ids = []
    for path in paths:
        identity = Identity.load(str(path))
        ids.append(identity.peer_id)
        identity.release()  # the peer that runs under it takes its lock
    return ids


class Peers:
    def __init__(self, workdir: Path, run_id: str) -> None:
        self.workdir, self.run_id = workdir, run_id
        self.secret = secrets.token_urlsafe(32)
        """The swarm secret every peer gets in DILOCO_SECRET (a test may override it per peer)."""
        self.procs: list[subprocess.Popen] = []

    def spawn(self, index: int, args: list[str], env: dict[str, str] | None = None,
              session: bool = False, open_files: int | None = None, command: list[str] | None = None,
              ) -> subprocess.Popen:
        """Start peer `index` (`command`: a training command the launcher runs, after `--`); with `session` in a process group of its own (as a shell job is, so a
        test can send the group Ctrl-C's SIGINT); with `open_files` under that soft and hard limit of
        open files (its daemon inherits it)."""
        cmd = [sys.executable, "-m", "diloco", *args, "--run-id", self.run_id,
               "--metrics", str(self.metrics(index)), "--address-file", str(self.workdir / f"peer{index}.addr"),
               "--shard", str(index), "--verbose", *(["--", *command] if command else [])]
        with open(self.workdir / f"peer{index}.log", "wb") as log:  # the peer holds its own copy
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "DILOCO_SECRET": self.secret, **(env or {})},
                                    start_new_session=session,
                                    preexec_fn=None if open_files is None else lambda: resource.setrlimit(
                                        resource.RLIMIT_NOFILE, (open_files, open_files)))
        self.procs.append(proc)
        return proc

    def metrics(self, index: int) -> Path:
        return self.workdir / f"peer{index}.jsonl"

    def lines(self, index: int, event: str | None = None) -> list[dict]:
        try:
            rows = [json.loads(x) for x in self.metrics(index).read_text().splitlines() if x.strip()]
        except FileNotFoundError:
            return []
        return [r for r in rows if event is None or r["event"] == event]

    def address(self, index: int, timeout: float = 60) -> str:
        path = self.workdir / f"peer{index}.addr"
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert time.monotonic() < deadline, f"peer {index} never wrote its address; log:\n{self.log(index)}"
            time.sleep(0.1)
        return path.read_text().split()[0]

    def log(self, index: int, whole: bool = False) -> str:
        """Peer `index`'s output: its last 4000 characters (for assertion messages), or all of it."""
        text = (self.workdir / f"peer{index}.log").read_text(errors="replace")
        return text if whole else text[-4000:]

    def wait(self, proc: subprocess.Popen, timeout: float) -> int:
        return proc.wait(timeout=timeout)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
