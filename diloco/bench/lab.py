"""Real peers on an emulated WAN: one swarm of `diloco start` / `diloco join` processes training the
bundled job, one per host of a `diloco.bench.wan.WanLab`. The benchmarks that race or compare variants
on a link (B4 `overlap`, `race`) run each variant through `run_swarm` on the same lab."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..metrics import read_jsonl

Lines = list[dict[str, Any]]
Tick = Callable[[float, float | None, str | None], None]
"""(done, total, status) of a benchmark that runs variants one after the other on a lab."""


@dataclass(frozen=True)
class LabModel:
    """What every variant of a benchmark on a lab shares: the bundled model, its batches and the inner lr schedule
    (linear warmup, then constant, so that a variant's loss at a step does not depend on how long it was set to run).
    The benchmarks' setups extend it."""

    d_model: int = 64
    layers: int = 2
    context: int = 64
    batch_size: int = 8
    warmup: int = 20
    """Inner steps of linear lr warmup, then constant."""
    lr: float = 4e-3
    """Inner AdamW lr."""

    def model_flags(self) -> list[str]:
        """The bundled job's options for all of it but the lr (data-parallel sets its own)."""
        return ["--d-model", str(self.d_model), "--layers", str(self.layers), "--context", str(self.context),
                "--batch-size", str(self.batch_size), "--warmup", str(self.warmup), "--schedule", "constant"]


def measure_link(lab: Any, rate_mbit: float, progress: Callable[[str], None]) -> Any:
    """Time about 4 s of TCP transfer from host 0 to host 1 (RTT and goodput) and say what it found."""
    measured = lab.measure(0, 1, nbytes=max(200_000, int(rate_mbit * 1e6 / 8 * 4)))
    progress(f"measured between hosts 0 and 1: {measured}")
    return measured


def run_swarm(lab: Any, peers: int, args: Sequence[str], workdir: Path, timeout_s: float,
              watch: Callable[[Lines], None] | None = None, per_peer: Sequence[Sequence[str]] = (),
              straggle_s: float | None = None) -> list[Lines]:
    """Run `peers` peers of the bundled job with the job/swarm flags `args` (peer 0 starts the swarm, the
    others join it; each gets `--shard i`, and `per_peer[i]` if given), wait for all of them, and return each
    one's metrics lines.
    `watch(lines)` gets peer 0's lines about every 2 s while they run. A peer still running at `timeout_s`
    is killed (TimeoutExpired); a peer that ends without a final line raises RuntimeError naming its log.
    `straggle_s`: once peer 0 ended, a peer still running this much later is stopped with SIGTERM (it ends its
    run and writes its final line, as on Ctrl-C): a worker the swarm went on without may never reach the last
    round."""
    workdir.mkdir(parents=True, exist_ok=True)
    run_id = f"lab-{int(time.time() * 1000) % 10**8}"
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    env = {**os.environ, "DILOCO_SECRET": secrets.token_urlsafe(32)}  # the swarm secret, not on command lines
    try:
        for i in range(peers):
            log = open(workdir / f"peer{i}.log", "wb")
            logs.append(log)
            cmd = [sys.executable, "-m", "diloco"]
            cmd += ["start"] if i == 0 else ["join", (workdir / "peer0.addr").read_text().split()[0]]
            cmd += ["--host", lab.address(i), "--port", "0", "--run-id", run_id, *args,
                    *(per_peer[i] if per_peer else ()), "--shard", str(i),
                    "--metrics", str(workdir / f"peer{i}.jsonl"), "--address-file", str(workdir / f"peer{i}.addr")]
            procs.append(lab.popen(i, cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
            if i == 0:
                _wait_for_file(workdir / "peer0.addr", procs[0], 120)
        deadline = time.monotonic() + timeout_s
        for k, p in enumerate(procs):
            while True:
                try:
                    p.wait(timeout=min(2.0, max(0.1, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        raise
                    if watch is not None:
                        watch(read_jsonl(workdir / "peer0.jsonl"))
            if k == 0 and straggle_s is not None:
                stop_stragglers(procs[1:], straggle_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    out = []
    for i in range(peers):
        lines = read_jsonl(workdir / f"peer{i}.jsonl")
        if not any(ln.get("event") == "final" for ln in lines):
            raise RuntimeError(f"peer {i} did not finish; see {workdir / f'peer{i}.log'}")
        out.append(lines)
    return out


def stop_stragglers(procs: Sequence[subprocess.Popen[bytes]], after: float) -> None:
    """Give `procs` `after` seconds to end, then SIGTERM those still running (they end their runs)."""
    deadline = time.monotonic() + after
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.terminate()


def final(lines: Lines) -> dict[str, Any]:
    """A finished peer's final line."""
    return next(ln for ln in reversed(lines) if ln.get("event") == "final")


def _wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the first peer did not start (exit {proc.poll()}); see its log next to {path}")
        time.sleep(0.2)
