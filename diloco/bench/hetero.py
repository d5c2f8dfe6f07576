"""Workers of unequal speed: fixed H against rounds by time (`--round-seconds`), each run by the same real peers
on one emulated WAN, timed until they reach the held-out loss of the fixed-H run that waits for its slowest worker.

Every variant is the bundled job (`diloco start` / `diloco join` in network namespaces, `diloco.bench.wan.WanLab`),
with the same model, data shards, batch, lr and warmup, one after the other on one lab. Worker i is throttled by the
bench (`--slowdown`, a hidden option of the bundled job: every inner step sleeps (F − 1) × its forward and backward
time), 1×, 2× and 4× by default:

- **fixed H, waiting**: every worker runs H inner steps a round and every round waits for all of them (a gather
  timeout longer than the slowest worker's round): the fast workers idle while the slowest finishes its H steps;
- **fixed H, going on without**: the same H with a short gather timeout (`grace`): the swarm goes on without the
  workers not ready in time, whose steps then arrive for a closed round and are thrown away when they download the
  state again (docs/GUARANTEES.md, "Stragglers cost one deadline");
- **rounds by time**: every worker trains for `round_seconds` a round, however many steps that is for it, and its
  pseudo-gradient counts by the steps it covers (`--round-seconds`, docs/USAGE.md). By default `round_seconds` is H
  × the fastest worker's step time measured in the first run, so the fastest runs about H steps a round;
- **rounds by time, overlapped**: the same with `--overlap τ`: each round's exchange runs while the next τ inner
  steps train, and its result is applied then (streaming DiLoCo's overlap on the whole model, α = 0), so the
  protocol's time on the link is hidden where τ steps outlast it;
- **adaptive rounds**: `--adaptive -H H`: nobody gives a time; a round lasts H steps of the fastest worker, read
  from the step times the workers publish in their records (by default the same H as the fixed-H runs, so its
  rounds are as long as the rounds by time).

The first always runs; `compared` (`--compare`) picks which of the other four follow it.

The first variant runs `rounds` rounds; its final held-out loss is the finish line. The others may run for
`rounds` × the largest slowdown rounds (their rounds are that much shorter) to get there. A variant's clock is its
first peer's (the fastest worker's) `train_seconds`. For each worker the report gives its compute utilization (the
share of its wall time spent in inner steps) and the share of its steps that entered a committed round (steps in a
round the swarm went on without are lost): their product is the worker's *useful* utilization.

Needs root (network namespaces). `diloco bench hetero --help` lists the knobs.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .lab import LabModel, Lines, Tick, final, measure_link, run_swarm
from .race import curve, finish_plot, finish_table, standings

if TYPE_CHECKING:
    from ..sim.simulate import Link


COMPARED = ("without", "time", "overlap", "adaptive")
"""The variants compared with fixed H waiting for the slowest: fixed H going on without the slow workers, rounds by
time, rounds by time overlapped, adaptive rounds."""


@dataclass(frozen=True)
class HeteroSetup(LabModel):
    """The workers' speeds, the link and the variants' knobs; the model, batch and inner lr are `LabModel`'s."""

    slowdowns: tuple[float, ...] = (1.0, 2.0, 4.0)
    """How many times as long each worker's inner step takes (one worker per host; 1: full speed)."""
    rate_mbit: float = 50.0
    """Each host's link, Mbit/s."""
    delay_ms: float = 50.0
    """One-way delay of every link, ms."""
    inner_steps: int = 500
    """H of the fixed-H variants (a round of the fastest worker: about 6 s here, ten times what a round's protocol
    takes on a 50 ms link)."""
    rounds: int = 4
    """Rounds of the fixed-H run that waits for the slowest worker: its final held-out loss is the finish line."""
    overlap: int = 50
    """τ of the overlapped rounds by time, inner steps of the fastest worker (a worker k times as slow applies a round
    τ/k of its own steps after its slot; below the fastest worker's steps a round)."""
    grace: float = 1.0
    """Gather timeout of the fixed-H run that goes on without the slow workers, seconds (by default longer than the
    2× worker is late, shorter than the 4× one: the swarm goes on without the slowest)."""
    round_seconds: float | None = None
    """Seconds of a round by time (default: H × the fastest worker's step time in the first run)."""
    adaptive_steps: int | None = None
    """H of the adaptive rounds: steps of the fastest worker a round (default: `inner_steps`)."""
    timeout_s: float = 3600.0
    """Per variant."""
    straggle_s: float = 30.0
    """A worker still running this long after the first (fastest) one ended is stopped: one the swarm went on without
    may never reach the last round (it ends its run and writes its final line, its steps counted as they are)."""
    compared: tuple[str, ...] = COMPARED
    """The variants run after fixed H waiting for the slowest (always first: its final loss is the finish line and
    its fastest step time sets the rounds by time), among `COMPARED`."""

    def __post_init__(self) -> None:
        if len(self.slowdowns) < 2 or any(not 1 <= s < float("inf") for s in self.slowdowns):
            raise ValueError(f"slowdowns needs two workers or more, each a factor >= 1, got {list(self.slowdowns)}")
        if self.slowdowns[0] != min(self.slowdowns):
            raise ValueError(f"the first worker must be the fastest (its clock and step time are the variants'), got "
                             f"{list(self.slowdowns)}: list the smallest slowdown first")
        if self.rate_mbit <= 0 or self.delay_ms < 0:
            raise ValueError(f"the link needs a rate > 0 and a delay >= 0, got {self.rate_mbit} Mbit/s, {self.delay_ms} ms")
        if self.inner_steps < 1 or self.rounds < 1 or self.grace <= 0 or self.overlap < 1:
            raise ValueError(f"inner_steps, rounds and overlap must be >= 1 and grace > 0, got {self.inner_steps}, "
                             f"{self.rounds}, {self.overlap}, {self.grace}")
        if self.round_seconds is not None and self.round_seconds <= 0:
            raise ValueError(f"round_seconds must be > 0, got {self.round_seconds}")
        if self.adaptive_steps is not None and self.adaptive_steps < 1:
            raise ValueError(f"adaptive_steps must be >= 1, got {self.adaptive_steps}")
        unknown = [c for c in self.compared if c not in COMPARED]
        if unknown or len(set(self.compared)) != len(self.compared):
            raise ValueError(f"compared variants must be distinct names among {', '.join(COMPARED)}, got "
                             f"{', '.join(self.compared) or 'none'}")

    def seconds_of_a_round(self, fastest_step: float) -> float:
        """The rounds by time's S: `round_seconds`, else H × the fastest worker's step (`fastest_step` seconds), so that
        it runs about H steps a round."""
        return self.round_seconds if self.round_seconds is not None else self.inner_steps * fastest_step

    @property
    def longer(self) -> int:
        """How many times as many rounds the later variants may run (their rounds are that much shorter)."""
        return max(1, round(max(self.slowdowns) / min(self.slowdowns)))


@dataclass(frozen=True)
class Variant:
    key: str
    name: str
    flags: tuple[str, ...]


def variants(setup: HeteroSetup, round_seconds: float) -> list[Variant]:
    """Fixed H waiting for the slowest first (its final loss is the finish line), then those of `setup.compared` in
    this order: fixed H going on without the slow workers, rounds by time, plain and overlapped, adaptive rounds."""
    h, more = str(setup.inner_steps), str(setup.rounds * setup.longer)
    adaptive = str(setup.adaptive_steps or setup.inner_steps)
    patient = str(max(600.0, 20 * setup.inner_steps))  # seconds: far beyond the slowest worker's round
    every = [
        Variant("waiting", f"fixed H={h}, waiting for the slowest", ("-H", h, "--rounds", str(setup.rounds),
                                                          "--gather-timeout", patient, "--round-timeout", patient,
                                                          "--eval-every", "1")),
        Variant("without", f"fixed H={h}, going on without ({setup.grace:g} s grace)",
                ("-H", h, "--rounds", more, "--gather-timeout", f"{setup.grace:g}", "--round-timeout", "60",
                 "--eval-every", "1")),
        Variant("time", f"rounds by time ({round_seconds:.2f} s)",
                ("--round-seconds", f"{round_seconds:.3f}", "--rounds", more, "--gather-timeout", "60",
                 "--round-timeout", "60", "--eval-every", "1")),
        Variant("overlap", f"rounds by time ({round_seconds:.2f} s), overlap τ={setup.overlap}",
                ("--round-seconds", f"{round_seconds:.3f}", "--overlap", str(setup.overlap), "--alpha", "0",
                 "--rounds", more, "--gather-timeout", "60", "--round-timeout", "60", "--eval-every", "1")),
        Variant("adaptive", f"adaptive (H={adaptive} of the fastest)",
                ("-H", adaptive, "--adaptive", "--rounds", more, "--gather-timeout", "60", "--round-timeout", "60",
                 "--eval-every", "1")),
    ]
    return [v for v in every if v.key == "waiting" or v.key in setup.compared]


def step_seconds(end: dict[str, Any]) -> float:
    """A worker's time in an inner step, from its final line (its wall time less its synchronizations')."""
    usage = end["usage"]
    return max(1e-6, (float(usage["wall_seconds"]) - float(usage["sync_seconds"])) / max(1, int(usage["steps"])))


def committed_steps(lines: Lines) -> list[int]:
    """The inner steps each of a worker's committed rounds covered (its round lines' `round_steps`)."""
    return [int(ln.get("round_steps") or 0) for ln in lines if ln.get("event") == "round" and ln.get("committed")]


def round_overhead_ms(lines: Lines, link: Link) -> float | None:
    """What a worker's rounds took on its own machine beyond their time on `link`, ms (median over its committed
    rounds after the first): the time its training thread spent in each round's synchronization (the growth of its
    round lines' `sync_seconds`) less the link's time for the bytes it moved then (`Link.seconds`: six one-way
    latencies and the larger direction at the link's rate). Meaningful for a worker that waits for nobody: the
    slowest when every round waits for all (`diloco simulate --round-overhead-ms`). None with under two rounds."""
    rounds = [ln for ln in lines if ln.get("event") == "round" and ln.get("committed")]
    beyond = [float(b["sync_seconds"]) - float(a["sync_seconds"]) - link.seconds(int(b["bytes_sent"]),
                                                                                int(b["bytes_received"]))
              for a, b in zip(rounds, rounds[1:])]
    return round(1e3 * max(0.0, statistics.median(beyond)), 1) if beyond else None


def useful_share(lines: Lines) -> float:
    """The share of a worker's inner steps that entered a committed round: the steps its committed rounds covered,
    over all it took (a round the swarm went on without loses them)."""
    steps = int(final(lines)["usage"]["steps"])
    return min(1.0, sum(committed_steps(lines)) / steps) if steps else 1.0


def worker_rows(peers: Sequence[Lines]) -> list[dict[str, float]]:
    """Each worker's compute utilization, useful share, steps and steps per committed round."""
    out = []
    for lines in peers:
        end = final(lines)
        committed = committed_steps(lines)
        share = useful_share(lines)
        out.append(dict(steps=end["usage"]["steps"], utilization=end["usage"]["utilization"], useful_share=share,
                        useful_utilization=end["usage"]["utilization"] * share,
                        steps_per_round=sum(committed) / len(committed) if committed else 0.0,
                        steps_each_round=list(committed), step_seconds=step_seconds(end)))
    return out


def run(setup: HeteroSetup, *, workdir: Path | None = None, progress: Callable[[str], None] = print,
        tick: Tick | None = None, measure: bool = True) -> dict[str, Any]:
    """Build one WAN lab, run every variant on it, and return the report (also the JSON)."""
    from ..sim.simulate import Link  # (here: `diloco bench hetero --help` reads this module's defaults)
    from .wan import WanLab

    workdir = Path(workdir or tempfile.mkdtemp(prefix="diloco-bench-hetero-"))
    peers = len(setup.slowdowns)
    common = [*setup.model_flags(), "--lr", str(setup.lr), "--compression", "fp32", "--wait-for", str(peers), "--quiet"]
    # the first peer's curve is the variant's: the others do not evaluate (an evaluation holds its worker up)
    per_peer = [("--slowdown", f"{s:g}", *(("--eval-every", "0") if i else ())) for i, s in enumerate(setup.slowdowns)]
    results: list[dict[str, Any]] = []
    round_seconds = setup.round_seconds
    overhead: float | None = None
    with WanLab(hosts=peers, rate_mbit=setup.rate_mbit, delay_ms=setup.delay_ms) as lab:
        link = lab.describe()
        progress(link)
        measured = measure_link(lab, setup.rate_mbit, progress) if measure else None
        count = len(variants(setup, 1.0))
        for k in range(count):
            variant = variants(setup, round_seconds or 1.0)[k]
            status = f"[{k + 1}/{count}] {variant.name}"
            progress(f"{status} ...")
            total = setup.rounds if k == 0 else setup.rounds * setup.longer

            def watch(lines: Lines, k: int = k, total: int = total, status: str = status) -> None:
                if tick is not None:
                    rnd = max((ln.get("round", 0) for ln in lines if ln.get("event") == "round"), default=0)
                    tick(k + min(1.0, rnd / total), count, status)

            try:
                lines = run_swarm(lab, peers, [*common, *variant.flags], workdir / f"v{k}", setup.timeout_s, watch,
                                  per_peer=per_peer, straggle_s=setup.straggle_s)
            except RuntimeError as e:
                raise RuntimeError(f"{variant.name}: {e}") from e
            finals = [final(x) for x in lines]
            workers = worker_rows(lines)
            res = dict(name=variant.name, flags=list(variant.flags), eval_loss=finals[0]["eval_loss"],
                       steps=finals[0]["steps"], train_seconds=finals[0]["train_seconds"],
                       rounds=finals[0]["round"], bytes_sent=sum(f["bytes_sent"] for f in finals),
                       digests_agree=len({f["digest"] for f in finals if f["round"] == finals[0]["round"]}) == 1,
                       behind=[i for i, f in enumerate(finals) if f["round"] != finals[0]["round"]], workers=workers,
                       utilization=sum(w["utilization"] for w in workers) / len(workers), curve=curve(lines[0]))
            results.append(res)
            if k == 0:
                round_seconds = setup.seconds_of_a_round(workers[0]["step_seconds"])
                # the slowest worker of the run that waits for it waits for nobody: its rounds' own time
                slowest = max(range(peers), key=lambda i: setup.slowdowns[i])
                overhead = round_overhead_ms(lines[slowest], Link(setup.rate_mbit, setup.delay_ms))
                progress(f"    a round on these machines beyond the link (the slowest worker, waiting for nobody): "
                         f"{overhead} ms (`diloco simulate --round-overhead-ms`)")
            behind = f" (workers {res['behind']} ended behind)" if res["behind"] else ""
            progress(f"    held-out loss {res['eval_loss']:.4f} after round {res['rounds']}, {res['train_seconds']:.0f} s; "
                     "useful utilization " + ", ".join(f"{100 * w['useful_utilization']:.0f}%" for w in workers) +
                     f"; digests agree: {res['digests_agree']}{behind}")
    return {"setup": asdict(setup), "round_seconds": round_seconds, "round_overhead_ms": overhead, "link": link,
            "measured_link": {"rtt_ms": measured.rtt_ms, "goodput_mbit": measured.goodput_mbit} if measured else None,
            "results": results, "standings": standings(results)}


def markdown_table(report: dict[str, Any]) -> str:
    """The standings (time to the finish line), then each worker's utilization in each variant."""
    head = finish_table(report, who="variant", baseline="fixed H waiting", steps_run=False)
    slowdowns = report["setup"]["slowdowns"]
    rows = ["", "| variant | " + " | ".join(f"worker {i} ({s:g}×): steps a round, utilization, useful share"
                                           for i, s in enumerate(slowdowns)) + " |",
            "|---" * (1 + len(slowdowns)) + "|"]
    for r in report["results"]:
        rows.append(f"| {r['name']} | " + " | ".join(
            f"{w['steps_per_round']:.1f}, {100 * w['utilization']:.1f}%, {100 * w['useful_share']:.1f}%"
            for w in r["workers"]) + " |")
    return head + "\n" + "\n".join(rows)


def plot(report: dict[str, Any], path: Path) -> Path:
    """Held-out loss vs training time of every variant, with the fixed-H run's final loss as the finish line."""
    s = report["setup"]
    return finish_plot(report, path, baseline="fixed H waiting", log_x=False,
                       title=f"Workers {', '.join(f'{x:g}x' for x in s['slowdowns'])} as slow, "
                             f"{s['rate_mbit']:g} Mbit/s, {s['delay_ms']:g} ms")
