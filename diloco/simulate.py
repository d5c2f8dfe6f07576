"""`diloco simulate`: M workers of the default job in one process, and what the run would cost on real links.

One code path. Each worker is `train.run_job` on a `Swarm.in_process` peer, exactly as `diloco join`
runs it on a hivemind peer: same round protocol, codecs, fragments, overlap and outer optimizer,
only the bytes move through memory. Worker i trains on data shard i (as `--shard i`), so a simulated
run and a real swarm with the same seeds, shards and config end with the same global state, bit for
bit (tests/test_multiproc.py checks it). The state depends on data and seeds only, never on thread
timing: every round waits for all M workers (generous deadlines) and owners sum contributions in an
order derived from their bytes.

Projection. Nothing here takes real network time, so the cost on a given link is projected from what
each round really put on the wire (`project`, a pure function): a round's exchange takes

    comm = 4 · latency + max(bytes sent, bytes received by a worker) · 8 / bandwidth

(a ready and its reply, contributions to span owners, results back; full-duplex links), computed
with the round's busiest worker. Between two rounds every worker takes H/P inner steps; the swarm
moves at the pace of its slowest worker (a round waits for all), and a result needed τ steps after
its round started blocks the loop for max(0, comm − τ · step) seconds. Projected wall clock is the
sum over rounds of the slowest worker's compute plus that blocking; a worker's compute utilization
is its own compute time over that wall clock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

from diloco.comms import InProcNetwork
from diloco.comms.loop import LoopThread
from diloco.peers import InProcBoard

from .config import ConfigError, SwarmConfig
from .metrics import MetricsWriter
from .swarm import Swarm
from .train import JobConfig, load_corpus, run_job

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NetworkModel:
    """The links and workers a simulated run is projected onto."""

    bandwidth_mbit: float = 100.0
    """Each worker's link, per direction, in Mbit/s."""
    latency_ms: float = 50.0
    """One-way latency between two workers, in milliseconds."""
    step_seconds: float | None = None
    """Compute time of one inner step at speed 1.0 (default: as measured in the simulated run)."""
    speeds: tuple[float, ...] = ()
    """Relative speed of each worker (1.0: `step_seconds` a step; 0.5: half as fast); default all 1."""

    def __post_init__(self) -> None:
        if self.bandwidth_mbit <= 0:
            raise ConfigError(f"bandwidth_mbit must be > 0, got {self.bandwidth_mbit}")
        if self.latency_ms < 0:
            raise ConfigError(f"latency_ms must be >= 0, got {self.latency_ms}")
        if self.step_seconds is not None and self.step_seconds <= 0:
            raise ConfigError(f"step_seconds must be > 0, got {self.step_seconds}")
        if any(s <= 0 for s in self.speeds):
            raise ConfigError(f"every speed must be > 0, got {list(self.speeds)}")

    def comm_seconds(self, sent: int, received: int) -> float:
        return 4 * self.latency_ms / 1e3 + max(sent, received) * 8 / (self.bandwidth_mbit * 1e6)


@dataclass(frozen=True)
class Projection:
    wall_seconds: float
    compute_seconds: tuple[float, ...]
    """Per worker: its inner steps' compute time."""
    blocked_seconds: float
    """Time the swarm's loop waited for results that were not back τ steps after their round began."""
    comm_seconds: float
    """Sum over rounds of the exchange time on the link (overlapped or not)."""

    @property
    def utilization(self) -> tuple[float, ...]:
        return tuple(c / self.wall_seconds if self.wall_seconds > 0 else 1.0 for c in self.compute_seconds)

    def as_dict(self) -> dict[str, Any]:
        return dict(wall_seconds=round(self.wall_seconds, 3), blocked_seconds=round(self.blocked_seconds, 3),
                    comm_seconds=round(self.comm_seconds, 3), utilization=[round(u, 4) for u in self.utilization],
                    min_utilization=round(min(self.utilization), 4))


def project(round_bytes: Sequence[tuple[int, int]], *, steps_per_round: int, overlap: int, workers: int,
            net: NetworkModel, step_seconds: float) -> Projection:
    """Project a run onto `net`: `round_bytes` is (bytes sent, bytes received) of the busiest worker in
    each round, in order; each round follows `steps_per_round` inner steps (H/P) and its result is
    needed `overlap` (τ) steps after it began. Pure: see the module docstring for the model."""
    step = net.step_seconds if net.step_seconds is not None else step_seconds
    speeds = net.speeds or (1.0,) * workers
    if len(speeds) != workers:
        raise ConfigError(f"speeds lists {len(speeds)} workers, the run has {workers}")
    slowest = step / min(speeds)
    compute = slowest * steps_per_round * len(round_bytes)
    comms = [net.comm_seconds(s, r) for s, r in round_bytes]
    blocked = sum(max(0.0, c - overlap * slowest) for c in comms)
    steps = steps_per_round * len(round_bytes)
    return Projection(wall_seconds=compute + blocked, compute_seconds=tuple(steps * step / s for s in speeds),
                      blocked_seconds=blocked, comm_seconds=sum(comms))


class _Rows(MetricsWriter):
    """Collects a worker's metrics in memory."""

    def __init__(self) -> None:
        super().__init__(None)
        self.rows: list[dict[str, Any]] = []

    def write(self, event: str, **fields: Any) -> None:
        self.rows.append({"event": event, **fields})


def simulate(job: JobConfig, workers: int, *, swarm: SwarmConfig | None = None, net: NetworkModel | None = None,
             timeout: float = 3600.0) -> dict[str, Any]:
    """Run `workers` workers of `job` in this process and project the run onto `net`; returns a summary
    (per-worker finals, the global digest, bytes, the projection). Raises RuntimeError if a worker failed."""
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    net = net or NetworkModel()
    if net.speeds and len(net.speeds) != workers:
        raise ConfigError(f"speeds lists {len(net.speeds)} workers, --workers is {workers}")
    # Every round waits for all workers: the simulated machine may be slow, the state must not depend on it.
    base = swarm or SwarmConfig(run_id="simulate")
    scfg = replace(base, gather_timeout=max(base.gather_timeout, 600.0), reduce_timeout=max(base.reduce_timeout, 600.0),
                   result_timeout=max(base.result_timeout, 900.0), min_peers=workers)
    network, board, loop = InProcNetwork(), InProcBoard(), LoopThread()
    swarms = [Swarm.in_process(network, board, f"sim{i:03d}", scfg, loop) for i in range(workers)]
    rows = [_Rows() for _ in range(workers)]
    corpus = load_corpus(job)  # one copy for all workers: they only read it
    finals: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            finals[i] = run_job(replace(job, shard=i, wait_for=workers), swarms[i], metrics=rows[i], corpus=corpus)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append(e)

    started = time.monotonic()
    threads = [threading.Thread(target=work, args=(i,), name=f"sim{i}") for i in range(workers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, timeout - (time.monotonic() - started)))
        if any(t.is_alive() for t in threads):
            raise RuntimeError(f"the simulation did not finish within {timeout:.0f}s")
        if errors:
            raise RuntimeError(f"a simulated worker failed: {errors[0]!r}") from errors[0]
    finally:
        for s in swarms:
            s.close(announce=False)
        loop.stop()
    wall = time.monotonic() - started
    return summarize(job, [finals[i] for i in range(workers)], [r.rows for r in rows], net, wall)


def step_seconds(finals: Sequence[dict[str, Any]], cores: int | None = None) -> float:
    """An inner step's compute time on this machine, from the workers' own accounting (time outside the
    wrapper's sync work, per step), scaled by the share of the cores each worker had: M workers took
    turns on `cores` cores, so each one's steps took M/cores times as long as they would alone."""
    share = min(len(finals), cores or os.cpu_count() or 1) / len(finals)
    per_worker = [(u["wall_seconds"] - u["sync_seconds"]) / u["steps"] for u in (f["usage"] for f in finals)
                  if u["steps"]]
    return share * sum(per_worker) / len(per_worker) if per_worker else 0.0


def summarize(job: JobConfig, finals: list[dict[str, Any]], rows: list[list[dict[str, Any]]], net: NetworkModel,
              wall: float) -> dict[str, Any]:
    """The simulation's summary from each worker's final record and round metrics."""
    rounds: dict[int, tuple[int, int]] = {}
    for worker in rows:
        for r in worker:
            if r["event"] == "round" and r["committed"]:
                s, v = rounds.get(r["round"], (0, 0))
                rounds[r["round"]] = (max(s, r["bytes_sent"]), max(v, r["bytes_received"]))
    measured_step = max(1e-9, step_seconds(finals))
    fragments = finals[0]["fragments"]
    projection = project([rounds[k] for k in sorted(rounds)], steps_per_round=job.inner_steps // fragments,
                         overlap=job.overlap, workers=len(finals), net=net, step_seconds=measured_step)
    return dict(workers=len(finals), digests=sorted({f["digest"] for f in finals}), digest=finals[0]["digest"],
                round=finals[0]["round"], eval_loss=finals[0]["eval_loss"], params=finals[0]["params"],
                bytes_sent=sum(f["bytes_sent"] for f in finals), bits_per_param_sync=finals[0]["bits_per_param_sync"],
                compression=finals[0]["compression"], wall_seconds=round(wall, 2),
                step_seconds=round(net.step_seconds or measured_step, 6),
                network=dict(bandwidth_mbit=net.bandwidth_mbit, latency_ms=net.latency_ms,
                             speeds=list(net.speeds) or [1.0] * len(finals)),
                projection=projection.as_dict())
