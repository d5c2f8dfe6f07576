"""Benchmark: a torchrun site as one worker (`diloco bench site`).

Three figures, each from real processes on this machine (CPU, gloo, 127.0.0.1):

1. **Inner-step overhead of the wrapper in a K-rank site.** The same DDP (or, `sharding="fsdp"`,
   FSDP2) loop (an MLP big enough for a step to take milliseconds) under `torchrun --nproc-per-node K`, bare and with `DiLoCo` (no
   swarm: the hook, the slot decisions broadcast inside the site, the outer step): mean wall time per
   inner step, over every step including the synchronization slots.
2. **WAN bytes per round of a K-rank site vs a 1-process peer.** Two launched sites (`diloco start
   -- torchrun ...`, `diloco join ADDR -- python ...`) train together; each site's peer reports the
   bytes it sent per committed round.
3. **Crash to first committed round.** In that swarm, rank 1 of the K-rank site is SIGKILLed; the
   launcher restarts the site (`--max-restarts 1`), which rejoins and catches up: the seconds from
   the kill to its first committed round after the restart.

The worker half runs as `python -m diloco.bench.site worker ...` (under torchrun or the launcher).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ..launcher import terminate
from ..metrics import read_jsonl


@dataclass(frozen=True)
class SiteSetup:
    ranks: int = 2
    width: int = 512
    """Hidden width of the benchmark MLP (4 layers): sets how long an inner step takes."""
    inner_steps: int = 20
    steps: int = 200
    """Inner steps timed per overhead run (after warm-up)."""
    rounds_before_crash: int = 3
    sharding: str = "ddp"
    """How the site holds the model: "ddp" (a replica per rank) or "fsdp" (FSDP2 shards)."""
    repeats: int = 3
    """Overhead runs of each kind, interleaved; the median counts."""


def _torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]


def worker(argv: list[str]) -> None:
    """One rank of the benchmark loop; rank 0 writes the timings to --out."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import diloco

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["bare", "diloco"], required=True)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--sharding", choices=["ddp", "fsdp"], default="ddp")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    w = args.width
    model: torch.nn.Module = torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(w, w), torch.nn.GELU())),
                                                 torch.nn.Linear(w, 1))
    if distributed and args.sharding == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.children():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif distributed:
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank + 1)
    x, y = torch.randn(32, w, generator=g), torch.randn(32, 1, generator=g)
    times: list[float] = []

    def step() -> None:
        started = time.perf_counter()
        torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - started)

    total = args.warmup + args.steps
    if args.mode == "bare":
        for _ in range(total):
            step()
        result: dict[str, Any] = {}
    else:
        with diloco.DiLoCo(model, opt, inner_steps=args.inner_steps) as d:
            while d.steps < total:
                step()
        result = {"rounds": d.round, "digest": d.digest}
    timed = times[args.warmup:]
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps({"mode": args.mode, "ranks": dist.get_world_size() if distributed else 1,
                                              "steps": len(timed), "mean_step_s": sum(timed) / len(timed),
                                              "params": sum(p.numel() for p in model.parameters()), **result}))
    if distributed:
        dist.destroy_process_group()


def _overhead(setup: SiteSetup, workdir: Path, tick: Tick = lambda *_: None) -> dict[str, Any]:
    """Bare and with DiLoCo, interleaved `setup.repeats` times (one run of a few seconds is at the mercy of
    whatever else the machine does); the median run of each."""
    runs: dict[str, list[dict[str, Any]]] = {"bare": [], "diloco": []}
    kind = setup.sharding.upper()
    env = {name: v for name, v in os.environ.items() if not name.startswith("DILOCO_")}
    for k in range(2 * setup.repeats):
        mode = ("bare", "diloco")[k % 2]
        what = f"bare {kind}" if mode == "bare" else f"{kind} with DiLoCo"
        tick(k / setup.repeats, STAGES, f"inner-step overhead, {what} ({k // 2 + 1} of {setup.repeats})")
        path = workdir / f"{mode}-{k}.json"
        subprocess.run([*_torchrun(setup.ranks), "-m", "diloco.bench.site", "worker", "--mode", mode,
                        "--width", str(setup.width), "--inner-steps", str(setup.inner_steps), "--steps",
                        str(setup.steps), "--out", str(path), "--sharding", setup.sharding], check=True,
                       env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=600)
        runs[mode].append(json.loads(path.read_text()))
    out: dict[str, Any] = {mode: sorted(r, key=lambda x: x["mean_step_s"])[len(r) // 2] for mode, r in runs.items()}
    out["runs_s"] = {mode: [x["mean_step_s"] for x in r] for mode, r in runs.items()}
    out["overhead"] = out["diloco"]["mean_step_s"] / out["bare"]["mean_step_s"] - 1
    return out


Tick = Callable[[float, float | None, str | None], None]
"""(done, total, status): the benchmark's stages done (fractional while the sites train together)."""
STAGES = 4
"""Overhead bare, overhead with DiLoCo, the two sites training together, the crashed site's restart."""


def _swarm(setup: SiteSetup, workdir: Path, say: Callable[[str], None],
           tick: Tick = lambda *_: None) -> dict[str, Any]:
    """Two launched sites (K ranks, 1 process); the K-rank site loses rank 1 mid-run."""
    env = {**os.environ, "DILOCO_SECRET": secrets.token_urlsafe(32), "OMP_NUM_THREADS": "1"}
    run_id = f"bench-site-{secrets.token_hex(3)}"
    common = ["--run-id", run_id, "--gather-timeout", "20", "--round-timeout", "10", "--wait-for", "2"]
    loop = ["-m", "diloco.bench.site", "worker", "--mode", "diloco", "--width", str(setup.width),
            "--inner-steps", str(setup.inner_steps), "--steps", "1000000", "--warmup", "0", "--sharding", setup.sharding]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        site = workdir / "site.jsonl"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "diloco", "start", *common, "--max-restarts", "1", "--metrics", str(site),
             "--address-file", str(workdir / "site.addr"), "--", *_torchrun(setup.ranks), *loop],
            env=env, stdout=subprocess.DEVNULL, stderr=open(workdir / "site.log", "wb")))
        addr = _wait(lambda: (workdir / "site.addr").exists() and (workdir / "site.addr").read_text().split(),
                     180, "the site's address")[0]
        lone = workdir / "lone.jsonl"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "diloco", "join", addr, *common, "--metrics", str(lone), "--",
             sys.executable, *loop], env=env, stdout=subprocess.DEVNULL, stderr=open(workdir / "lone.log", "wb")))

        def together(path: Path) -> list[dict[str, Any]]:
            return [r for r in read_jsonl(path) if r.get("event") == "round" and r.get("committed")
                    and r.get("peers") == 2]

        def enough() -> bool:
            done = len(together(site))
            tick(2 + min(1.0, done / setup.rounds_before_crash), STAGES,
                 f"sites training together: round {done}/{setup.rounds_before_crash}")
            return done >= setup.rounds_before_crash

        _wait(enough, 300, "rounds of both sites together")
        say("killing rank 1 of the site")
        tick(3, STAGES, "rank 1 killed: waiting for the restarted site's first round")
        victim = _rank_process(procs[0].pid, "1")
        crashed = time.time()
        os.kill(victim, signal.SIGKILL)
        # rank 0 may still finish the round it was in: what counts is a round of the restarted site
        _wait(lambda: [r for r in together(site) if r.get("restart", 0) >= 1], 300, "the restarted site's first round")
        back = min(r["time"] for r in together(site) if r.get("restart", 0) >= 1)
        bytes_site = [r["bytes_sent"] for r in together(site) if r["time"] < crashed]
        bytes_lone = [r["bytes_sent"] for r in together(lone) if r["time"] < crashed]
        payload = sorted({r["payload_bytes"] for r in together(site)})
        return {"crash_to_commit_s": back - crashed, "site_bytes_per_round": sorted(bytes_site)[len(bytes_site) // 2],
                "lone_bytes_per_round": sorted(bytes_lone)[len(bytes_lone) // 2], "payload_bytes": payload}
    finally:
        terminate(procs)


def rank_pids(launcher: int) -> dict[int, int]:
    """The pid of each rank's process among the launcher's descendants (`procmem.family`), by the `RANK` torchrun
    gives it (a rank's p2pd daemon inherits its environment, and is left out); empty while the command is
    (re)starting."""
    from ..peers.reaper import environ, pid_alive
    from .procmem import family, named

    tree = family(launcher)[1:]
    daemons = set(named(tree, "p2pd"))
    out: dict[int, int] = {}
    for pid in sorted(tree):
        rank = environ(pid).get("RANK", "")
        if rank.isdigit() and pid not in daemons and pid_alive(pid):
            out.setdefault(int(rank), pid)
    return out


def _rank_process(launcher: int, rank: str) -> int:
    """The pid of rank `rank` among the launcher's descendants."""
    pid = rank_pids(launcher).get(int(rank))
    if pid is None:
        raise RuntimeError(f"no rank {rank} found under launcher {launcher}")
    return pid


def _wait(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def run(setup: SiteSetup, say: Callable[[str], None] = lambda s: None, tick: Tick = lambda *_: None) -> dict[str, Any]:
    """The benchmark; `say` gets a line per stage, `tick(done, total, status)` how far it is."""
    with tempfile.TemporaryDirectory(prefix="diloco-bench-site-") as tmp:
        workdir = Path(tmp)
        say(f"inner-step overhead: {setup.steps} {setup.sharding.upper()} steps on {setup.ranks} ranks, bare and "
            "with DiLoCo")
        overhead = _overhead(setup, workdir, tick)
        say(f"a {setup.ranks}-rank site and a lone process train together; then rank 1 of the site is killed")
        tick(2, STAGES, "starting the two sites")
        swarm = _swarm(setup, workdir, say, tick)
        tick(STAGES, STAGES, "done")
    return {"setup": asdict(setup), "overhead": overhead, "swarm": swarm}


def markdown(result: dict[str, Any]) -> str:
    o, s, k = result["overhead"], result["swarm"], result["setup"]["ranks"]
    kind = result["setup"].get("sharding", "ddp").upper()
    return "\n".join([
        "| figure | value |", "|---|---|",
        f"| inner step, {k}-rank {kind}, bare | {1e3 * o['bare']['mean_step_s']:.2f} ms |",
        f"| inner step, {k}-rank {kind}, with DiLoCo (H={result['setup']['inner_steps']}, no swarm) | "
        f"{1e3 * o['diloco']['mean_step_s']:.2f} ms ({100 * o['overhead']:+.1f}%) |",
        f"| WAN bytes sent per round, {k}-rank site | {s['site_bytes_per_round']:,} B |",
        f"| WAN bytes sent per round, 1-process peer | {s['lone_bytes_per_round']:,} B |",
        f"| encoded Δ per round (payload), site | {', '.join(f'{p:,}' for p in s['payload_bytes'])} B |",
        f"| site crash (SIGKILL of rank 1) to its first committed round after the restart | "
        f"{s['crash_to_commit_s']:.1f} s |",
    ])


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m diloco.bench.site worker ...; the benchmark itself: diloco bench site")
