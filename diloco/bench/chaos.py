"""Benchmark: a real swarm under random faults for a while, against the same swarm undisturbed
(`diloco bench chaos`).

`workers` peers of the bundled job (`diloco start` / `diloco join` processes, each on a host of a WAN lab or, without
`wan`, on 127.0.0.1; one secret, each with an identity file and a checkpoint directory of its own, a checkpoint
every round; with `site_ranks` the last is a torchrun site) train for `seconds`. A fault injector seeded with `seed`
picks a fault about every `every` seconds (`plan`) among `kinds`. The defaults (`ChaosSetup`) are the full soak:
six workers, the last a 2-rank site, on the WAN lab for 20 minutes, a fault of any kind about every 15 s.

- `kill`: SIGKILL a running worker; `restart_after` seconds later it comes back under the same identity from its
  checkpoint (`--resume`), joining through the live workers' addresses, as a supervisor would restart it;
- `stop`: SIGSTOP a running worker for `stop_seconds` (drawn between the two bounds), then SIGCONT;
- `leave`: Ctrl-C (SIGINT) a worker, which leaves for good (the swarm shrinks);
- `join`: a new worker (a new identity) joins the swarm;
- `readonly`: a worker's checkpoint directory becomes read-only (a read-only bind mount over it, in the
  worker's mount namespace) for `outage_seconds`; `full`: it fills up (a tmpfs holding a copy of what is there,
  with a few KiB to spare) for as long;
- `clock`: a worker's wall clock steps `CLOCK_STEP` seconds ahead or behind (as an NTP correction or a VM resumed
  from a snapshot steps it) for `outage_seconds`, then steps back (its process reads the step from a file:
  `comms.faults.step_clock`).

With `wan` every worker runs on a host of its own in a WAN lab (diloco.bench.wan, TUN backend: `rate_mbit` per
host link, `delay_ms` one way), and four more kinds apply to the links:

- `partition`: a random minority (at least one, fewer than half) of the workers that committed the swarm's last
  round is cut off from the others for `outage_seconds` (each side still reaches its own; workers still joining
  stay with the majority);
- `flap`: a worker's link goes down and up three times, 1–3 s each way;
- `lossy`: a worker's link drops 2–20% of its packets for `outage_seconds`;
- `slow`: a worker's packets take 100–500 ms more one way for `outage_seconds`.

With `regions` one more kind applies:

- `repkill`: the next region representative to merge is SIGKILLed right after its merge (within a tick of the
  `event=region_merged role=representative` line of its log: the workers log with `--verbose`; up to
  `REPKILL_WAIT` seconds for one, else the fault is skipped), then restarted as a `kill` is: it may take the merged
  state with it, and no region round may then hold two states.

Cuts compose: two workers talk when no partition or link that is down separates them. A fault that finds no
worker to hit (every one down or stopped; fewer than three up for a partition) is skipped and counted as such. When the time is
up, every stopped worker is continued, every killed one restarted, the swarm gets `heal` seconds, and the whole
run ends (`diloco.ending`: SIGUSR2 to one worker; every worker ends at the round it announces, on one model, with
regions after a last merge). Then the same number of workers runs as long
without faults, the baseline.

From the workers' metrics lines (`report`): faults by kind; rounds committed against the baseline (goodput), and
the rounds and inner steps lost against it;
per fault, the time from the fault to the swarm's next commit and to the faulty worker's next committed round
(its return), p50 and p99 by kind; stalls (gaps between commits longer than `stall` seconds); forks (a round
committed, or downloaded, with two digests: must be 0); rounds a partition's cut-off minority committed while cut off
(it has no quorum: must be 0); crashes (a worker that exited while nothing asked it to: seen at once, not
restarted, since a supervisor's restart would hide the defect; must be 0); every worker's exit status; the
held-out loss the workers end on against the baseline's.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import random
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Sequence

from ..comms.faults import CLOCK_STEP_FILE
from ..lines import write_lines
from ..metrics import read_jsonl
from .wan import WanLab

LINK_KINDS = ("partition", "flap", "lossy", "slow")
"""Faults of the links: they need the WAN lab (`wan`)."""
DISK_KINDS = ("readonly", "full")
"""Faults of a checkpoint directory: they need root (mounts)."""
OUT_KINDS = ("kill", "stop", "leave", "partition", "flap")
"""Faults that take their worker out of the rounds until it is back. The others leave it in them: a clock step (taken
back), a full or read-only checkpoint directory, a lossy or slow link (its rounds go on, slower), a join."""
CLOCK_STEP = 30.0
"""Seconds a `clock` fault steps a worker's wall clock by (ahead or behind)."""
KINDS = ("kill", "stop", "leave", "join", "clock", *DISK_KINDS, *LINK_KINDS)
ROOTLESS_KINDS = tuple(k for k in KINDS if k not in (*DISK_KINDS, *LINK_KINDS))
REGION_KINDS = ("repkill",)
"""Faults of a region's representative: they need `regions`."""
REPKILL_WAIT = 60.0
"""Seconds a `repkill` waits for a representative to finish a merge before it is skipped."""
END_WAIT = 120.0
"""Seconds the workers get to end the run together (the end's margin, a last merge, serving the final state to a
worker still behind) before each still running is stopped with SIGTERM."""
SITE_RESTARTS = 1000
"""The site's launcher starts it again after every kill of a rank (`--max-restarts`): a run never runs out."""
_FLAPS = 3
TINY_JOB = ("--d-model", "64", "--layers", "2", "--batch-size", "8", "-H", "10")
"""The bundled model at width 64 with H = 10: rounds of about half a second on this machine's CPUs."""


@dataclass(frozen=True)
class ChaosSetup:
    """The defaults are the full soak: six workers (five lone processes and a 2-rank torchrun site) on the WAN
    lab's hosts for 20 minutes, a fault of any kind about every 15 s (root: namespaces and mounts). Shorter,
    narrower runs name what they keep (`--no-wan --site-ranks 0 --faults kill,stop`: no root)."""
    workers: int = 6
    seconds: float = 1200.0
    """How long the faults go on (and the baseline runs)."""
    every: float = 15.0
    """Mean seconds between two faults (drawn uniformly between half and one and a half of it)."""
    seed: int = 0
    kinds: tuple[str, ...] = ()
    """The kinds of faults drawn; empty: every kind this setup can apply (the links' only with `wan`)."""
    restart_after: float = 2.0
    """Seconds a killed worker stays down before it is restarted."""
    stop_seconds: tuple[float, float] = (1.0, 60.0)
    outage_seconds: tuple[float, float] = (5.0, 60.0)
    """How long a partition, a lossy or slow link, or a read-only or full disk lasts."""
    wan: bool = True
    """Every worker on a host of its own in a WAN lab (needs root); the link faults need it."""
    rate_mbit: float = 100.0
    delay_ms: float = 25.0
    regions: int = 0
    """Regions of the swarm (worker i in region `r{i mod regions}`, the bundled job's `--region`); 0: flat."""
    gossip: bool = False
    """The swarm gossips (`--topology gossip --compression fp32`, docs/GOSSIP.md): each worker holds its own state,
    so there are no forks to count and a cut-off minority may go on gossiping (both reported as not applying); a
    round counts as committed for the swarm once one group met in it."""
    site_ranks: int = 2
    """The last of the first `workers` is a site of this many ranks (DDP on gloo; `diloco.job.site` under torchrun
    and the launcher, `--max-restarts`) among lone processes; 0: every worker a lone process. A kill SIGKILLs one of
    its ranks (torchrun ends the others, the launcher starts the site again), a stop freezes every rank. At the end
    its ranks stop at the round the run ends at, as every worker does, and the site exits 0 (one still running
    `END_WAIT` seconds after the end was asked gets SIGTERM: torchrun's agent then exits 1)."""

    def __post_init__(self) -> None:
        if not self.kinds:
            object.__setattr__(self, "kinds", KINDS if self.wan else tuple(k for k in KINDS if k not in LINK_KINDS))
        if self.site_ranks < 0:
            raise ValueError(f"--site-ranks {self.site_ranks}: give 1 or more ranks, or 0 for no site")
        if self.gossip and self.regions:
            raise ValueError("gossip and regions are two topologies: give one of them")
        if set(self.kinds) & set(REGION_KINDS) and not self.regions:
            raise ValueError(f"{', '.join(REGION_KINDS)} hit a region's representative: give regions")
        if set(self.kinds) & set(LINK_KINDS) and not self.wan:
            raise ValueError(f"{', '.join(sorted(set(self.kinds) & set(LINK_KINDS)))}: faults of the WAN lab's "
                             "links: give wan (root), or leave them out")
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
    """How long a `stop` lasts, or an outage (a partition, a lossy or slow link, a disk fault); a flap's half
    period."""
    amount: float = 0.0
    """How bad, as a fraction of the kind's range: a partition's size, a link's loss or extra delay."""


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
        pick = rng.random()
        if kind == "stop":
            faults.append(Fault(at, kind, pick, rng.uniform(*setup.stop_seconds)))
        elif kind == "flap":
            faults.append(Fault(at, kind, pick, rng.uniform(1.0, 3.0)))
        elif kind in ("partition", "lossy", "slow", "clock", *DISK_KINDS):
            faults.append(Fault(at, kind, pick, rng.uniform(*setup.outage_seconds), rng.random()))
        else:
            faults.append(Fault(at, kind, pick))


# ---------------------------------------------------------------------------------------------- what the lines say

Lines = list[dict[str, Any]]


def _key(rnd: int, region: str) -> int | str:
    """A round's key: its number in a flat swarm, "region/number" with regions (each region counts its own)."""
    return f"{region}/{rnd}" if region else rnd


def commits(lines: Sequence[Lines], regions: Sequence[str] = ()) -> list[tuple[float, int | str]]:
    """(time, round) of every round the swarm committed, at the first worker that wrote it, in order (with
    `regions`, a region per worker: every region's rounds, keyed "region/round")."""
    first: dict[int | str, float] = {}
    for i, worker in enumerate(lines):
        for ln in worker:
            if ln.get("event") == "round" and ln.get("committed") and not ln.get("merge"):
                k = _key(ln["round"], regions[i] if regions else "")
                first[k] = min(first.get(k, ln["time"]), ln["time"])
    return sorted(((t, r) for r, t in first.items()), key=lambda x: x[0])


def forks(lines: Sequence[Lines], regions: Sequence[str] = ()) -> dict[int | str, list[str]]:
    """Rounds held with more than one digest: committed by two workers on different states, or a state
    downloaded for a round that another worker committed otherwise (and the final lines' rounds). With `regions`,
    per region (a merge is the region round its representative's merge made). Must be empty."""
    held: dict[int | str, set[str]] = {}
    for i, worker in enumerate(lines):
        for ln in worker:
            if ln.get("digest") and ((ln.get("event") == "round" and (ln.get("committed") or ln.get("resynced")))
                                     or ln.get("event") == "final"):
                held.setdefault(_key(ln["round"], regions[i] if regions else ""), set()).add(ln["digest"])
    return {r: sorted(d) for r, d in sorted(held.items(), key=lambda x: str(x[0])) if len(d) > 1}


def final_states(lines: Sequence[Lines], together: Sequence[bool]) -> dict[str, int]:
    """How many of the workers still in the swarm at the end (`together`) ended on each model (the final lines'
    `final_digest`: the parameters each ends on; with regions, after the final merge). One entry: every worker ends
    on the global state."""
    out: dict[str, int] = {}
    for worker, there in zip(lines, together):
        final = next((ln for ln in reversed(worker) if ln.get("event") == "final"), None)
        if there and final is not None and final.get("final_digest"):
            out[final["final_digest"]] = out.get(final["final_digest"], 0) + 1
    return out


def useful_steps(lines: Sequence[Lines], start: float, end: float) -> int:
    """Inner steps that entered a committed round between `start` and `end`, all workers together: each committed
    round line's `round_steps` (the steps its Δ covered, a failed attempt's included: they went with the next).
    Steps a worker took and lost (killed before its round, a round the swarm went on without, a state downloaded
    over its own) are in none."""
    return sum(int(ln.get("round_steps") or 0) for worker in lines for ln in worker
               if ln.get("event") == "round" and ln.get("committed") and not ln.get("merge")
               and start <= ln["time"] <= end)


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
    detail: str = ""
    """What exactly (a partition's workers, a link's loss), for the progress lines."""
    side: tuple[int, ...] = ()
    """A partition's cut-off workers."""


def recovery(hits: Sequence[Hit], commit_times: Sequence[float], lines: Sequence[Lines],
             start: float = 0.0) -> list[dict[str, Any]]:
    """Per applied fault: when (`at`, seconds after `start`), seconds from it to the swarm's next commit, and to the
    faulty worker's next committed round after the fault ended (None where that never came: a worker that left,
    or the run ended first; and for a clock step, whose worker never leaves)."""
    out = []
    applied = [h for h in hits if not h.skipped]
    returns: list[float] = []
    for h in applied:
        back = None
        # a worker whose clock stepped never left: its lines in the second before it reads the swarm's time again
        # carry the stepped time, which would pass for a return 30 s late (tests/test_clock.py checks its rounds)
        if h.kind not in ("leave", "clock") and h.worker < len(lines):
            since = h.ended if h.ended is not None else h.at
            back = next((ln["time"] for ln in lines[h.worker] if ln.get("event") == "round" and ln.get("committed")
                         and ln["time"] > since), None)
        returns.append(float("inf") if back is None else back)
    for h, back in zip(applied, returns):
        nxt = next((t for t in commit_times if t > h.at), None)
        # other workers out of the rounds (not back yet) when this fault came: with them, a round may lack its majority
        others = {w for g, b in zip(applied, returns) if g is not h and g.kind in OUT_KINDS and g.at <= h.at < b
                  for w in (g.side or (g.worker,)) if w != h.worker}
        out.append({"kind": h.kind, "worker": h.worker, "at": round(h.at - start, 2),
                    "to_next_commit": None if nxt is None else nxt - h.at,
                    "to_return": None if back == float("inf") else back - h.at, "others_down": len(others),
                    **({"detail": h.detail} if h.detail else {})})
    return out


CUT_MARGIN = 1.0
"""Seconds after a cut begins during which a commit of the cut-off side still counts as decided before it (the
votes were in; the line is written a moment later)."""


def last_members(lines: Sequence[Lines], before: float) -> set[int]:
    """The workers whose lines committed the last round the swarm committed before time `before` (its quorum's
    members; a region's merges left out); empty before any."""
    done = [(ln["round"], i) for i, worker in enumerate(lines) for ln in worker
            if ln.get("event") == "round" and ln.get("committed") and not ln.get("merge") and ln["time"] < before]
    last = max((r for r, _ in done), default=None)
    return {i for r, i in done if r == last}


def minority(up: Sequence[int], members: Collection[int], pick: float, amount: float) -> frozenset[int] | None:
    """A partition's cut-off side: a minority of the last committed round's `members` that are `up` (the quorum a
    round counts; all of `up` when none is known), from the one `pick` (0..1) points at on, its size rising with
    `amount` (0..1) from one to just under half. None when fewer than three are there to split."""
    among = [i for i in up if i in members] or list(up)
    most = (len(among) - 1) // 2
    if most < 1:
        return None
    size = 1 + min(most - 1, int(amount * most))
    start = min(len(among) - 1, int(pick * len(among)))
    return frozenset(among[(start + k) % len(among)] for k in range(size))


def commits_cut_off(hits: Sequence[Hit], lines: Sequence[Lines]) -> list[dict[str, Any]]:
    """Rounds a partition's cut-off minority committed while cut off (from `CUT_MARGIN` after the cut until it
    healed): a minority has no quorum, so this must be empty. A side is a minority of the workers up when the fault
    cuts it; where it held the majority of the last round the swarm committed before the cut (the workers whose
    lines committed that round: a quorum counts those, not the workers that were joining or catching up), its rounds
    are the swarm's and are not counted."""
    out = []
    for h in hits:
        if h.kind != "partition" or h.skipped or not h.side:
            continue
        members = last_members(lines, h.at)
        if members and 2 * len(members & set(h.side)) > len(members):
            continue
        until = h.ended if h.ended is not None else float("inf")
        for w in h.side:
            for ln in lines[w] if w < len(lines) else []:
                if (ln.get("event") == "round" and ln.get("committed") and not ln.get("merge")
                        and h.at + CUT_MARGIN < ln["time"] < until):
                    out.append({"worker": w, "round": ln["round"], "side": list(h.side)})
    return out


MERGED = b"event=region_merged"
"""A representative's log line as its merge commits (`--verbose`), before its members hold the merged state."""


def merged_in_log(log: Path, offset: int, end: int | None = None) -> bool:
    """Whether a representative's merge line is in `log` between `offset` and `end` bytes (default: its end)."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read() if end is None else f.read(max(0, end - offset))
    except OSError:
        return False
    return any(MERGED in ln and b"role=representative" in ln for ln in text.splitlines())


def region_of(setup: ChaosSetup, worker: int) -> str:
    """Worker `worker`'s region: `r<worker mod setup.regions>` ("" in a flat swarm)."""
    return f"r{worker % setup.regions}" if setup.regions else ""


def region_names(setup: ChaosSetup, workers: int) -> list[str]:
    """Each worker's region; none in a flat swarm."""
    return [region_of(setup, i) for i in range(workers)] if setup.regions else []


def summary(setup: ChaosSetup, hits: Sequence[Hit], lines: Sequence[Lines], window: tuple[float, float],
            exits: Sequence[int | None], baseline: dict[str, Any] | None,
            together: Sequence[bool] | None = None, crashes: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The report of one run (`baseline`: the undisturbed run's own summary, or None; `together`: which workers
    were still in the swarm at the end, default all; `crashes`: workers that exited while nothing asked them to)."""
    start, end = window
    regions = region_names(setup, len(lines))
    times = [t for t, _ in commits(lines, regions)]
    inside = [t for t in times if start <= t <= end]
    rec = recovery(hits, times, lines, start)
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted({h.kind for h in hits}):
        mine = [r for r in rec if r["kind"] == kind]
        nxt = [r["to_next_commit"] for r in mine if r["to_next_commit"] is not None]
        back = [r["to_return"] for r in mine if r["to_return"] is not None]
        alone = [r["to_next_commit"] for r in mine if r["to_next_commit"] is not None and not r["others_down"]]
        by_kind[kind] = {"applied": len(mine), "skipped": sum(h.skipped for h in hits if h.kind == kind),
                         "to_next_commit_p50": quantile(nxt, 0.5), "to_next_commit_p99": quantile(nxt, 0.99),
                         "alone": len(alone), "alone_to_next_commit_p99": quantile(alone, 0.99),
                         "to_return_p50": quantile(back, 0.5), "to_return_p99": quantile(back, 0.99),
                         "returned": len(back)}
    gaps = stalls([start, *inside, end], setup.stall)  # a swarm that stopped committing stalls to the window's end
    finals = [next((ln for ln in reversed(w) if ln.get("event") == "final"), None) for w in lines]
    losses = [f["eval_loss"] for f in finals if f and f.get("eval_loss") is not None]
    report: dict[str, Any] = {
        "setup": {**asdict(setup), "kinds": list(setup.kinds), "job": list(setup.job)},
        "faults": by_kind, "faults_applied": sum(not h.skipped for h in hits),
        "rounds_committed": len(inside), "rounds_per_minute": 60 * len(inside) / max(1e-9, end - start),
        "useful_steps": (steps := useful_steps(lines, start, end)),
        "useful_steps_per_minute": 60 * steps / max(1e-9, end - start),
        "stalls": len(gaps), "stalled_seconds": round(sum(gaps), 2), "longest_stall": max(gaps, default=0.0),
        # gossip: no global state (a round's digests differ by design) and no quorum (a cut-off side gossips on)
        "forks": None if setup.gossip else forks(lines, regions),
        "commits_cut_off": None if setup.gossip else commits_cut_off(hits, lines), "workers": len(lines),
        "final_states": final_states(lines, [True] * len(lines) if together is None else together),
        "exits": list(exits), "window": [start, end],
        "crashes": [{**c, "at": round(c["at"] - start, 2)} for c in crashes],
        "final_rounds": [f["round"] if f else None for f in finals],
        "eval_loss_mean": statistics.fmean(losses) if losses else None,
        "recovery": rec,
    }
    if baseline is not None:
        report["baseline"] = {k: baseline[k] for k in ("rounds_committed", "rounds_per_minute", "eval_loss_mean",
                                                       "stalls", "stalled_seconds", "forks", "exits",
                                                       "final_states", "useful_steps_per_minute")}
        report["goodput"] = report["rounds_per_minute"] / max(1e-9, baseline["rounds_per_minute"])
        # against the undisturbed run over as long (the two windows differ by a fraction of a second)
        minutes = (end - start) / 60
        report["rounds_lost"] = round((baseline["rounds_per_minute"] - report["rounds_per_minute"]) * minutes)
        report["steps_lost"] = round((baseline["useful_steps_per_minute"] - report["useful_steps_per_minute"])
                                     * minutes)
        report["step_goodput"] = report["useful_steps_per_minute"] / max(1e-9, baseline["useful_steps_per_minute"])
    return report


# ---------------------------------------------------------------------------------------------- running it


def sides(hosts: int, cuts: Iterable[frozenset[int]]) -> list[int]:
    """One label per host for the forwarder: two hosts share a label when no cut separates them (each cut: hosts
    cut off from the others)."""
    cuts = list(cuts)
    keys = [tuple(h in c for c in cuts) for h in range(hosts)]
    labels = {k: n for n, k in enumerate(dict.fromkeys(keys))}
    return [labels[k] for k in keys]


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    state: str = "up"  # up, stopped, down (killed, to restart), gone (left), crashed (exited by itself)
    until: float = 0.0
    restarts: int = 0
    exits: list[int] = field(default_factory=list)
    frozen: list[int] = field(default_factory=list)
    """A stopped site's rank processes (the launcher itself runs on)."""

    @property
    def finished(self) -> bool:
        """Out of the run for good: it left, or it crashed."""
        return self.state in ("gone", "crashed")


class _Swarm:
    """The workers' processes: started, faulted, restarted and stopped, each writing its metrics lines; with a
    WAN lab (`lab`), worker i runs on host i."""

    def __init__(self, setup: ChaosSetup, workdir: Path, tag: str, lab: WanLab | None = None) -> None:
        self.setup, self.workdir, self.tag, self.lab = setup, workdir, tag, lab
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        """Faults' next steps and ends: a heap by due time (monotonic)."""
        self.cuts: dict[int, frozenset[int]] = {}
        """The cuts in force (partitions, a flapping link while down), by id: hosts cut off from the others. Two
        cuts compose: hosts reach each other when they are on the same side of every one."""
        self._seq = itertools.count()
        self.run_id = f"chaos-{tag}-{secrets.token_hex(3)}"
        self.env = {**os.environ, "DILOCO_SECRET": secrets.token_urlsafe(32), "OMP_NUM_THREADS": "1"}
        self.workers: list[_Worker] = []
        self.logs: list[Any] = []
        self.open: dict[int, Hit] = {}
        """The fault each worker is under (killed or stopped), until it is back."""
        self.armed: list[tuple[Hit, float]] = []
        """`repkill` faults waiting for a merge, first armed first: (hit, until when (monotonic))."""
        self.stepped: set[int] = set()
        """Workers whose clock a `clock` fault has stepped, until it steps back."""
        self.log_read: dict[int, int] = {}
        """How far each worker's log has been read for merges (while a `repkill` waits): each merge fires one."""
        self.crashes: list[dict[str, Any]] = []
        """Workers whose process exited while nothing asked it to (a defect the run found): not restarted, since a
        supervisor's restart would hide it; each with its exit status and when it was seen."""

    def site(self, i: int) -> bool:
        """Whether worker `i` is the site (`setup.site_ranks`)."""
        return bool(self.setup.site_ranks) and i == self.setup.workers - 1

    def command(self, i: int, verb: list[str], host: str) -> list[str]:
        """Worker `i`'s command line: the bundled job, or (the site) the launcher running it under torchrun."""
        out = [sys.executable, "-m", "diloco", *verb, "--run-id", self.run_id, "--host", host, "--port", "0",
               "--shard", str(i), "--identity", str(self.path(i, "key")), "--checkpoint-dir", str(self.path(i, "ckpt")),
               "--checkpoint-every", "1", "--metrics", str(self.path(i, "jsonl")),
               "--address-file", str(self.path(i, "addr"))]
        if not self.site(i):
            return [*out, *self.setup.job, "--rounds", "1000000"]
        from ..job.site import split_flags

        script, launcher = split_flags(self.setup.job)
        return [*out, *launcher, "--max-restarts", str(SITE_RESTARTS), "--", sys.executable, "-m",
                "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.setup.site_ranks),
                "-m", "diloco.job.site", *script, "--rounds", "1000000"]

    def path(self, i: int, what: str) -> Path:
        return self.workdir / f"{self.tag}-w{i}.{what}"

    def addresses(self, but: int) -> list[str]:
        """Addresses of the workers that are up and wrote one (a worker still starting has none yet)."""
        out: list[str] = []
        for w in self.workers:
            p = self.path(w.index, "addr")
            if w.index != but and w.state == "up" and p.exists():
                out += p.read_text().split()[:1]
        return out

    def spawn(self, i: int, *, resume: bool, wait: bool = False, together: int = 1,
              seed: bool = False) -> subprocess.Popen[bytes]:
        """Start worker `i` (the first one, or a `seed` when nobody else is up, starts the swarm; the others join
        the workers that are up); with `wait`, return once it wrote its address; `together`: peers it waits for
        before its first step."""
        first = seed or (i == 0 and not resume and not self.workers)
        verb = ["start"] if first else ["join", *self.addresses(i)]
        host = self.lab.address(i) if self.lab is not None else "127.0.0.1"
        cmd = self.command(i, verb, host)
        flags: list[str] = []  # before a site's `--`
        if self.setup.regions:
            flags += ["--region", region_of(self.setup, i)]
        if set(self.setup.kinds) & set(REGION_KINDS):
            flags.append("--verbose")  # a representative's merge shows in its log at once (`merged_in_log`)
        if self.setup.gossip:
            flags += ["--topology", "gossip", "--compression", "fp32"]
        if resume and not self.site(i):  # a site's launcher restarts its command from the checkpoint itself
            flags.append("--resume")
        if together > 1:
            flags += ["--wait-for", str(together)]
        cut = cmd.index("--") if "--" in cmd else len(cmd)
        cmd[cut:cut] = flags
        self.path(i, "addr").unlink(missing_ok=True)
        log = open(self.path(i, "log"), "ab")
        self.logs.append(log)
        env = {**self.env, CLOCK_STEP_FILE: str(self.path(i, "clock"))} if "clock" in self.setup.kinds else self.env
        kw: dict[str, Any] = dict(stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        proc = self.lab.popen(i, cmd, **kw) if self.lab is not None else subprocess.Popen(cmd, **kw)
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
        """Bring back what is due: continue stopped workers, restart killed ones (through the workers that are up:
        while none is, a restart waits for one, unless every other worker is down too, when the first of them
        starts the swarm again from its checkpoint), run the faults' due steps and ends."""
        for w in self.workers:
            if w.state == "up" and w.proc.poll() is not None:
                w.state = "crashed"
                self.crashes.append({"worker": w.index, "exit": w.proc.returncode, "at": time.time()})
            if w.state == "stopped" and now >= w.until:
                self._cont(w)
                self.back(w)
            elif w.state == "down" and now >= w.until:
                seed = False
                if not self.addresses(w.index):
                    others = [v for v in self.workers if v.index != w.index and not v.finished]
                    if any(v.state != "down" for v in others) or any(v.index < w.index for v in others):
                        continue  # a worker still starting or stopped comes back first; or a lower one seeds
                    seed = True
                w.proc = self.spawn(w.index, resume=True, seed=seed)
                w.restarts += 1
                self.back(w)
        while self.timers and self.timers[0][0] <= now:
            heapq.heappop(self.timers)[2]()
        if self.armed:
            self._fire(now)

    def _log_size(self, i: int) -> int:
        log = self.path(i, "log")
        return log.stat().st_size if log.exists() else 0

    def _fire(self, now: float) -> None:
        """Each representative that merged since the logs were last read is killed right after its merge, by the
        `repkill` armed first; one that waited `REPKILL_WAIT` for a merge is skipped."""
        up = {w.index: w for w in self.workers if w.state == "up" and self.path(w.index, "addr").exists()}
        for i in range(len(self.workers)):
            read, size = self.log_read.get(i, 0), self._log_size(i)
            self.log_read[i] = size
            if i in up and self.armed and merged_in_log(self.path(i, "log"), read, size):
                hit, _ = self.armed.pop(0)
                hit.worker, hit.at, hit.detail = i, time.time(), "right after its merge"
                self._kill(up[i], hit, now)
        for armed in [a for a in self.armed if now >= a[1]]:
            self.armed.remove(armed)
            armed[0].skipped, armed[0].detail = True, f"no merge within {REPKILL_WAIT:g} s"

    def _kill(self, w: _Worker, hit: Hit, now: float) -> None:
        self.open[w.index] = hit
        w.proc.kill()
        w.exits.append(w.proc.wait())
        w.state, w.until = "down", now + self.setup.restart_after

    def later(self, seconds: float, step: Callable[[], None]) -> None:
        heapq.heappush(self.timers, (time.monotonic() + seconds, next(self._seq), step))

    def finish_faults(self) -> None:
        """Every fault's remaining steps now (the run is over): links healed, disks back; a `repkill` still waiting
        for a merge is skipped."""
        while self.timers:
            heapq.heappop(self.timers)[2]()
        for hit, _ in self.armed:
            hit.skipped, hit.detail = True, "the run ended before the next merge"
        self.armed.clear()

    # ---- link faults (the WAN lab's forwarder)

    def _link_fault(self, fault: Fault, hit: Hit, up: list[_Worker]) -> None:
        assert self.lab is not None
        lab = self.lab
        w = up[min(len(up) - 1, int(fault.pick * len(up)))]
        hit.worker = w.index

        def ended() -> None:
            hit.ended = time.time()

        def undo(step: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                step()
                ended()
            return run

        cut_id = next(self._seq)

        def cut(hosts: frozenset[int] | None) -> None:
            if hosts is None:
                self.cuts.pop(cut_id, None)
            else:
                self.cuts[cut_id] = hosts
            lab.sides(sides(lab.hosts, self.cuts.values()))

        if fault.kind == "partition":  # a minority of the last round's members: a side that cannot commit
            side = minority([u.index for u in up], last_members(self.lines(), time.time()), fault.pick, fault.amount)
            if side is None:
                hit.skipped, hit.detail = True, "too few workers up for a minority"
                return
            cut(side)
            hit.side = tuple(sorted(side))
            hit.detail = f"workers {sorted(side)} cut off for {fault.seconds:.0f} s"
            self.later(fault.seconds, undo(partial(cut, None)))
        elif fault.kind == "flap":
            half = fault.seconds
            hit.detail = f"down/up {_FLAPS} times, {half:.1f} s each way"
            mine = frozenset([w.index])
            cut(mine)
            for k in range(1, 2 * _FLAPS):
                self.later(k * half, partial(cut, None if k % 2 else mine))
            self.later(2 * _FLAPS * half - half, ended)
        elif fault.kind == "lossy":
            p = 0.02 + 0.18 * fault.amount
            lab.loss(w.index, p)
            hit.detail = f"{100 * p:.0f}% loss for {fault.seconds:.0f} s"
            self.later(fault.seconds, undo(partial(lab.loss, w.index, 0.0)))
        elif fault.kind == "slow":
            ms = 100 + 400 * fault.amount
            lab.slow(w.index, ms)
            hit.detail = f"+{ms:.0f} ms one way for {fault.seconds:.0f} s"
            self.later(fault.seconds, undo(partial(lab.slow, w.index, 0.0)))

    # ---- disk faults (mounts over the checkpoint directory, in the worker's mount namespace)

    def _disk_fault(self, fault: Fault, hit: Hit, w: _Worker) -> None:
        pid, ckpt = w.proc.pid, self.path(w.index, "ckpt")
        ckpt.mkdir(parents=True, exist_ok=True)
        ns = ["nsenter", "-t", str(pid), "-m", "--"]
        d = shlex.quote(str(ckpt))
        if fault.kind == "readonly":
            script = f"mount --bind {d} {d} && mount -o remount,bind,ro {d}"
        else:  # room for what is there (tmpfs counts whole pages) and 64 KiB: the next checkpoint does not fit
            used_kib = sum(-(-p.stat().st_size // 4096) * 4 for p in ckpt.rglob("*") if p.is_file())
            script = (f"s=$(mktemp -d) || exit 1; cp -a {d}/. $s/ && mount -t tmpfs -o size={used_kib + 64}k tmpfs {d}; "
                      f"r=$?; [ $r -eq 0 ] && cp -a $s/. {d}/; rm -rf $s; exit $r")
        res = subprocess.run([*ns, "sh", "-c", script], capture_output=True, text=True)
        if res.returncode != 0:
            hit.skipped, hit.detail = True, f"mount failed: {res.stderr.strip()[-200:]}"
            return
        hit.detail = f"{fault.kind} for {fault.seconds:.0f} s"

        def undo() -> None:
            if w.proc.pid == pid and w.proc.poll() is None:  # in the worker's namespace, while its process runs
                subprocess.run([*ns, "umount", "-l", str(ckpt)], capture_output=True)
            elif self.lab is None:  # it ran in ours (a restart finds the mount there): unmount it here
                subprocess.run(["umount", "-l", str(ckpt)], capture_output=True)
            # else its namespace died with it (`ip netns exec` gives each process its own)
            hit.ended = time.time()

        self.later(fault.seconds, undo)

    def _clock_fault(self, fault: Fault, hit: Hit, w: _Worker) -> None:
        """Step worker `w`'s wall clock for `fault.seconds` (ahead when `amount` >= 0.5, else behind), then back."""
        step = CLOCK_STEP if fault.amount >= 0.5 else -CLOCK_STEP
        clock = self.path(w.index, "clock")
        write_lines(clock, [str(step)])  # whole or not at all: the worker reads it any moment
        self.stepped.add(w.index)
        hit.detail = f"clock {step:+.0f} s for {fault.seconds:.0f} s"

        def undo() -> None:
            write_lines(clock, ["0"])
            self.stepped.discard(w.index)
            hit.ended = time.time()

        self.later(fault.seconds, undo)

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
            hit.skipped, hit.detail = True, f"{len(up)} worker(s) up: the last two stay"  # one measures nothing
            return
        if not up:
            hit.skipped = True
            return
        if fault.kind in LINK_KINDS:
            self._link_fault(fault, hit, up)
            return
        if fault.kind == "clock":  # a clock already stepped is not stepped again (its end would end both)
            up = [w for w in up if w.index not in self.stepped]
            if not up:
                hit.skipped, hit.detail = True, "every worker up has its clock stepped already"
                return
        if fault.kind == "repkill":  # at the next merge (`tick`): merges from now on count
            if not self.armed:
                self.log_read = {w.index: self._log_size(w.index) for w in self.workers}
            self.armed.append((hit, now + REPKILL_WAIT))
            hit.detail = "at the next merge"
            return
        w = up[min(len(up) - 1, int(fault.pick * len(up)))]
        hit.worker = w.index
        if fault.kind in DISK_KINDS:
            self._disk_fault(fault, hit, w)
            return
        if fault.kind == "clock":
            self._clock_fault(fault, hit, w)
            return
        if self.site(w.index) and fault.kind in ("kill", "stop"):
            self._site_fault(fault, hit, w, now)
        elif fault.kind == "kill":
            self._kill(w, hit, now)
        elif fault.kind == "stop":
            self.open[w.index] = hit
            w.proc.send_signal(signal.SIGSTOP)
            w.state, w.until = "stopped", now + fault.seconds
        elif fault.kind == "leave":
            w.proc.send_signal(signal.SIGINT)
            w.state = "gone"

    def _site_fault(self, fault: Fault, hit: Hit, w: _Worker, now: float) -> None:
        """A kill or a stop of the site: SIGKILL one of its ranks (torchrun ends the others, the launcher starts the
        site again from its checkpoint: its return is its next committed round), or SIGSTOP every rank. While the
        site is (re)starting there is no rank to hit: skipped."""
        from .site import rank_pids

        ranks = rank_pids(w.proc.pid)
        if len(ranks) < self.setup.site_ranks:
            hit.skipped, hit.detail = True, "the site is (re)starting"
            return
        if fault.kind == "kill":
            rank = random.Random(fault.at).randrange(len(ranks))  # from the plan alone, as every draw
            os.kill(ranks[rank], signal.SIGKILL)
            hit.detail = f"rank {rank} of the site; its launcher starts it again"
            hit.ended = time.time()  # nothing to wait for here: the launcher restarts it at once
            return
        self.open[w.index] = hit
        w.frozen = list(ranks.values())
        for pid in w.frozen:
            os.kill(pid, signal.SIGSTOP)
        hit.detail = f"its {len(ranks)} ranks"
        w.state, w.until = "stopped", now + fault.seconds

    def _cont(self, w: _Worker) -> None:
        """SIGCONT a stopped worker (a site: its ranks)."""
        for pid in w.frozen or [w.proc.pid]:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        w.frozen = []

    def end(self) -> list[int | None]:
        """Everyone back, then the end of the whole run (`diloco.ending`): SIGUSR2 to one worker, which announces the
        round every worker ends at (with regions, a last merge, and θ_G′ everywhere); a worker not gone within
        `END_WAIT` seconds of it gets SIGTERM (it finishes its round and leaves). The last exit status of each."""
        for w in self.workers:
            if w.state == "stopped":
                self._cont(w)
        # a worker still starting (restarted or new near the end) finishes starting first, for up to 60 s: until its
        # address file is written its signal handlers may not be in place, and a signal would end it where it stands
        deadline = time.monotonic() + 60
        for w in self.workers:
            while (w.state == "up" and w.proc.poll() is None and not self.path(w.index, "addr").exists()
                   and time.monotonic() < deadline):
                time.sleep(0.1)
        running = [w for w in self.workers if w.state != "down" and w.proc.poll() is None]
        if running:  # a site's launcher tells its leader rank through its end file
            running[0].proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + END_WAIT
        out: list[int | None] = []
        for w in self.workers:
            if w.state == "down":
                out.append(w.exits[-1] if w.exits else None)
                continue
            try:
                out.append(w.proc.wait(max(0.0, deadline - time.monotonic())))
                continue
            except subprocess.TimeoutExpired:
                w.proc.send_signal(signal.SIGTERM)  # a site: its launcher passes it on to torchrun's group
            try:
                out.append(w.proc.wait(90))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                out.append(w.proc.wait())
        return out

    def kill_all(self) -> None:
        for w in self.workers:
            self._cont(w)
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
        for log in self.logs:
            log.close()

    def lines(self) -> list[Lines]:
        return [read_jsonl(self.path(w.index, "jsonl")) if self.path(w.index, "jsonl").exists() else []
                for w in self.workers]


def _one(setup: ChaosSetup, workdir: Path, tag: str, faults: Sequence[Fault], baseline: dict[str, Any] | None,
         progress: Callable[[str], None], tick: Callable[[float, float | None, str | None], None]) -> dict[str, Any]:
    lab = None
    if setup.wan:
        joins = sum(f.kind == "join" for f in faults)
        lab = WanLab(setup.workers + joins, rate_mbit=setup.rate_mbit, delay_ms=setup.delay_ms, backend="tun").start()
        progress(f"{tag}: {lab.describe()}")
    swarm = _Swarm(setup, workdir, tag, lab)
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
                         + (f" (skipped: {hit.detail or 'nobody to hit'})" if hit.skipped
                            else f" ({hit.detail})" if hit.detail else ""))
            tick(now - begun, setup.seconds, tag)
            time.sleep(0.1)
        end = time.time()
        swarm.finish_faults()
        for w in swarm.workers:  # everyone back, then a while to heal before the end
            w.until = 0.0
        heal_until = time.monotonic() + setup.heal
        while (now := time.monotonic()) < heal_until or any(w.state == "down" for w in swarm.workers):
            if now > heal_until + 120:
                raise RuntimeError(f"the {tag} swarm could not restart every worker; see the logs in {workdir}")
            swarm.tick(now)
            time.sleep(0.1)
        together = [not w.finished for w in swarm.workers]
        exits = swarm.end()
    finally:
        swarm.finish_faults()
        swarm.kill_all()
        if lab is not None:
            lab.close(raise_errors=False)
    return summary(setup, hits, swarm.lines(), (start, end), exits, baseline, together, swarm.crashes)


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

    rows = ["| fault | applied | skipped | to the next commit p50 / p99 (s) | p99 when no other worker was down (n) "
            "| to the worker's return p50 / p99 (s) |", "|---|---|---|---|---|---|"]
    for kind, f in report["faults"].items():
        rows.append(f"| {kind} | {f['applied']} | {f['skipped']} | {sec(f['to_next_commit_p50'])} / "
                    f"{sec(f['to_next_commit_p99'])} | {sec(f.get('alone_to_next_commit_p99'))} ({f.get('alone', 0)}) "
                    f"| {sec(f['to_return_p50'])} / {sec(f['to_return_p99'])} |")
    base = report.get("baseline")
    lines = [*rows, "",
             f"{s['workers']} workers, {s['seconds']:g} s, a fault every ~{s['every']:g} s (seed {s['seed']}): "
             f"{report['rounds_committed']} rounds committed ({report['rounds_per_minute']:.1f}/min)"
             + (f" against {base['rounds_committed']} undisturbed: goodput **{100 * report['goodput']:.0f}%**"
                if base else "")
             + f"; inner steps that entered a committed round: {report['useful_steps_per_minute']:.0f}/min"
             + (f" ({100 * report['step_goodput']:.0f}% of undisturbed; lost against it: {report['rounds_lost']} "
                f"rounds, {report['steps_lost']} inner steps)" if base else "")
             + f"; {report['stalls']} stalls over {s['stall']:g} s ({report['stalled_seconds']:.0f} s in all, the "
               f"longest {report['longest_stall']:.1f} s); "
             + ("gossip: no global state, so no forks to count, and a cut-off side gossips on; "
                if report["forks"] is None else
                f"forks: **{len(report['forks'])}**; rounds a cut-off minority committed: "
                f"**{len(report['commits_cut_off'])}**; ")
             + ("**crashed** (exited while nothing asked them to; not restarted): " + ", ".join(
                 f"worker {c['worker']} (exit {c['exit']}, {c['at']:.0f} s in)" for c in report["crashes"]) + "; "
                if report.get("crashes") else "crashed: **0**; ")
             + f"the workers there at the end ended on **{len(report['final_states'])}** model(s); exit statuses "
               f"{report['exits']}; held-out loss {loss(report['eval_loss_mean'])}"
             + (f" (undisturbed {loss(base['eval_loss_mean'])})" if base else "") + "."]
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
