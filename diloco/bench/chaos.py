"""Benchmark: a real swarm under random faults for a while, against the same swarm undisturbed
(`diloco bench chaos`).

`workers` peers of the bundled job (`diloco start` / `diloco join` processes on 127.0.0.1, one secret, each with
an identity file and a checkpoint directory of its own, a checkpoint every round) train for `seconds`. A fault
injector seeded with `seed` picks a fault about every `every` seconds (`plan`) among `kinds`:

- `kill`: SIGKILL a running worker; `restart_after` seconds later it comes back under the same identity from its
  checkpoint (`--resume`), joining through the live workers' addresses, as a supervisor would restart it;
- `stop`: SIGSTOP a running worker for `stop_seconds` (drawn between the two bounds), then SIGCONT;
- `leave`: Ctrl-C (SIGINT) a worker, which leaves for good (the swarm shrinks);
- `join`: a new worker (a new identity) joins the swarm.

A fault that finds no worker to hit (every one down or stopped) is skipped and counted as such. When the time is
up, every stopped worker is continued, every killed one restarted, the swarm gets `heal` seconds, and every
worker is stopped with SIGTERM (each finishes its round and leaves). Then the same number of workers runs as long
without faults, the baseline.

From the workers' metrics lines (`report`): faults by kind; rounds committed against the baseline (goodput);
per fault, the time from the fault to the swarm's next commit and to the faulty worker's next committed round
(its return), p50 and p99 by kind; stalls (gaps between commits longer than `stall` seconds); forks (a round
committed, or downloaded, with two digests: must be 0); every worker's exit status; the held-out loss the
workers end on against the baseline's.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..metrics import read_jsonl

KINDS = ("kill", "stop", "leave", "join")
DEFAULT_KINDS = ("kill", "stop")
TINY_JOB = ("--d-model", "64", "--layers", "2", "--batch-size", "8", "-H", "10")
"""The bundled model at width 64 with H = 10: rounds of about half a second on this machine's CPUs."""


@dataclass(frozen=True)
class ChaosSetup:
    workers: int = 5
    seconds: float = 300.0
    """How long the faults go on (and the baseline runs)."""
    every: float = 10.0
    """Mean seconds between two faults (drawn uniformly between half and one and a half of it)."""
    seed: int = 0
    kinds: tuple[str, ...] = DEFAULT_KINDS
    restart_after: float = 2.0
    """Seconds a killed worker stays down before it is restarted."""
    stop_seconds: tuple[float, float] = (1.0, 20.0)
    heal: float = 15.0
    """Seconds the swarm gets after the last fault, everyone back, before it is stopped."""
    stall: float = 3.0
    """A gap between two commits longer than this is a stall."""
    job: tuple[str, ...] = TINY_JOB
    """Flags of the bundled job every worker runs (model, H, timeouts)."""
    baseline: bool = True


@dataclass(frozen=True)
class Fault:
    at: float
    """Seconds after the faults begin."""
    kind: str
    pick: float
    """Which worker, as a fraction of those the fault can hit at that moment (drawn in advance: the plan does
    not depend on how the run goes)."""
    seconds: float = 0.0
    """How long a `stop` lasts."""


def plan(setup: ChaosSetup) -> list[Fault]:
    """The faults of a run, from its seed alone: about one every `every` seconds until `seconds`."""
    rng = random.Random(setup.seed)
    faults: list[Fault] = []
    at = 0.0
    while True:
        at += rng.uniform(0.5 * setup.every, 1.5 * setup.every)
        if at >= setup.seconds:
            return faults
        kind = rng.choice(setup.kinds)
        faults.append(Fault(at, kind, rng.random(), rng.uniform(*setup.stop_seconds) if kind == "stop" else 0.0))


# ---------------------------------------------------------------------------------------------- what the lines say

Lines = list[dict[str, Any]]


def commits(lines: Sequence[Lines]) -> list[tuple[float, int]]:
    """(time, round) of every round the swarm committed, at the first worker that wrote it, in order."""
    first: dict[int, float] = {}
    for worker in lines:
        for ln in worker:
            if ln.get("event") == "round" and ln.get("committed") and not ln.get("merge"):
                first[ln["round"]] = min(first.get(ln["round"], ln["time"]), ln["time"])
    return sorted((t, r) for r, t in first.items())


def forks(lines: Sequence[Lines]) -> dict[int, list[str]]:
    """Rounds held with more than one digest: committed by two workers on different states, or a state
    downloaded for a round that another worker committed otherwise (and the final lines' rounds). Must be empty."""
    held: dict[int, set[str]] = {}
    for worker in lines:
        for ln in worker:
            if ln.get("digest") and ((ln.get("event") == "round" and (ln.get("committed") or ln.get("resynced")))
                                     or ln.get("event") == "final"):
                held.setdefault(ln["round"], set()).add(ln["digest"])
    return {r: sorted(d) for r, d in sorted(held.items()) if len(d) > 1}


def stalls(times: Sequence[float], longer_than: float) -> list[float]:
    """Gaps between consecutive times (commits, between the window's start and end) longer than `longer_than`
    seconds."""
    return [b - a for a, b in zip(times, times[1:]) if b - a > longer_than]


def quantile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of `values`, None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class Hit:
    """A fault as it was applied: to whom, when (wall clock), and when it ended (the worker back or continued)."""
    kind: str
    worker: int
    at: float
    ended: float | None = None
    skipped: bool = False


def recovery(hits: Sequence[Hit], commit_times: Sequence[float], lines: Sequence[Lines],
             start: float = 0.0) -> list[dict[str, Any]]:
    """Per applied fault: when (`at`, seconds after `start`), seconds from it to the swarm's next commit, and to the
    faulty worker's next committed round after the fault ended (None where that never came: a worker that left,
    or the run ended first)."""
    out = []
    for h in hits:
        if h.skipped:
            continue
        nxt = next((t for t in commit_times if t > h.at), None)
        back = None
        if h.kind in ("kill", "stop", "join") and h.worker < len(lines):
            since = h.ended if h.ended is not None else h.at
            back = next((ln["time"] for ln in lines[h.worker] if ln.get("event") == "round" and ln.get("committed")
                         and ln["time"] > since), None)
        out.append({"kind": h.kind, "worker": h.worker, "at": round(h.at - start, 2),
                    "to_next_commit": None if nxt is None else nxt - h.at,
                    "to_return": None if back is None else back - h.at})
    return out


def summary(setup: ChaosSetup, hits: Sequence[Hit], lines: Sequence[Lines], window: tuple[float, float],
            exits: Sequence[int | None], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """The report of one run (`baseline`: the undisturbed run's own summary, or None)."""
    start, end = window
    times = [t for t, _ in commits(lines)]
    inside = [t for t in times if start <= t <= end]
    rec = recovery(hits, times, lines, start)
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted({h.kind for h in hits}):
        mine = [r for r in rec if r["kind"] == kind]
        nxt = [r["to_next_commit"] for r in mine if r["to_next_commit"] is not None]
        back = [r["to_return"] for r in mine if r["to_return"] is not None]
        by_kind[kind] = {"applied": len(mine), "skipped": sum(h.skipped for h in hits if h.kind == kind),
                         "to_next_commit_p50": quantile(nxt, 0.5), "to_next_commit_p99": quantile(nxt, 0.99),
                         "to_return_p50": quantile(back, 0.5), "to_return_p99": quantile(back, 0.99),
                         "returned": len(back)}
    gaps = stalls([start, *inside, end], setup.stall)  # a swarm that stopped committing stalls to the window's end
    finals = [next((ln for ln in reversed(w) if ln.get("event") == "final"), None) for w in lines]
    losses = [f["eval_loss"] for f in finals if f and f.get("eval_loss") is not None]
    report: dict[str, Any] = {
        "setup": {**asdict(setup), "kinds": list(setup.kinds), "job": list(setup.job)},
        "faults": by_kind, "faults_applied": sum(not h.skipped for h in hits),
        "rounds_committed": len(inside), "rounds_per_minute": 60 * len(inside) / max(1e-9, end - start),
        "stalls": len(gaps), "stalled_seconds": round(sum(gaps), 2), "longest_stall": max(gaps, default=0.0),
        "forks": forks(lines), "workers": len(lines), "exits": list(exits),
        "final_rounds": [f["round"] if f else None for f in finals],
        "eval_loss_mean": statistics.fmean(losses) if losses else None,
        "recovery": rec,
    }
    if baseline is not None:
        report["baseline"] = {k: baseline[k] for k in ("rounds_committed", "rounds_per_minute", "eval_loss_mean",
                                                       "stalls", "stalled_seconds", "forks", "exits")}
        report["goodput"] = report["rounds_per_minute"] / max(1e-9, baseline["rounds_per_minute"])
    return report


# ---------------------------------------------------------------------------------------------- running it


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    state: str = "up"  # up, stopped, down (killed, to restart), gone (left)
    until: float = 0.0
    restarts: int = 0
    exits: list[int] = field(default_factory=list)


class _Swarm:
    """The workers' processes: started, faulted, restarted and stopped, each writing its metrics lines."""

    def __init__(self, setup: ChaosSetup, workdir: Path, tag: str) -> None:
        self.setup, self.workdir, self.tag = setup, workdir, tag
        self.run_id = f"chaos-{tag}-{secrets.token_hex(3)}"
        self.env = {**os.environ, "DILOCO_SECRET": secrets.token_urlsafe(32), "OMP_NUM_THREADS": "1"}
        self.workers: list[_Worker] = []
        self.logs: list[Any] = []
        self.open: dict[int, Hit] = {}
        """The fault each worker is under (killed or stopped), until it is back."""

    def path(self, i: int, what: str) -> Path:
        return self.workdir / f"{self.tag}-w{i}.{what}"

    def addresses(self, but: int) -> list[str]:
        """Addresses of the workers that are up (the others' last known, if none is)."""
        live = [w.index for w in self.workers if w.index != but and w.state == "up"]
        known = live or [w.index for w in self.workers if w.index != but]
        out: list[str] = []
        for i in known:
            p = self.path(i, "addr")
            if p.exists():
                out += p.read_text().split()[:1]
        return out

    def spawn(self, i: int, *, resume: bool, wait: bool = False, together: int = 1) -> subprocess.Popen[bytes]:
        """Start worker `i` (the first one starts the swarm; the others join the workers that are up); with
        `wait`, return once it wrote its address; `together`: peers it waits for before its first step."""
        first = i == 0 and not resume and not self.workers
        verb = ["start"] if first else ["join", *self.addresses(i)]
        cmd = [sys.executable, "-m", "diloco", *verb, "--run-id", self.run_id, "--host", "127.0.0.1", "--port", "0",
               *self.setup.job, "--rounds", "1000000", "--shard", str(i), "--identity", str(self.path(i, "key")),
               "--checkpoint-dir", str(self.path(i, "ckpt")), "--checkpoint-every", "1",
               "--metrics", str(self.path(i, "jsonl")), "--address-file", str(self.path(i, "addr"))]
        if resume:
            cmd.append("--resume")
        if together > 1:
            cmd += ["--wait-for", str(together)]
        self.path(i, "addr").unlink(missing_ok=True)
        log = open(self.path(i, "log"), "ab")
        self.logs.append(log)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env)
        deadline = time.monotonic() + 120
        while wait and not self.path(i, "addr").exists():  # the first worker: the others join its address
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {i} did not start (exit {proc.poll()}); see {self.path(i, 'log')}")
            time.sleep(0.1)
        return proc

    def add(self, together: int = 1) -> _Worker:
        i = len(self.workers)
        w = _Worker(i, self.spawn(i, resume=False, wait=i == 0, together=together))
        self.workers.append(w)
        return w

    def back(self, w: _Worker) -> None:
        w.state = "up"
        hit = self.open.pop(w.index, None)
        if hit is not None:
            hit.ended = time.time()

    def tick(self, now: float) -> None:
        """Bring back what is due: continue stopped workers, restart killed ones."""
        for w in self.workers:
            if w.state == "stopped" and now >= w.until:
                w.proc.send_signal(signal.SIGCONT)
                self.back(w)
            elif w.state == "down" and now >= w.until:
                w.proc = self.spawn(w.index, resume=True)
                w.restarts += 1
                self.back(w)

    def apply(self, fault: Fault, hit: Hit) -> None:
        """Apply `fault` (its target among the workers it can hit now); `hit` records what happened."""
        now = time.monotonic()
        if fault.kind == "join":
            w = self.add()
            hit.worker, hit.ended = w.index, time.time()
            return
        # a worker still starting (no address written yet) is not in the swarm: a Ctrl-C then only interrupts its
        # imports (it dies of SIGINT), which is not what these faults measure
        up = [w for w in self.workers if w.state == "up" and self.path(w.index, "addr").exists()]
        if fault.kind == "leave" and len(up) <= 2:
            up = []  # the last two stay: a swarm of one measures nothing
        if not up:
            hit.skipped = True
            return
        w = up[min(len(up) - 1, int(fault.pick * len(up)))]
        hit.worker = w.index
        if fault.kind in ("kill", "stop"):
            self.open[w.index] = hit
        if fault.kind == "kill":
            w.proc.kill()
            w.exits.append(w.proc.wait())
            w.state, w.until = "down", now + self.setup.restart_after
        elif fault.kind == "stop":
            w.proc.send_signal(signal.SIGSTOP)
            w.state, w.until = "stopped", now + fault.seconds
        elif fault.kind == "leave":
            w.proc.send_signal(signal.SIGINT)
            w.state = "gone"

    def end(self) -> list[int | None]:
        """Everyone back, then SIGTERM: each finishes its round and leaves. The last exit status of each."""
        for w in self.workers:
            if w.state == "stopped":
                w.proc.send_signal(signal.SIGCONT)
        for w in self.workers:
            if w.state != "down" and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        out: list[int | None] = []
        for w in self.workers:
            if w.state == "down":
                out.append(w.exits[-1] if w.exits else None)
                continue
            try:
                out.append(w.proc.wait(90))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                out.append(w.proc.wait())
        return out

    def kill_all(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
                w.proc.kill()
                w.proc.wait()
        for log in self.logs:
            log.close()

    def lines(self) -> list[Lines]:
        return [read_jsonl(self.path(w.index, "jsonl")) if self.path(w.index, "jsonl").exists() else []
                for w in self.workers]


def _one(setup: ChaosSetup, workdir: Path, tag: str, faults: Sequence[Fault], baseline: dict[str, Any] | None,
         progress: Callable[[str], None], tick: Callable[[float, float | None, str | None], None]) -> dict[str, Any]:
    swarm = _Swarm(setup, workdir, tag)
    hits: list[Hit] = []
    try:
        for _ in range(setup.workers):
            swarm.add(together=setup.workers)  # the first round has everyone: its members are the swarm
        deadline = time.monotonic() + 180
        while not commits(swarm.lines()):  # the swarm trains: the clock starts
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {tag} swarm committed no round in 180 s; see the logs in {workdir}")
            time.sleep(0.2)
        begun, start = time.monotonic(), time.time()
        pending = list(faults)
        while (now := time.monotonic()) < begun + setup.seconds:
            swarm.tick(now)
            while pending and now >= begun + pending[0].at:
                fault = pending.pop(0)
                hit = Hit(fault.kind, -1, time.time())
                swarm.apply(fault, hit)
                hits.append(hit)
                progress(f"{tag} {now - begun:5.1f}s {fault.kind} worker {hit.worker}"
                         + (" (skipped: nobody to hit)" if hit.skipped else ""))
            tick(now - begun, setup.seconds, tag)
            time.sleep(0.1)
        end = time.time()
        for w in swarm.workers:  # everyone back, then a while to heal before the end
            w.until = 0.0
        swarm.tick(time.monotonic())
        time.sleep(setup.heal)
        exits = swarm.end()
    finally:
        swarm.kill_all()
    return summary(setup, hits, swarm.lines(), (start, end), exits, baseline)


def run(setup: ChaosSetup, workdir: Path, progress: Callable[[str], None] = print,
        tick: Callable[[float, float | None, str | None], None] = lambda d, t, s: None) -> dict[str, Any]:
    """The baseline (unless `setup.baseline` is off), then the run under faults; the latter's report, the
    baseline's figures in it."""
    workdir.mkdir(parents=True, exist_ok=True)
    baseline = _one(setup, workdir, "baseline", [], None, progress, tick) if setup.baseline else None
    if baseline is not None:
        progress(f"baseline: {baseline['rounds_committed']} rounds in {setup.seconds:g} s")
    return _one(setup, workdir, "chaos", plan(setup), baseline, progress, tick)


def markdown(report: dict[str, Any]) -> str:
    s = report["setup"]

    def sec(x: float | None) -> str:
        return "–" if x is None else f"{x:.1f}"

    def loss(x: float | None) -> str:  # none when no worker wrote a final line (one had to be killed)
        return "–" if x is None else f"{x:.4f}"

    rows = ["| fault | applied | skipped | to the next commit p50 / p99 (s) | to the worker's return p50 / p99 (s) |",
            "|---|---|---|---|---|"]
    for kind, f in report["faults"].items():
        rows.append(f"| {kind} | {f['applied']} | {f['skipped']} | {sec(f['to_next_commit_p50'])} / "
                    f"{sec(f['to_next_commit_p99'])} | {sec(f['to_return_p50'])} / {sec(f['to_return_p99'])} |")
    base = report.get("baseline")
    lines = [*rows, "",
             f"{s['workers']} workers, {s['seconds']:g} s, a fault every ~{s['every']:g} s (seed {s['seed']}): "
             f"{report['rounds_committed']} rounds committed ({report['rounds_per_minute']:.1f}/min)"
             + (f" against {base['rounds_committed']} undisturbed: goodput **{100 * report['goodput']:.0f}%**"
                if base else "")
             + f"; {report['stalls']} stalls over {s['stall']:g} s ({report['stalled_seconds']:.0f} s in all, the "
               f"longest {report['longest_stall']:.1f} s); forks: **{len(report['forks'])}**; exit statuses "
               f"{report['exits']}; held-out loss {loss(report['eval_loss_mean'])}"
             + (f" (undisturbed {loss(base['eval_loss_mean'])})" if base else "") + "."]
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
