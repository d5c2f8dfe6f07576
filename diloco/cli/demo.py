"""`diloco demo`: a real swarm of N peer processes on 127.0.0.1, a live view, and a summary.

Peer 0 runs `diloco start`, the others `diloco join <peer 0's address>`: the same commands a user
runs across machines, with real libp2p daemons and a real DHT. Each peer trains the bundled
byte-level GPT on its own shard of the bundled corpus. The live view polls each peer's status
file; the summary reads each peer's metrics: the held-out loss of the global model, the bytes
all peers sent, and what per-step data-parallel training would have sent for the same steps
(a ring all-reduce of fp32 gradients: 2·(N−1)/N · 4 bytes per parameter per peer per step).

If you interrupt it (Ctrl-C), every peer is asked to leave (SIGTERM), and killed after 15 s.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..bench.procmem import family_rss_mib
from ..launcher import terminate
from ..comms import CollectiveConfig
from ..config import ConfigError, SwarmConfig
from ..hostmem import with_huge_pages
from ..job.train import JobConfig
from ..metrics import read_jsonl, read_status
from ..progress import Reporter
from ..sinks import SinkConfig
from .dashboard import PeerView, demo_progress, demo_status, render, summary_table
from .options import AggregationOptions, JobOptions, ModelOptions, RunOptions, StreamingOptions, flags


DEMO_JOB = JobConfig(rounds=8, inner_steps=25)
"""The demo's job: the bundled one, shorter (8 rounds of H=25)."""
DEMO_COMPRESSION = "e3m0"
"""4-bit floats: held-out loss on par with fp16 (docs/BENCHMARKS.md)."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """A demo: a job, the swarm's aggregation settings, and how many peers run it."""

    peers: int = 4
    """Peer processes to run."""
    job: JobConfig = DEMO_JOB
    """What every peer trains (its model, rounds, H, outer optimizer, streaming)."""
    swarm: SwarmConfig = SwarmConfig(round=CollectiveConfig(compression=DEMO_COMPRESSION))
    """Compression and robust aggregation of the swarm (the rest is each peer's own)."""
    timeout: float = 1800.0
    """Seconds before the demo gives up and stops every peer."""

    def __post_init__(self) -> None:
        if not 1 <= self.peers <= 16:
            raise ConfigError(f"peers must be between 1 and 16 on one machine, got {self.peers}")


def peer_device(spec: str, index: int, gpus: int) -> str:
    """The device peer `index` trains on: `--device auto` on a machine with several GPUs spreads the peers over
    them (peer i on GPU i mod gpus) instead of putting every peer on the first; any other choice is every peer's."""
    return f"cuda:{index % gpus}" if spec == "auto" and gpus > 1 else spec


def peer_command(cfg: DemoConfig, index: int, run_id: str, workdir: Path, bootstrap: str | None,
                 sinks: SinkConfig = SinkConfig(), gpus: int = 0) -> list[str]:
    """Peer `index`'s `diloco start/join` command line (each peer logs to TensorBoard and W&B itself); `gpus`:
    how many CUDA GPUs the machine has (`peer_device`)."""
    device = peer_device(cfg.job.device, index, gpus)
    cmd = [sys.executable, "-m", "diloco"]
    cmd += ["join", bootstrap] if bootstrap else ["start"]
    cmd += ["--run-id", run_id, *flags(cfg.job, JobOptions, ModelOptions, RunOptions), *flags(cfg.job.streaming, StreamingOptions), *flags(AggregationOptions.of(cfg.swarm), AggregationOptions),
            *(["--device", device] if device != cfg.job.device else []),
            "--shard", str(index), "--gather-timeout", "30", "--wait-for", str(cfg.peers),
            "--metrics", str(workdir / f"peer{index}.jsonl"), "--status-file", str(workdir / f"peer{index}.status.json"),
            "--address-file", str(workdir / f"peer{index}.addr"), "--verbose",
            *(["--tensorboard", str(Path(sinks.tensorboard).resolve())] if sinks.tensorboard else []),
            *(["--wandb", sinks.wandb] if sinks.wandb else [])]
    return cmd


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()  # 0 without CUDA


def _spawn(cmd: list[str], log_path: Path, secret: str) -> subprocess.Popen[bytes]:
    """A peer process; the swarm secret travels in its environment, never on its command line."""
    log = open(log_path, "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**with_huge_pages(os.environ), "PYTHONUNBUFFERED": "1", "DILOCO_SECRET": secret})


def _views(procs: list[subprocess.Popen[bytes]], workdir: Path) -> list[PeerView]:
    views = []
    for i, p in enumerate(procs):
        st = read_status(workdir / f"peer{i}.status.json") or {}
        views.append(PeerView(index=i, alive=p.poll() is None, exit_code=p.poll(), round=st.get("round", 0),
                              step=st.get("step", 0), loss=st.get("loss"), bytes_sent=st.get("bytes_sent", 0),
                              bytes_received=st.get("bytes_received", 0), done=bool(st.get("done")),
                              utilization=st.get("utilization", (st.get("usage") or {}).get("utilization")),
                              blocked_seconds=st.get("blocked_seconds", (st.get("usage") or {}).get("blocked_seconds")),
                              mean_bps=st.get("mean_bps", (st.get("usage") or {}).get("mean_bandwidth_bytes_per_s")),
                              peak_bps=st.get("peak_bps", (st.get("usage") or {}).get("peak_bandwidth_bytes_per_s"))))
    return views


def summarize(cfg: DemoConfig, workdir: Path, wall: float) -> dict[str, Any]:
    """The demo's summary from every peer's metrics file (pure file reading; unit-testable)."""
    finals, round_seconds = [], []
    for i in range(cfg.peers):
        lines = read_jsonl(workdir / f"peer{i}.jsonl")
        final = next((ln for ln in reversed(lines) if ln.get("event") == "final"), None)
        if final is not None:
            finals.append(final)
        round_seconds += [ln["seconds"] for ln in lines if ln.get("event") == "round" and ln.get("committed")]
    if not finals:
        return {"ok": False, "reason": "no peer finished", "wall_seconds": round(wall, 1)}
    params = finals[0]["params"]
    total_sent = sum(f["bytes_sent"] for f in finals)
    total_steps = sum(f["steps"] for f in finals)
    n = len(finals)
    dp_bytes = int(total_steps * 2 * (n - 1) / n * 4 * params) if n > 1 else 0
    digests = sorted({f["digest"] for f in finals})
    return {
        "ok": len(digests) == 1 and n == cfg.peers,
        "peers_finished": n,
        "rounds": max(f["round"] for f in finals),
        "heldout_loss": finals[0]["eval_loss"],
        "heldout_loss_per_peer": [round(f["eval_loss"], 6) for f in finals],
        "initial_loss_reference": 5.545,  # ln(256): a byte-level model that knows nothing
        "digests_agree": len(digests) == 1,
        "digests": digests,
        "params": params,
        "inner_steps_total": total_steps,
        "bytes_sent_total": total_sent,
        "bytes_received_total": sum(f["bytes_received"] for f in finals),
        "compression": finals[0].get("compression"),  # canonical, every default spelled out (e3m0:0)
        "compression_spec": cfg.swarm.round.compression,  # as the user wrote it (e3m0)
        "bits_per_param_sync": finals[0].get("bits_per_param_sync"),
        "data_parallel_bytes": dp_bytes,
        "reduction_vs_data_parallel": round(dp_bytes / total_sent, 1) if total_sent else None,
        "wall_seconds": round(wall, 1),
        "round_seconds_median": round(statistics.median(round_seconds), 3) if round_seconds else None,
        "streaming": {k: finals[0].get(k) for k in ("fragments", "overlap", "alpha", "outer_overlap")},
        "utilization_per_peer": [f.get("usage", {}).get("utilization") for f in finals],
        "blocked_seconds_per_peer": [f.get("usage", {}).get("blocked_seconds") for f in finals],
        "config": asdict(cfg),
    }


def run_demo(cfg: DemoConfig, *, workdir: Path | None = None, metrics: Path | None = None,
             json_path: Path | None = None, live: bool = True, quiet: bool = False,
             sinks: SinkConfig = SinkConfig()) -> int:
    """Run the demo; the exit code. Progress (`diloco.progress`): the live table and a progress bar on
    a terminal (unless `live` is off), a line per round of the slowest peer elsewhere, nothing when
    `quiet`; the summary table always prints. `sinks`: every peer also logs to TensorBoard (one run per
    peer under the directory) and W&B (one run per peer in the project, grouped by the demo's run id)."""
    from rich.console import Console

    console = Console()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="diloco-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run_id = f"demo-{secrets.token_hex(3)}"
    secret = secrets.token_urlsafe(32)  # a fresh swarm secret per demo, shared through the environment
    streaming = (f", {cfg.job.fragments} fragments ({cfg.job.streaming.pattern}), tau={cfg.job.streaming.overlap}, alpha={cfg.job.streaming.alpha}"
                 if cfg.job.fragments > 1 or cfg.job.streaming.overlap or cfg.job.streaming.alpha else "")
    streaming += f", outer overlap {cfg.job.streaming.outer_overlap}" if cfg.job.streaming.outer_overlap != "none" else ""
    started = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    peak_rss = [0.0] * cfg.peers  # MiB, each peer process with its daemon, sampled every 0.5 s
    rep = Reporter.for_command(quiet=quiet, live=live)
    gpus = _gpus() if cfg.job.device == "auto" else 0
    rep.say(f"diloco demo: {cfg.peers} peers, {cfg.job.rounds} rounds of H={cfg.job.inner_steps}, "
            f"compression {cfg.swarm.round.compression}{streaming}; logs in {workdir}")
    try:
        procs.append(_spawn(peer_command(cfg, 0, run_id, workdir, None, sinks, gpus), workdir / "peer0.log", secret))
        addr_file = workdir / "peer0.addr"
        while not addr_file.exists():
            if procs[0].poll() is not None or time.monotonic() - started > 120:
                console.print(f"[red]peer 0 did not start[/]; its log:\n{_tail(workdir / 'peer0.log')}")
                return 1
            time.sleep(0.2)
        bootstrap = addr_file.read_text().split()[0]
        for i in range(1, cfg.peers):
            procs.append(_spawn(peer_command(cfg, i, run_id, workdir, bootstrap, sinks, gpus), workdir / f"peer{i}.log",
                                secret))
        deadline = started + cfg.timeout
        views = _views(procs, workdir)
        with rep, rep.task("demo", cfg.job.rounds, unit="rounds") as task, \
                rep.show(lambda: render(views, time.monotonic() - started, cfg.job.rounds)):
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.5)
                peak_rss = [max(a, b) for a, b in zip(peak_rss, family_rss_mib([p.pid for p in procs]))]
                views = _views(procs, workdir)
                task.update(demo_progress(views, cfg.job.rounds, cfg.job.inner_steps), status=demo_status(views, cfg.job.rounds))
    except KeyboardInterrupt:
        console.print("interrupted: asking every peer to leave")
    finally:
        terminate(procs, 15.0)
    wall = time.monotonic() - started
    summary = summarize(cfg, workdir, wall)
    summary["peak_rss_mib_per_peer"] = [round(m, 1) for m in peak_rss]  # process + its p2pd daemon
    summary["workdir"] = str(workdir)
    if metrics:
        with open(metrics, "a", encoding="utf-8") as out:
            for i in range(cfg.peers):
                for line in read_jsonl(workdir / f"peer{i}.jsonl"):
                    out.write(json.dumps(line, sort_keys=True) + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2) + "\n")
    console.print(summary_table(summary))
    bad = [i for i, p in enumerate(procs) if p.returncode not in (0, None)]
    for i in bad:
        console.print(f"[red]peer {i} exited with {procs[i].returncode}[/]; last log lines:\n{_tail(workdir / f'peer{i}.log')}")
    return 0 if summary.get("ok") and not bad else 1


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
