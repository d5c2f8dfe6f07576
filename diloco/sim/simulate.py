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

    comm = 6 · latency + max(bytes sent, bytes received by a worker) · 8 / bandwidth + overhead

(three round trips: a ready and its reply, contributions to span owners and results back, a vote and, at most,
its reply; full-duplex links; `overhead`: what a round takes on the workers' own machines, measured there and
given as `--round-overhead-ms`, 0 by default), computed
with the round's busiest worker. Between two rounds every worker takes H/P inner steps; the swarm
moves at the pace of its slowest worker (a round waits for all), and a result needed τ steps after
its round started blocks the loop for max(0, comm − τ · step) seconds. Projected wall clock is the
sum over rounds of the slowest worker's compute plus that blocking; a worker's compute utilization
is its own compute time over that wall clock.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Mapping, Sequence

from diloco.comms import InProcNetwork
from diloco.comms.faults import NO_FAULTS, FaultPlan, Faults
from diloco.comms.loop import LoopThread
from diloco.peers import InProcBoard, PeerRecord
from diloco.peers.records import REGION

from ..config import ConfigError, SwarmConfig
from ..fragments import inner_steps_at
from ..job.train import JobConfig, load_corpus, run_job
from ..metrics import MetricsWriter
from ..swarm import Banned, Swarm
from ..wrapper import DiLoCo, subnormals_flushed
from .faults import Fault, FaultRunner, Killed, check_plan

log = logging.getLogger(__name__)


MSS_BYTES = 1460  # TCP segment payload on a 1500-byte MTU path
LATENCIES = 6
"""One-way latencies on a round's critical path: the gather (a ready and its reply), the exchange (contributions to
the span owners, results back) and the decide step (a vote, and its reply when the others' votes did not cross it:
up to a round trip), docs/PROTOCOL.md."""


@dataclass(frozen=True)
class Link:
    """One worker's link: full duplex, `bandwidth_mbit` per direction, `latency_ms` one way, and a packet
    `loss` rate that caps TCP throughput (Mathis et al. 1997: MSS / RTT · 1.22 / √loss)."""

    bandwidth_mbit: float = 100.0
    latency_ms: float = 50.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_mbit > 0:
            raise ConfigError(f"bandwidth_mbit must be > 0, got {self.bandwidth_mbit}")
        if not self.latency_ms >= 0:
            raise ConfigError(f"latency_ms must be >= 0, got {self.latency_ms}")
        if not 0 <= self.loss < 1:
            raise ConfigError(f"loss must be in [0, 1), got {self.loss}")

    @property
    def throughput_mbit(self) -> float:
        """What a TCP stream gets: the bandwidth, or less when loss limits the congestion window."""
        rtt = 2 * self.latency_ms / 1e3
        if self.loss <= 0 or rtt <= 0:
            return self.bandwidth_mbit
        return min(self.bandwidth_mbit, MSS_BYTES * 8 / rtt * 1.22 / math.sqrt(self.loss) / 1e6)

    def seconds(self, sent: int, received: int) -> float:
        """One round on this link: `LATENCIES` one-way latencies, and the larger direction at the TCP throughput."""
        return LATENCIES * self.latency_ms / 1e3 + max(sent, received) * 8 / (self.throughput_mbit * 1e6)


def _keyed_link(text: str, key_ok: Callable[[str], bool], flag: str, form: str) -> tuple[str, Link]:
    """`KEY=MBIT:MS[:LOSS]` as (KEY, its link); a ConfigError naming `flag` and the `form` it expects otherwise."""
    key, _, rest = text.partition("=")
    parts = rest.split(":")
    try:
        if not key_ok(key.strip()) or len(parts) not in (2, 3):
            raise ValueError
        return key.strip(), Link(*(float(p) for p in parts))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected {form}") from None


def parse_link(text: str) -> tuple[int, Link]:
    """`W=MBIT:MS[:LOSS]` (the CLI's --link): worker W's own bandwidth, latency and loss."""
    worker, link = _keyed_link(text, str.isdigit, "--link", "W=MBIT:MS[:LOSS], e.g. 3=20:150 or 3=20:150:0.01")
    return int(worker), link


def parse_region_link(text: str) -> tuple[str, Link]:
    """`NAME=MBIT:MS[:LOSS]` (the CLI's --region-link): the link between the peers of region NAME."""
    return _keyed_link(text, lambda name: bool(REGION.fullmatch(name)), "--region-link",
                       "NAME=MBIT:MS[:LOSS], e.g. eu=1000:5")


@dataclass(frozen=True)
class NetworkModel:
    """The links and workers a simulated run is projected onto."""

    bandwidth_mbit: float = 100.0
    """Each worker's link, per direction, in Mbit/s."""
    latency_ms: float = 50.0
    """One-way latency between two workers, in milliseconds."""
    loss: float = 0.0
    """Packet loss rate of every link (caps TCP throughput, see `Link`)."""
    step_seconds: float | None = None
    """Compute time of one inner step at speed 1.0 (default: as measured in the simulated run)."""
    speeds: tuple[float, ...] = ()
    """Relative speed of each worker (1.0: `step_seconds` a step; 0.5: half as fast); default all 1."""
    links: tuple[tuple[int, Link], ...] = ()
    """(worker, link) for workers whose link differs from the default one."""
    region_links: tuple[tuple[str, Link], ...] = ()
    """(region, link): the link between the peers of that region (with regions; default: each worker's link,
    which then stands for the link to the other regions)."""
    round_overhead_ms: float = 0.0
    """What a round of the swarm takes on the workers' own machines beyond its time on the link, ms: the round's
    phases handing off, forming Δ, the outer step, the round's record. Nothing in this process can tell it (its
    rounds share one process and no link); measure it on the machines that will train, e.g. `diloco bench
    hetero`'s `round_overhead_ms` (the slowest worker's time blocked in a round, less its link's
    `Link.seconds`). 0: the link alone."""

    def __post_init__(self) -> None:
        self.link(-1)  # validates the default link
        if self.step_seconds is not None and self.step_seconds <= 0:
            raise ConfigError(f"step_seconds must be > 0, got {self.step_seconds}")
        if any(s <= 0 for s in self.speeds):
            raise ConfigError(f"every speed must be > 0, got {list(self.speeds)}")
        if not self.round_overhead_ms >= 0:
            raise ConfigError(f"round_overhead_ms must be >= 0, got {self.round_overhead_ms}")

    def link(self, worker: int) -> Link:
        return dict(self.links).get(worker) or Link(self.bandwidth_mbit, self.latency_ms, self.loss)

    def inside(self, region: str, worker: int) -> Link:
        """The link `worker` uses for its region's rounds and downloads."""
        return dict(self.region_links).get(region) or self.link(worker)

    @property
    def overhead(self) -> float:
        """`round_overhead_ms` in seconds: added to every round's (and merge's) time on its link."""
        return self.round_overhead_ms / 1e3


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


RoundBytes = Mapping[int, tuple[int, int]]  # worker -> (bytes sent, bytes received) in one round


def project(rounds: Sequence[RoundBytes | tuple[int, int]], *, steps_per_round: int | Sequence[int | Mapping[int, int]],
            overlap: int, workers: int,
            net: NetworkModel, step_seconds: float, faults: Sequence[Fault] = ()) -> Projection:
    """Project a run onto `net`. `rounds[k]` is round k+1: who took part and what each sent and received
    (a bare (sent, received) pair: every worker moved that much). Each round follows `steps_per_round`
    inner steps (H/P; a sequence: round k+1's, under an H schedule, or with rounds by time each worker's own, by
    worker) and its result is needed `overlap` (τ) steps after it began; `slow` and
    `degrade` faults change a worker's speed and link from their round on. Pure: the model is in the
    module docstring; a round's compute lasts as long as its slowest member's steps, and its exchange as its
    slowest exchange."""
    step, speeds = _pace(net, workers, step_seconds)
    wall = blocked = comm_total = 0.0
    compute = [0.0] * workers
    for k, moved in enumerate(rounds, start=1):
        members = moved if isinstance(moved, Mapping) else dict.fromkeys(range(workers), moved)
        if not members:
            continue
        pace = {i: step / _speed(i, k, speeds, faults) for i in members}
        slowest = max(pace.values())
        steps = steps_per_round if isinstance(steps_per_round, int) else steps_per_round[k - 1]
        took = {i: (steps if isinstance(steps, int) else steps.get(i, 0)) * t for i, t in pace.items()}
        comm = max(_link(i, k, net, faults).seconds(*members[i]) for i in members) + net.overhead
        # τ steps hide the exchange: at the slowest member's pace with fixed H (the others wait for it anyway), at the
        # fastest's by time (every member's span is as long, so the fastest needs the result first)
        wait = max(0.0, comm - overlap * (slowest if isinstance(steps, int) else min(pace.values())))
        wall += max(took.values()) + wait
        blocked += wait
        comm_total += comm
        for i, t in took.items():
            compute[i] += t
    return Projection(wall_seconds=wall, compute_seconds=tuple(compute), blocked_seconds=blocked,
                      comm_seconds=comm_total)


@dataclass(frozen=True)
class RegionRun:
    """What one region's peers did, by region round (from their metrics rows): `rounds[r]` the bytes each member
    moved in region round r, `merges[r]` the representative's merge (bytes of its round of the swarm) and
    `downloads[r]` each member's download of the merged region state, both at the region round r they made."""

    members: tuple[int, ...]
    rounds: Mapping[int, RoundBytes]
    merges: Mapping[int, RoundBytes]
    downloads: Mapping[int, RoundBytes]


def project_regions(regions: Mapping[str, RegionRun], *, steps_per_round: int, workers: int, net: NetworkModel,
                    step_seconds: float) -> dict[str, Any]:
    """Project a run with regions onto `net`. Between two merges the regions train in parallel: each region
    round takes H steps at its slowest member's pace plus its exchange on the region's link
    (`NetworkModel.inside`); a merge period lasts as long as its slowest region, then the merge (the
    representatives' round of the swarm on their own links, the slowest of them) and the members' downloads
    of the merged region state (on the region's link, the slowest) follow. The j-th merge of every region
    is the same merge. Pure."""
    step, speeds = _pace(net, workers, step_seconds)
    compute = [0.0] * workers
    periods: dict[int, dict[str, float]] = {}  # merge index -> region -> seconds of region rounds before it
    merge_comm: dict[int, float] = {}
    download_comm: dict[int, float] = {}
    inside_total = 0.0
    for name, run in regions.items():
        pace = max(step / speeds[i] for i in run.members)
        cuts = sorted(run.merges)
        for r, moved in sorted(run.rounds.items()):
            j = sum(c <= r for c in cuts)  # merges before this round
            comm = max(net.inside(name, i).seconds(*moved[i]) for i in moved) + net.overhead if moved else 0.0
            periods.setdefault(j, {}).setdefault(name, 0.0)
            periods[j][name] += steps_per_round * pace + comm
            inside_total += comm
            for i in run.members:
                compute[i] += steps_per_round * step / speeds[i]
        for j, r in enumerate(cuts):
            reps = run.merges[r]
            merge_comm[j] = max([merge_comm.get(j, 0.0), *(net.link(i).seconds(*reps[i]) + net.overhead for i in reps)])
            got = run.downloads.get(r, {})
            download_comm[j] = max([download_comm.get(j, 0.0), *(net.inside(name, i).seconds(*got[i]) for i in got)])
    trained = sum(max(by_region.values(), default=0.0) for by_region in periods.values())
    between = sum(merge_comm.values())
    downloads = sum(download_comm.values())
    wall = trained + between + downloads
    return dict(wall_seconds=round(wall, 3), merges=len(merge_comm), merge_seconds=round(between, 3),
                download_seconds=round(downloads, 3), comm_inside_seconds=round(inside_total, 3),
                utilization=[round(c / wall, 4) if wall > 0 else 1.0 for c in compute],
                min_utilization=round(min(c / wall for c in compute), 4) if wall > 0 else 1.0)


def _pace(net: NetworkModel, workers: int, step_seconds: float) -> tuple[float, tuple[float, ...]]:
    """An inner step's time at speed 1 (the model's, else the measured one) and each worker's speed."""
    speeds = net.speeds or (1.0,) * workers
    if len(speeds) != workers:
        raise ConfigError(f"speeds lists {len(speeds)} workers, the run has {workers}")
    return (net.step_seconds if net.step_seconds is not None else step_seconds), speeds


def _speed(worker: int, rnd: int, speeds: Sequence[float], faults: Sequence[Fault]) -> float:
    """The worker's speed in round `rnd`: its base speed over every `slow` factor fired by then (a fault
    at round r is in force from round r + 1, the first round the worker starts after reaching r)."""
    v = speeds[worker]
    for f in faults:
        if f.action == "slow" and f.peer == worker and f.round < rnd:
            v /= f.factor
    return v


def _link(worker: int, rnd: int, net: NetworkModel, faults: Sequence[Fault]) -> Link:
    link = net.link(worker)
    for f in faults:
        if f.action == "degrade" and f.peer == worker and f.round < rnd:
            link = Link(f.bandwidth_mbit if f.bandwidth_mbit is not None else link.bandwidth_mbit,
                        f.latency_ms if f.latency_ms is not None else link.latency_ms,
                        f.loss if f.loss is not None else link.loss)
    return link


class _Rows(MetricsWriter):
    """Collects a worker's metrics in memory, as `MetricsWriter` writes them: a field still being computed (a round's
    digest, hashed beside training) is there once its line is (`flush` before reading them all)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.rows: list[dict[str, Any]] = []

    def _append(self, stamped: dict[str, Any]) -> None:
        self.rows.append(stamped)


def _cut_off(runner: FaultRunner, me: str, target: str, handler: str) -> bool:
    return runner.blocked(me, target)


class _SideOfBoard:
    """One simulated peer's view of the shared board: during a partition, only its own side's records."""

    def __init__(self, board: InProcBoard, me: str, runner: FaultRunner | None) -> None:
        self.board, self.me, self.runner = board, me, runner
        self.dropped = board.dropped

    async def publish(self, record: PeerRecord, ttl: float) -> None:
        await self.board.publish(record, ttl)

    async def read(self) -> list[PeerRecord]:
        found = await self.board.read()
        return found if self.runner is None else [r for r in found if self.runner.visible(self.me, str(r.peer))]

    async def reach(self, records: list[PeerRecord]) -> int:
        """A partition's other side cannot be pinged across it."""
        return await self.board.reach(records)

    async def close(self) -> None:
        pass

    def scoped(self, scope: str) -> _SideOfBoard:
        """The same peer's view of a namespace's board (a region's records: `Swarm.scope`)."""
        return _SideOfBoard(self.board.scoped(scope), self.me, self.runner)


Progress = Callable[[float, float | None, str | None], None]
"""(done, total, status): how many inner steps all workers took, of how many, and a status line."""


def progress_status(round_reached: int, fragments: int, rounds: int, running: int | None, workers: int) -> str:
    """'round 3/10, 16 workers' (or '15/16 workers running' while some are down): the outer rounds the
    swarm committed, and the workers running now (None or 0: the run is over)."""
    plural = "s" if workers != 1 else ""
    who = f"{workers} worker{plural}" if running in (None, 0, workers) else f"{running}/{workers} worker{plural} running"
    return f"round {round_reached // fragments}/{rounds}, {who}"


def _round_reached(rows: Sequence[tuple[int, _Rows]]) -> int:
    return max((r["round"] for _, out in rows for r in list(out.rows) if r["event"] == "round" and r["committed"]),
               default=0)


def simulate(job: JobConfig, workers: int, *, swarm: SwarmConfig | None = None, net: NetworkModel | None = None,
             faults: Sequence[Fault] = (), timeout: float = 3600.0, progress: Progress | None = None,
             regions: Sequence[str] = ()) -> dict[str, Any]:
    """Run `workers` workers of `job` in this process and project the run onto `net`, playing out the
    fault plan `faults` (`diloco.sim.faults`); returns a summary (the global digest, bytes, the faults
    fired, the projection). `regions`: the region of each worker (docs/REGIONS.md; the projection then
    charges region rounds to `net.region_links` and merges to the workers' own links). Raises RuntimeError
    if a worker failed. `progress(done, total, status)` is called about once a second from the calling
    thread (inner steps of all workers so far)."""
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    if regions and len(regions) != workers:
        raise ConfigError(f"--regions names {len(regions)} regions, one per worker is needed ({workers})")
    if regions and len(set(regions)) < 2:
        raise ConfigError(f"--regions names one region ({regions[0]}): regions need at least two (or leave it out)")
    if regions and faults:
        raise ConfigError("fault plans are not supported with regions yet: simulate regions without --faults")
    gossip = swarm is not None and swarm.topology == "gossip"
    if gossip and faults:
        raise ConfigError("fault plans are not supported with gossip yet: simulate gossip without --faults")
    unknown = sorted({name for name, _ in net.region_links} - set(regions)) if net is not None else []
    if unknown:
        raise ConfigError(f"--region-link names {unknown[0]!r}, which no worker is in (--regions {','.join(regions)})")
    net = net or NetworkModel()
    if net.speeds and len(net.speeds) != workers:
        raise ConfigError(f"speeds lists {len(net.speeds)} workers, --workers is {workers}")
    if any(w >= workers for w, _ in net.links):
        raise ConfigError(f"a link is set for worker {max(w for w, _ in net.links)}; workers are 0..{workers - 1}")
    check_plan(faults, workers)
    target = job.rounds * job.fragments
    late = [f for f in faults if f.round >= target]
    if late:
        raise ConfigError(f"{late[0]}: the run ends at round {target} (--rounds × fragments); move it earlier")
    by_time = job.round_seconds is not None or job.adaptive
    if by_time:
        if net.step_seconds is None:
            raise ConfigError("rounds by time in a simulation count simulated seconds: give --step-seconds (an inner "
                              "step's time at speed 1; each worker's is that over its --speeds)")
        if faults or regions or gossip:
            raise ConfigError("the simulator runs rounds by time (--round-seconds, --adaptive) in a flat swarm without "
                              "faults for now: leave out --faults, --regions and --topology gossip")
    if faults and job.streaming.outer_overlap != "none":
        raise ConfigError("fault plans need outer_overlap none: a worker killed with a whole outer step in flight "
                          "would hold the others until their deadlines")
    # Every round waits for all running workers: the simulated machine may be slow, the state must not
    # depend on it. A killed or cut-off peer's calls fail at once (the in-process transport), so nobody waits for
    # it, and no call between running workers needs a deadline: the answer window (`call_timeout`) is stretched
    # too, so that a busy machine's stall cannot count a running worker as silent.
    base = swarm or SwarmConfig(run_id="simulate")
    # With regions, a region's rounds and the merges have fewer members than the swarm: they wait for everyone
    # their records show (the workers wait for each other before the first step), with min_peers 1. A gossip
    # round waits for its group (docs/GOSSIP.md), which min_peers does not count.
    rnd = base.round
    scfg = base.with_round(gather_timeout=max(rnd.gather_timeout, 600.0), reduce_timeout=max(rnd.reduce_timeout, 600.0),
                           result_timeout=max(rnd.result_timeout, 900.0), call_timeout=max(rnd.call_timeout, 60.0),
                           min_peers=1 if faults or regions else workers)
    network, board = InProcNetwork(), InProcBoard()
    corpus = load_corpus(job)  # one copy for all workers: they only read it
    finals: dict[int, dict[str, Any]] = {}
    rows: list[tuple[int, _Rows]] = []
    errors: list[BaseException] = []
    swarms: list[Swarm] = []
    threads: list[threading.Thread] = []
    steps: dict[str, int] = {}  # inner steps per incarnation
    slots: dict[int, list[int]] = {i: [] for i in range(workers)}  # each worker's inner steps before each of its slots
    lock = threading.Lock()
    speed = net.speeds or (1.0,) * workers

    def start(i: int, restarted: bool = False) -> None:
        incarnation = sum(w == i for w, _ in rows)
        pid = f"sim{i:03d}" + (f"r{incarnation}" if incarnation else "")
        drop = partial(_cut_off, runner, pid) if runner is not None else None
        faults: Faults = NO_FAULTS
        if runner is not None:
            runner.peer_worker[pid] = i
            faults = runner.plans[i] = FaultPlan()  # the runner poisons through it
        cfg_i = replace(scfg, region=regions[i]) if regions else scfg
        s = Swarm.in_process(network, _SideOfBoard(board, pid, runner), pid, cfg_i, loop, bootstrapped=restarted,
                             drop=drop, faults=faults)
        out = _Rows()
        with lock:
            swarms.append(s)
            rows.append((i, out))
        job_i = replace(job, shard=i, wait_for=1 if restarted else workers)
        t = threading.Thread(target=work, args=(i, s, out, job_i), name=pid)
        threads.append(t)
        t.start()

    def work(i: int, s: Swarm, out: _Rows, job_i: JobConfig) -> None:
        def hook(d: DiLoCo) -> None:
            steps[s.peer_id] = d.steps
            if d.member.standing.last_slot == d.steps:  # a slot: the steps since the last one
                slots[i].append(d.steps - sum(slots[i]))
            if runner is not None:
                runner.after_step(i, d)

        # rounds by time count simulated seconds: worker i's steps take step_seconds / its speed
        clock = partial(_simulated_seconds, step=net.step_seconds / speed[i]) \
            if by_time and net.step_seconds is not None else None
        # what the others' records would say of their steps, always fresh: adaptive rounds and τ by time read it
        others = [net.step_seconds / speed[j] for j in range(workers) if j != i] \
            if clock is not None and net.step_seconds is not None else None
        try:
            finals[i] = run_job(job_i, s, metrics=out, corpus=corpus, on_step=hook, round_clock=clock,
                                others_steps=others)
            s.close()  # done: it leaves, as `diloco join` does after its job, so peers still training (a region
            # whose merges drifted behind) do not wait for it in their rounds
        except Killed:
            finals.pop(i, None)
        except Banned as e:  # it stops and leaves, as a real peer does (Swarm.check_standing)
            log.warning("event=worker_stopped worker=%d reason=%s", i, e)
            finals.pop(i, None)
            s.close()
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append(e)
        finally:
            if runner is not None:
                runner.worker_gone(i)

    runner = FaultRunner(faults, spawn=lambda i: start(i, restarted=True)) if faults else None
    started = time.monotonic()
    total_steps = workers * job.total_steps

    def report(over: bool = False) -> None:
        if progress is not None:
            running = None if over else sum(t.is_alive() for t in list(threads))
            progress(min(total_steps, sum(steps.values())), total_steps,
                     progress_status(_round_reached(list(rows)), job.fragments, job.rounds, running, workers))

    # Every thread of the run flushes subnormal floats, as each bundled-job process does: the workers and the event loop
    # they share (it decodes and averages). A thread takes the setting from the one that starts it.
    with subnormals_flushed():
        loop = LoopThread()
        try:
            for i in range(workers):
                start(i)
            while True:  # restarts add threads while we wait
                report()
                alive = [t for t in list(threads) if t.is_alive()]
                if not alive or errors:
                    break
                alive[0].join(min(1.0, max(0.0, timeout - (time.monotonic() - started))))
                if time.monotonic() - started > timeout:
                    raise RuntimeError(f"the simulation did not finish within {timeout:.0f}s")
            if errors:
                raise RuntimeError(f"a simulated worker failed: {errors[0]!r}") from errors[0]
            report(over=True)
        finally:
            for s in swarms:
                s.close(announce=False)
            loop.stop()
    wall = time.monotonic() - started
    fired = runner.fired if runner is not None else []
    summary = summarize(job, [finals[i] for i in sorted(finals)], rows, net, wall, workers,
                        [f for _, f in fired], regions, slots if by_time else None)
    summary["faults_fired"] = [dict(f.as_dict(), plan_index=k) for k, f in fired]
    return summary


def _simulated_seconds(d: DiLoCo, step: float) -> float:
    """A simulated worker's clock for rounds by time: its inner steps so far, `step` seconds each."""
    return d.steps * step


def step_seconds(finals: Sequence[dict[str, Any]], cores: int | None = None) -> float:
    """An inner step's compute time on this machine, from the workers' own accounting (time outside the
    wrapper's sync work, per step), scaled by the share of the cores each worker had: M workers took
    turns on `cores` cores, so each one's steps took M/cores times as long as they would alone."""
    share = min(len(finals), cores or os.cpu_count() or 1) / len(finals)
    per_worker = [(u["wall_seconds"] - u["sync_seconds"]) / u["steps"] for u in (f["usage"] for f in finals)
                  if u["steps"]]
    return share * sum(per_worker) / len(per_worker) if per_worker else 0.0


def region_runs(rows: Sequence[tuple[int, Sequence[dict[str, Any]]]], regions: Sequence[str]) -> dict[str, RegionRun]:
    """Each region's rounds, merges and downloads (`RegionRun`) from its workers' metrics rows."""
    runs: dict[str, RegionRun] = {}
    for name in dict.fromkeys(regions):
        members = tuple(i for i, r in enumerate(regions) if r == name)
        kinds: tuple[dict[int, dict[int, tuple[int, int]]], ...] = ({}, {}, {})
        for worker, out in rows:
            if worker not in members:
                continue
            for r in out:
                if r["event"] != "round" or not (r["committed"] or r.get("resynced")):
                    continue
                kind = 0 if not r.get("merge") else 1 if r["committed"] else 2
                kinds[kind].setdefault(r["round"], {})[worker] = (r["bytes_sent"], r["bytes_received"])
        runs[name] = RegionRun(members, *kinds)
    return runs


def summarize(job: JobConfig, finals: list[dict[str, Any]], rows: Sequence[tuple[int, _Rows]], net: NetworkModel,
              wall: float, workers: int, faults: Sequence[Fault] = (), regions: Sequence[str] = (),
              slots: Mapping[int, Sequence[int]] | None = None) -> dict[str, Any]:
    """The simulation's summary from the finals of the workers that finished and every worker's round
    metrics (`rows`: (worker, its rows), one entry per incarnation). `slots`: with rounds by time, each worker's
    inner steps before each of its slots (slot k is round k + 1: a simulation by time has no faults). Its `rounds`:
    each round's committed state, {digest: the workers that committed it} (one digest a round, or the swarm forked),
    so two runs of one plan compare round by round."""
    for _, out in rows:
        out.flush()  # every line, its digest hashed
    moved: dict[int, dict[int, tuple[int, int]]] = {}
    states: dict[int, dict[str, list[int]]] = {}  # round -> digest committed -> the workers that committed it
    seen = {w: dict(worker=w, incarnations=0, committed=0, refused=0, resyncs=0) for w in range(workers)}
    for worker, out in rows:
        seen[worker]["incarnations"] += 1
        for r in out.rows:
            if r["event"] != "round":
                continue
            kind = "committed" if r["committed"] else "resyncs" if str(r["reason"]).startswith("resynced") else "refused"
            seen[worker][kind] += 1
            if r["committed"]:
                moved.setdefault(r["round"], {})[worker] = (r["bytes_sent"], r["bytes_received"])
                states.setdefault(r["round"], {}).setdefault(str(r["digest"]), []).append(worker)
    per_round = {k: sum(v[0] for v in m.values()) for k, m in moved.items()}
    first = next((out for w, out in rows if w == 0), None)  # worker 0's evaluations of the global model
    curve = [dict(round=r["round"], step=r["step"], eval_loss=r["eval_loss"],
                  bytes_sent=sum(b for k, b in per_round.items() if k <= r["round"]))
             for r in (first.rows if first is not None else []) if r["event"] == "round" and "eval_loss" in r]
    measured_step = max(1e-9, step_seconds(finals))
    fragments = finals[0]["fragments"]
    count = max(moved, default=0)
    if regions:
        projected = project_regions(region_runs([(w, out.rows) for w, out in rows], regions),
                                    steps_per_round=job.inner_steps, workers=workers, net=net,
                                    step_seconds=measured_step)
    else:
        by_round: list[int | Mapping[int, int]] = \
            [inner_steps_at(k, job.inner_steps, job.round_schedule) // fragments for k in range(count)] \
            if slots is None else [{i: s[k] for i, s in slots.items() if k < len(s)} for k in range(count)]
        projected = project([moved.get(k, {}) for k in range(1, count + 1)], steps_per_round=by_round,
                            overlap=job.streaming.overlap, workers=workers, net=net, step_seconds=measured_step,
                            faults=faults).as_dict()
        if slots is not None:
            projected["steps_per_round"] = {str(i): round(sum(s) / len(s), 2) for i, s in slots.items() if s}
    return dict(workers=workers, finished=len(finals), digests=sorted({f["digest"] for f in finals}),
                digest=finals[0]["digest"], round=finals[0]["round"], eval_loss=finals[0]["eval_loss"],
                params=finals[0]["params"], bytes_sent=sum(f["bytes_sent"] for f in finals),
                banned=finals[0]["banned"], robust=finals[0]["robust"],
                bits_per_param_sync=finals[0]["bits_per_param_sync"], compression=finals[0]["compression"],
                wall_seconds=round(wall, 2), step_seconds=round(net.step_seconds or measured_step, 6),
                network=dict(bandwidth_mbit=net.bandwidth_mbit, latency_ms=net.latency_ms, loss=net.loss,
                             speeds=list(net.speeds) or [1.0] * workers,
                             links={str(w): vars(link) for w, link in net.links},
                             region_links={name: vars(link) for name, link in net.region_links},
                             round_overhead_ms=net.round_overhead_ms),
                regions=list(regions), global_digests=sorted({str(f.get("global_digest")) for f in finals}) if regions else [],
                topology=finals[0].get("topology", "flat"),
                gossip_met=[f["gossip_met"] for f in finals] if "gossip_met" in finals[0] else [],
                projection=projected, workers_seen=list(seen.values()), curve=curve,
                rounds=[dict(round=k, digests={d: sorted(w) for d, w in sorted(states[k].items())})
                        for k in sorted(states)])
