"""The race on a slow link: data-parallel training, DiLoCo and streaming DiLoCo with overlap, each run by
real peers on the same emulated WAN, timed until they reach the held-out loss data-parallel ends at.

Every racer is the bundled job (`diloco start` / `diloco join` in network namespaces joined by shaped
links, `diloco.bench.wan.WanLab`), with the same model, data shards, batch and warmup, one after the other
on one lab:

- data-parallel through the same transport: `--data-parallel`, a round per step averages the peers'
  gradients (fp32) and AdamW steps the global model (`diloco.job.train.data_parallel_outer`);
- DiLoCo: H inner AdamW steps, then a round averages fp32 pseudo-gradients into the outer Nesterov step;
- streaming DiLoCo: P fragments on a staggered schedule, 4-bit (e3m0) values, each exchange overlapping τ
  inner steps.

The learning rates stay constant after the warmup, so a racer's loss at a step does not depend on how long
it was set to run. Data-parallel runs `dp_steps` steps; its final held-out loss is the finish line. The
DiLoCo racers run up to `steps` inner steps each (the budget they get to reach it). A racer's clock is its
first peer's `train_seconds` (from its first inner step, held-out evaluations left out); the report gives
each racer's time to the finish line and the speedup over data-parallel (its time / the racer's).

Needs root (network namespaces). `diloco bench race --help` lists the knobs.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .lab import LabModel, Lines, Tick, final, measure_link, run_swarm


@dataclass(frozen=True)
class RaceSetup(LabModel):
    """The race's links and budgets; the model, batch, warmup and the DiLoCo racers' inner lr are `LabModel`'s."""

    peers: int = 2
    rate_mbit: float = 10.0
    """Each host's uplink, Mbit/s."""
    delay_ms: float = 50.0
    """One-way delay of every link, ms."""
    dp_steps: int = 400
    """Data-parallel steps: its final held-out loss is the finish line."""
    dp_lr: float = 4e-3
    dp_eval_every: int = 25
    steps: int = 2000
    """Inner steps (per peer) each DiLoCo racer may take to reach the finish line."""
    inner_steps: int = 50
    """H of the DiLoCo racers."""
    fragments: int = 2
    tau: int = 5
    """Inner steps a streaming exchange overlaps."""
    streaming_compression: str = "e3m0"
    timeout_s: float = 3600.0
    """Per racer."""

    def __post_init__(self) -> None:
        if self.peers < 2:
            raise ValueError(f"a race needs at least 2 peers, got {self.peers}")
        if self.rate_mbit <= 0 or self.delay_ms < 0:
            raise ValueError(f"the link needs a rate > 0 and a delay >= 0, got {self.rate_mbit} Mbit/s, {self.delay_ms} ms")
        if self.dp_steps < 1 or self.steps < self.inner_steps:
            raise ValueError(f"dp_steps must be >= 1 and steps >= H ({self.inner_steps}); got {self.dp_steps}, "
                             f"{self.steps}")
        if self.steps % self.inner_steps or self.inner_steps % self.fragments:
            raise ValueError(f"steps ({self.steps}) must be a multiple of H ({self.inner_steps}), and H of the "
                             f"fragments ({self.fragments})")
        if not 0 <= self.tau < self.inner_steps // self.fragments:
            raise ValueError(f"tau ({self.tau}) must be below H/fragments ({self.inner_steps // self.fragments})")


@dataclass(frozen=True)
class Racer:
    name: str
    flags: tuple[str, ...]
    """Job and swarm flags of every peer (beyond the model, batch and warmup, which all racers share)."""


def racers(setup: RaceSetup) -> list[Racer]:
    """Data-parallel first (its final loss is the finish line), then DiLoCo, then streaming with overlap."""
    outer_steps = str(setup.steps // setup.inner_steps)
    h = str(setup.inner_steps)
    return [
        Racer("data-parallel", ("--data-parallel", "-H", "1", "--rounds", str(setup.dp_steps), "--lr", str(setup.dp_lr),
                                "--compression", "fp32", "--eval-every", str(setup.dp_eval_every))),
        Racer(f"DiLoCo H={h}, fp32", ("-H", h, "--rounds", outer_steps, "--lr", str(setup.lr),
                                      "--compression", "fp32", "--eval-every", "1")),
        Racer(f"streaming P={setup.fragments}, τ={setup.tau}, α=0, {setup.streaming_compression}",
              ("-H", h, "--rounds", outer_steps, "--lr", str(setup.lr), "--fragments", str(setup.fragments),
               "--overlap", str(setup.tau), "--alpha", "0", "--compression", setup.streaming_compression,
               "--eval-every", "1")),
    ]


def curve(lines: Lines) -> list[dict[str, float]]:
    """A peer's held-out losses over its training time: (seconds, step, eval_loss, bytes sent so far) after
    every evaluated round, and the final evaluation."""
    out, sent = [], 0
    for ln in lines:
        if ln.get("event") == "round":
            sent += ln.get("bytes_sent", 0)
            if "eval_loss" in ln:
                out.append(dict(seconds=ln["train_seconds"], step=ln["step"], eval_loss=ln["eval_loss"],
                                bytes_sent=sent))
    end = final(lines)
    if not out or out[-1]["step"] != end["steps"] or out[-1]["eval_loss"] != end["eval_loss"]:
        out.append(dict(seconds=end["train_seconds"], step=end["steps"], eval_loss=end["eval_loss"],
                        bytes_sent=end["bytes_sent"]))
    return out


def time_to(points: Sequence[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first point of a curve at or below `target` (None: never reached)."""
    return next((p for p in points if p["eval_loss"] <= target), None)


def standings(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each racer's time, step and bytes to the finish line (data-parallel's final loss, the first result) and
    its speedup over data-parallel; a racer that never got there has None for them."""
    dp = results[0]
    target = dp["eval_loss"]
    dp_time = time_to(dp["curve"], target)
    assert dp_time is not None  # its own final loss
    out = []
    for r in results:
        hit = time_to(r["curve"], target)
        out.append(dict(name=r["name"], target=target, seconds=hit["seconds"] if hit else None,
                        step=hit["step"] if hit else None, bytes_sent=hit["bytes_sent"] if hit else None,
                        speedup=dp_time["seconds"] / hit["seconds"] if hit and hit["seconds"] > 0 else None))
    return out


def run(setup: RaceSetup, *, workdir: Path | None = None, progress: Callable[[str], None] = print,
        tick: Tick | None = None, which: Sequence[Racer] | None = None, measure: bool = True) -> dict[str, Any]:
    """Build one WAN lab, run every racer on it, and return the report (also the JSON). `progress` gets a line
    per event; `tick(done, total, status)` how far the race is, in racers (fractional from the first peer's
    steps while one runs); `measure`: time a TCP transfer across the link first (about 4 s)."""
    from .wan import WanLab

    workdir = Path(workdir or tempfile.mkdtemp(prefix="diloco-bench-race-"))
    entrants = list(which or racers(setup))
    common = [*setup.model_flags(), "--wait-for", str(setup.peers), "--gather-timeout", "60", "--round-timeout", "120",
              "--quiet"]
    results = []
    with WanLab(hosts=setup.peers, rate_mbit=setup.rate_mbit, delay_ms=setup.delay_ms) as lab:
        link = lab.describe()
        progress(link)
        measured = measure_link(lab, setup.rate_mbit, progress) if measure else None
        for k, racer in enumerate(entrants):
            status = f"[{k + 1}/{len(entrants)}] {racer.name}"
            progress(f"{status} ...")
            total = setup.dp_steps if k == 0 else setup.steps

            def watch(lines: Lines, k: int = k, total: int = total, status: str = status) -> None:
                if tick is not None:
                    step = max((ln.get("step", 0) for ln in lines if ln.get("event") == "round"), default=0)
                    tick(k + min(1.0, step / total), len(entrants), status)

            try:
                peers = run_swarm(lab, setup.peers, [*common, *racer.flags], workdir / f"r{k}", setup.timeout_s,
                                  watch)
            except RuntimeError as e:
                raise RuntimeError(f"{racer.name}: {e}") from e
            finals = [final(lines) for lines in peers]
            res = dict(name=racer.name, flags=list(racer.flags), eval_loss=finals[0]["eval_loss"],
                       steps=finals[0]["steps"], train_seconds=finals[0]["train_seconds"],
                       bytes_sent=sum(f["bytes_sent"] for f in finals),
                       digests_agree=len({f["digest"] for f in finals}) == 1,
                       utilization=sum(f["usage"]["utilization"] for f in finals) / len(finals),
                       curve=curve(peers[0]))
            results.append(res)
            progress(f"    held-out loss {res['eval_loss']:.4f} after {res['steps']} steps, {res['train_seconds']:.0f} s, "
                     f"{res['bytes_sent'] / 1e6:.1f} MB sent, utilization {100 * res['utilization']:.1f}%, "
                     f"digests agree: {res['digests_agree']}")
    return {"setup": asdict(setup), "link": link,
            "measured_link": {"rtt_ms": measured.rtt_ms, "goodput_mbit": measured.goodput_mbit} if measured else None,
            "results": results, "standings": standings(results)}


def finish_table(report: dict[str, Any], *, who: str, baseline: str, steps_run: bool = True) -> str:
    """The standings as a markdown table: each `who`'s time, steps and bytes to the finish line (`baseline`'s final
    loss), its speedup over `baseline`, and how its whole run went (`steps_run`: with the steps it ran)."""
    target = report["standings"][0]["target"]
    ran = " steps run |" if steps_run else ""
    rows = [f"| {who} | time to {target:.4f} | steps to it | speedup over {baseline} | MB a peer sent to it "
            f"| final loss |{ran} seconds run | compute utilization |", "|---" * (8 + steps_run) + "|"]
    for s, r in zip(report["standings"], report["results"]):
        if s["seconds"] is None:
            reached = "not reached | - | - | -"
        else:
            reached = f"{s['seconds']:.1f} s | {s['step']} | {s['speedup']:.1f}× | {s['bytes_sent'] / 1e6:.1f}"
        steps = f" {r['steps']} |" if steps_run else ""
        rows.append(f"| {r['name']} | {reached} | {r['eval_loss']:.4f} |{steps} {r['train_seconds']:.0f} | "
                    f"{100 * r['utilization']:.1f}% |")
    return "\n".join(rows)


def finish_plot(report: dict[str, Any], path: Path, *, baseline: str, title: str, log_x: bool) -> Path:
    """Held-out loss vs training time of every entrant, with `baseline`'s final loss as the finish line."""
    from .plot import Series, line_plot

    series = [Series(r["name"], [p["seconds"] for p in r["curve"]], [p["eval_loss"] for p in r["curve"]])
              for r in report["results"]]
    times = [p["seconds"] for r in report["results"] for p in r["curve"] if p["seconds"] > 0]
    target = report["standings"][0]["target"]
    series.append(Series(f"finish line: {baseline}'s final loss", [min(times), max(times)], [target, target]))
    return line_plot(path, series, log_x=log_x, x_label="training time (first peer)", y_label="held-out loss",
                     x_unit="s", title=title)


def markdown_table(report: dict[str, Any]) -> str:
    return finish_table(report, who="racer", baseline="data-parallel")


def plot(report: dict[str, Any], path: Path) -> Path:
    """Held-out loss vs training time of every racer, with data-parallel's final loss as the finish line."""
    return finish_plot(report, path, baseline="data-parallel", title=f"The race: {_link_words(report['setup'])}",
                       log_x=True)


def _link_words(setup: dict[str, Any]) -> str:
    return f"{setup['peers']} peers, {setup['rate_mbit']:g} Mbit/s and {setup['delay_ms']:g} ms one way per host"


def write_json(report: dict[str, Any], path: Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
