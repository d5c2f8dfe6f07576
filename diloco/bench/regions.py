"""Regions on a two-region network: flat DiLoCo against regions (`--region`, docs/REGIONS.md), each run by
the same real peers on one emulated WAN whose links between regions are 10× slower than inside them,
timed until they reach the held-out loss flat DiLoCo ends at.

Every variant is the bundled job (`diloco start` / `diloco join` in network namespaces,
`diloco.bench.wan.WanLab` with `regions=`): the same model, data shards, batch, lr and H, one after the
other on one lab.

- flat: every peer in one swarm; every round crosses the slow link;
- regions: `--region` per peer; rounds inside each region every H steps over its fast links, and every
  `merge_every` of them one representative per region merges the regions over the slow link;
- gossip: `--topology gossip`; every H steps each peer averages with the one partner the round draws (over
  the fast link or the slow one, as drawn), no all-reduce, a state per peer (docs/GOSSIP.md).

Flat DiLoCo runs `steps` inner steps per peer; its final held-out loss is the finish line. Each regions
(and the gossip) variant may take up to `budget` inner steps to get there, ending on a merge; its curve is the first peer's
region state after each region round (the global state after a merge). A variant's clock is its first peer's
`train_seconds`. Needs root (network namespaces). `diloco bench regions --help` lists the knobs.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .lab import LabModel, Lines, Tick, final, measure_link, run_swarm
from .race import curve, finish_plot, finish_table, standings


@dataclass(frozen=True)
class RegionsSetup(LabModel):
    """The two-region network and the budgets; the model, batch and inner lr are `LabModel`'s."""

    regions: tuple[int, ...] = (0, 0, 1, 1)
    """The region of each peer (one peer per host)."""
    rate_mbit: float = 10.0
    """Each host's link inside its region, Mbit/s."""
    delay_ms: float = 5.0
    """One-way delay inside a region, ms."""
    cross_rate_mbit: float = 1.0
    """Each host's link to the other region, Mbit/s."""
    cross_delay_ms: float = 50.0
    """One-way delay between regions, ms."""
    inner_steps: int = 50
    steps: int = 1000
    """Flat DiLoCo's inner steps per peer: its final held-out loss is the finish line."""
    budget: int = 1600
    """Inner steps per peer each regions variant may take to reach the finish line (it ends on a merge)."""
    merge_every: tuple[int, ...] = (4, 8)
    """Region rounds between merges: one regions variant each."""
    gossip: bool = True
    """Also run gossip (`--topology gossip`: pairs drawn each round, no all-reduce) for `budget` steps."""
    timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if len(set(self.regions)) < 2 or any(self.regions.count(r) < 1 for r in set(self.regions)):
            raise ValueError(f"regions needs at least two regions, got {list(self.regions)}")
        if self.rate_mbit <= 0 or self.cross_rate_mbit <= 0 or self.delay_ms < 0 or self.cross_delay_ms < 0:
            raise ValueError("the links need rates > 0 and delays >= 0")
        if self.inner_steps < 1 or self.steps < self.inner_steps or self.steps % self.inner_steps:
            raise ValueError(f"steps ({self.steps}) must be a positive multiple of H ({self.inner_steps})")
        rounds = self.budget // self.inner_steps
        if not self.merge_every or any(k < 1 or self.budget % self.inner_steps or rounds % k for k in self.merge_every):
            raise ValueError(f"budget ({self.budget}) must be a multiple of H ({self.inner_steps}) × each merge_every "
                             f"({list(self.merge_every)}), so that the regions end on a merge")


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    per_peer: tuple[tuple[str, ...], ...] = ()


def variants(setup: RegionsSetup) -> list[Variant]:
    names = [f"r{r}" for r in setup.regions]
    rounds = setup.budget // setup.inner_steps  # region rounds; each merge counts as one more
    return [Variant(f"flat DiLoCo H={setup.inner_steps}", ("--rounds", str(setup.steps // setup.inner_steps))),
            *(Variant(f"regions H={setup.inner_steps}, merge every {k}",
                      ("--rounds", str(rounds + rounds // k), "--merge-every", str(k)),
                      tuple(("--region", n) for n in names)) for k in setup.merge_every),
            *([Variant(f"gossip H={setup.inner_steps}, pairs", ("--rounds", str(rounds), "--topology", "gossip"))]
              if setup.gossip else [])]


def run(setup: RegionsSetup, *, workdir: Path | None = None, progress: Callable[[str], None] = print,
        tick: Tick | None = None, which: Sequence[Variant] | None = None, measure: bool = True) -> dict[str, Any]:
    """Build one two-region WAN lab, run each variant on it, and return the report (also the JSON)."""
    from .wan import WanLab

    workdir = Path(workdir or tempfile.mkdtemp(prefix="diloco-bench-regions-"))
    entrants = list(which or variants(setup))
    peers = len(setup.regions)
    common = [*setup.model_flags(), "--lr", str(setup.lr), "-H", str(setup.inner_steps), "--compression", "fp32", "--eval-every", "1",
              "--wait-for", str(peers), "--gather-timeout", "60", "--round-timeout", "120", "--quiet"]
    results = []
    with WanLab(hosts=peers, rate_mbit=setup.rate_mbit, delay_ms=setup.delay_ms, regions=setup.regions,
                cross_rate_mbit=setup.cross_rate_mbit, cross_delay_ms=setup.cross_delay_ms) as lab:
        link = lab.describe()
        progress(link)
        inside = measure_link(lab, setup.rate_mbit, progress) if measure else None
        across = lab.measure(0, setup.regions.index(setup.regions[-1]),
                             nbytes=max(200_000, int(setup.cross_rate_mbit * 1e6 / 8 * 4))) if measure else None
        if across is not None:
            progress(f"measured between regions: {across}")
        for k, variant in enumerate(entrants):
            status = f"[{k + 1}/{len(entrants)}] {variant.name}"
            progress(f"{status} ...")

            def watch(lines: Lines, k: int = k, status: str = status) -> None:
                if tick is not None:
                    step = max((ln.get("step", 0) for ln in lines if ln.get("event") == "round"), default=0)
                    tick(k + min(1.0, step / (setup.budget if k else setup.steps)), len(entrants), status)

            try:
                out = run_swarm(lab, peers, [*common, *variant.flags], workdir / f"v{k}", setup.timeout_s, watch,
                                per_peer=variant.per_peer)
            except RuntimeError as e:
                raise RuntimeError(f"{variant.name}: {e}") from e
            finals = [final(lines) for lines in out]
            res = dict(name=variant.name, flags=list(variant.flags), eval_loss=finals[0]["eval_loss"],
                       steps=finals[0]["steps"], train_seconds=finals[0]["train_seconds"],
                       bytes_sent=sum(f["bytes_sent"] for f in finals),
                       one_model=len({f["eval_loss"] for f in finals}) == 1,
                       regions_agree=all(len({f["digest"] for f in finals if f.get("region") == r}) == 1
                                         for r in {f.get("region") for f in finals})
                       if any(f.get("region") for f in finals) else None,
                       merges=[f.get("merges") for f in finals],
                       loss_spread=max(f["eval_loss"] for f in finals) - min(f["eval_loss"] for f in finals),
                       gossip_met=[f.get("gossip_met") for f in finals],
                       utilization=sum(f["usage"]["utilization"] for f in finals) / len(finals),
                       curve=curve(out[0]))
            results.append(res)
            progress(f"    held-out loss {res['eval_loss']:.4f} after {res['steps']} steps, {res['train_seconds']:.0f} s, "
                     f"{res['bytes_sent'] / 1e6:.1f} MB sent, utilization {100 * res['utilization']:.1f}%, "
                     f"every peer ends on one model: {res['one_model']}, one state per region: {res['regions_agree']}, "
                     f"held-out losses within {res['loss_spread']:.4f}")
    return {"setup": asdict(setup), "link": link,
            "measured": {name: {"rtt_ms": m.rtt_ms, "goodput_mbit": m.goodput_mbit}
                         for name, m in (("inside", inside), ("between", across)) if m is not None},
            "results": results, "standings": standings(results)}


def markdown_table(report: dict[str, Any]) -> str:
    return finish_table(report, who="variant", baseline="flat", steps_run=False)


def plot(report: dict[str, Any], path: Path) -> Path:
    """Held-out loss vs training time of each variant, with flat DiLoCo's final loss as the finish line."""
    s = report["setup"]
    return finish_plot(report, path, baseline="flat DiLoCo", log_x=False,
                       title=f"Two regions: {s['rate_mbit']:g} Mbit/s inside, {s['cross_rate_mbit']:g} Mbit/s and "
                             f"{s['cross_delay_ms']:g} ms between")
