"""Benchmark: the sync path at hundreds of millions of parameters (`diloco bench size`).

Real peers (`diloco start/join -- python -m diloco.bench.size worker ...`, each with its own libp2p
daemon) hold a model of P fp32 parameters. Their inner step is a cheap stand-in (an SGD step with a
fixed gradient): what is measured is the synchronization path, not the model.

1. **Rounds at size** (loopback): 2 peers, for each size and codec: the median round time (from the
   round's start to its outcome), bytes each peer sent per round, and each peer's peak resident
   memory beyond its model and gradients (the worker reads its resident memory before it attaches
   the wrapper and its peak at the end; the daemon's is reported beside it).
2. **Catching up from 1, 2 and 3 peers** (emulated WAN, root): k serving peers train in network
   namespaces whose uplinks are limited to `rate` (diloco.bench.wan.WanLab); a joiner then downloads their
   state (`diloco.statesync`: chunks from every holder at once); its download time for k = 1, 2, 3.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ..launcher import terminate
from . import procmem

PIECE = 1 << 24  # parameters per tensor of the benchmark model (16M: like a large linear layer)


@dataclass(frozen=True)
class SizeSetup:
    sizes: tuple[int, ...] = (10_000_000, 30_000_000, 100_000_000, 300_000_000)
    codecs: tuple[str, ...] = ("fp32", "e3m0")
    rounds: int = 3
    inner_steps: int = 4
    catchup_params: int = 25_000_000
    """Model size for the catch-up part (its state, with momentum, is 8 bytes a parameter)."""
    rate_mbit: float = 200.0
    """Uplink of every host in the catch-up part."""
    delay_ms: float = 20.0
    servers: tuple[int, ...] = (1, 2, 3)
    catchup: bool = True


def _rss_kib(pid: int) -> int:
    """Resident memory of `pid` now, KiB (`diloco.bench.procmem`: psutil, or /proc without it)."""
    return round(procmem.rss_mib([pid]) * 1024)


def worker(argv: list[str]) -> None:
    """One peer: a model of --params fp32 parameters trained by a stand-in step under DiLoCo (the swarm
    from the launcher's environment) until the global round reaches --rounds; writes a JSON summary."""
    import torch

    import diloco
    from diloco.comms.dataplane import data_paths

    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=4)
    ap.add_argument("--step-seconds", type=float, default=0.0, help="sleep per inner step (a slower model)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    sizes = [PIECE] * (args.params // PIECE) + ([args.params % PIECE] if args.params % PIECE else [])
    params = [torch.nn.Parameter(torch.full((n,), 0.01)) for n in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-4)  # the stand-in gradient: the inner step is one SGD update
    model = torch.nn.ParameterList(params)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    base = _rss_kib(os.getpid())
    started = time.monotonic()
    with diloco.DiLoCo(model, opt, inner_steps=args.inner_steps) as d:
        while d.round < args.rounds:
            opt.step()
            if args.step_seconds:
                time.sleep(args.step_seconds)
        swarm = d.member.swarm
        paths = data_paths(swarm.transport) if swarm is not None else {}  # how the rounds' calls travelled
    rounds = [r for r in d.reports if r.committed and r.peers > 1]
    Path(args.out).write_text(json.dumps({
        "params": args.params, "base_rss_kib": base, "peak_rss_kib": round(procmem.peak_rss_mib() * 1024),
        "round_seconds": [r.seconds for r in rounds], "bytes_sent": [r.bytes_sent for r in rounds],
        "bytes_received": [r.bytes_received for r in rounds], "peers": [r.peers for r in rounds],
        "phases": [r.phases for r in rounds],
        "rounds": d.round, "wall_s": time.monotonic() - started, "resyncs": sum(r.resynced for r in d.reports),
        "paths": sorted(paths),
    }))


def launch_peer(verb: list[str], run_id: str, common: list[str], worker_args: list[str], workdir: Path, name: str,
                env: dict[str, str], popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen
                ) -> subprocess.Popen[bytes]:
    """`diloco VERB ... -- python -m diloco.bench.size worker WORKER_ARGS` with its log and JSON summary named
    `name` in `workdir`."""
    cmd = [sys.executable, "-m", "diloco", *verb, "--run-id", run_id, *common, "--address-file",
           str(workdir / f"{name}.addr"), "--", sys.executable, "-m", "diloco.bench.size", "worker", *worker_args,
           "--out", str(workdir / f"{name}.json")]
    return popen(cmd, env=env, stdout=open(workdir / f"{name}.log", "wb"), stderr=subprocess.STDOUT)


def wait_file(path: Path, procs: list[subprocess.Popen[bytes]], timeout: float) -> str:
    """The first word of `path` once it is written (a launcher's address file); raises RuntimeError after
    `timeout` seconds or when one of `procs` failed."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"{path.name} did not appear; see the logs in {path.parent}")
        time.sleep(0.2)
    return path.read_text().split()[0]


def _rounds_at(params: int, codec: str, setup: SizeSetup, say: Callable[[str], None]) -> dict[str, Any]:
    env = {**os.environ, "DILOCO_SECRET": secrets.token_urlsafe(32), "OMP_NUM_THREADS": "1"}
    run_id = f"size-{secrets.token_hex(3)}"
    common = ["--compression", codec, "--wait-for", "2", "--gather-timeout", "120", "--round-timeout", "600"]
    args = ["--params", str(params), "--rounds", str(setup.rounds), "--inner-steps", str(setup.inner_steps)]
    with tempfile.TemporaryDirectory(prefix="diloco-bench-size-") as tmp:
        workdir = Path(tmp)
        procs: list[subprocess.Popen[bytes]] = []
        daemon_peak: dict[int, int] = {}
        try:
            procs.append(launch_peer(["start"], run_id, common, args, workdir, "p0", env))
            addr = wait_file(workdir / "p0.addr", procs, 300)
            procs.append(launch_peer(["join", addr], run_id, common, args, workdir, "p1", env))
            while any(p.poll() is None for p in procs):
                for pid in _daemons_of(procs):
                    daemon_peak[pid] = max(daemon_peak.get(pid, 0), _rss_kib(pid))
                time.sleep(0.5)
            if any(p.returncode for p in procs):
                raise RuntimeError(f"a peer failed at {params:,} parameters ({codec}); logs:\n" +
                                   (workdir / "p1.log").read_text()[-2000:])
            peers = [json.loads((workdir / f"p{i}.json").read_text()) for i in range(2)]
        finally:
            terminate(procs)
    seconds = [s for p in peers for s in p["round_seconds"]]
    extra = [(p["peak_rss_kib"] - p["base_rss_kib"]) * 1024 for p in peers]
    out = {"params": params, "codec": codec, "round_s_median": statistics.median(seconds) if seconds else None,
           "bytes_sent_per_round": statistics.median([b for p in peers for b in p["bytes_sent"]] or [0]),
           "peak_extra_bytes": max(extra), "extra_per_param": max(extra) / params,
           "model_fp32_multiple": max(extra) / (4 * params),
           "daemon_peak_bytes": max(daemon_peak.values(), default=0) * 1024, "rounds_together": len(seconds) // 2}
    say(f"{params:,} parameters, {codec}: round {out['round_s_median']} s, peak extra "
        f"{out['peak_extra_bytes'] / 1e9:.2f} GB ({out['model_fp32_multiple']:.2f}x the model)")
    return out


def _daemons_of(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    return [pid for proc in procs for pid in procmem.named(procmem.family(proc.pid)[1:], "p2pd")]


def _catchup(servers: int, setup: SizeSetup, say: Callable[[str], None]) -> dict[str, Any]:
    """k serving peers in WAN hosts, then a joiner; the joiner's state download time."""
    from .wan import WanLab

    env = {**os.environ, "DILOCO_SECRET": secrets.token_urlsafe(32), "OMP_NUM_THREADS": "1"}
    run_id = f"catchup-{secrets.token_hex(3)}"
    # The servers train slowly and long: one round together, then none while the joiner downloads (a
    # round's Δ of the state's size would share their uplinks with the chunks and measure that instead):
    # an inner step lasts three times the download from one server at the link rate.
    one_server = 8 * 8 * setup.catchup_params / (setup.rate_mbit * 1e6)
    slow = ["--params", str(setup.catchup_params), "--rounds", "1000000", "--inner-steps", "1",
            "--step-seconds", f"{max(10.0, 3 * one_server):.0f}"]
    with tempfile.TemporaryDirectory(prefix="diloco-bench-catchup-") as tmp, \
            WanLab(hosts=servers + 1, rate_mbit=setup.rate_mbit, delay_ms=setup.delay_ms) as lab:
        workdir = Path(tmp)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for i in range(servers):
                common = ["--host", lab.address(i), "--wait-for", str(servers), "--gather-timeout", "60",
                          "--round-timeout", "120", "--verbose"]
                verb = ["start"] if i == 0 else ["join", wait_file(workdir / "s0.addr", procs, 300)]
                procs.append(launch_peer(verb, run_id, common, slow, workdir, f"s{i}", env,
                                     popen=lambda cmd, **kw: lab.popen(i, cmd, **kw)))
            for i in range(servers):
                wait_file(workdir / f"s{i}.addr", procs, 300)
            # a round among all the servers first, so every one of them holds the state the joiner asks for
            deadline = time.monotonic() + 600
            committed = f"peers={servers}"
            while not all(any("event=round_committed" in line and committed in line for line in
                              (workdir / f"s{i}.log").read_text(errors="replace").splitlines())
                          for i in range(servers)):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError(f"the {servers} servers did not commit a round together; see {workdir}")
                time.sleep(0.5)
            joiner = ["--host", lab.address(servers), "--verbose", "--gather-timeout", "60", "--round-timeout", "120"]
            args = ["--params", str(setup.catchup_params), "--rounds", "1", "--inner-steps", "2"]
            j = launch_peer(["join", wait_file(workdir / "s0.addr", procs, 60)], run_id, joiner, args, workdir, "joiner",
                        env, popen=lambda cmd, **kw: lab.popen(servers, cmd, **kw))
            procs.append(j)
            log = workdir / "joiner.log"
            deadline = time.monotonic() + 600
            while "event=state_downloaded" not in (log.read_text(errors="replace") if log.exists() else ""):
                if time.monotonic() > deadline or j.poll() not in (None, 0):
                    raise RuntimeError(f"the joiner did not download the state; its log:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
            m = re.search(r"event=state_downloaded round=\d+ bytes=(\d+) seconds=([\d.]+) sources=(\d+)",
                          log.read_text(errors="replace"))
            assert m is not None
        finally:
            terminate(procs)
    got = {"servers": servers, "bytes": int(m.group(1)), "seconds": float(m.group(2)), "sources": int(m.group(3))}
    got["mbit_s"] = 8 * got["bytes"] / got["seconds"] / 1e6
    say(f"catch-up from {servers} peer(s): {got['bytes'] / 1e6:.0f} MB in {got['seconds']:.1f} s "
        f"({got['mbit_s']:.0f} Mbit/s)")
    return got


def run(setup: SizeSetup, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    rounds = [_rounds_at(n, codec, setup, say) for codec in setup.codecs for n in setup.sizes]
    catchup = [_catchup(k, setup, say) for k in setup.servers] if setup.catchup else []
    return {"setup": asdict(setup), "rounds": rounds, "catchup": catchup}


def markdown(result: dict[str, Any]) -> str:
    lines = ["| parameters | codec | round (median) | bytes sent per round | peak extra memory | × model fp32 | daemon peak |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rounds"]:
        lines.append(f"| {r['params'] / 1e6:.0f}M | {r['codec']} | {r['round_s_median']:.2f} s | "
                     f"{r['bytes_sent_per_round'] / 1e6:,.1f} MB | {r['peak_extra_bytes'] / 1e9:.2f} GB | "
                     f"{r['model_fp32_multiple']:.2f} | {r['daemon_peak_bytes'] / 1e6:.0f} MB |")
    if result["catchup"]:
        s = result["setup"]
        lines += ["", f"Catch-up of a {s['catchup_params'] / 1e6:.0f}M-parameter state, uplinks {s['rate_mbit']:g} "
                  f"Mbit/s, {s['delay_ms']:g} ms:", "", "| serving peers | state | download | rate |", "|---|---|---|---|"]
        one = result["catchup"][0]["seconds"]
        for c in result["catchup"]:
            lines.append(f"| {c['servers']} | {c['bytes'] / 1e6:.0f} MB | {c['seconds']:.1f} s ({one / c['seconds']:.2f}x "
                         f"faster than 1) | {c['mbit_s']:.0f} Mbit/s |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m diloco.bench.size worker ...; the benchmark itself: diloco bench size")
