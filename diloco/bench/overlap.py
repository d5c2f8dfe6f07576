"""Benchmark B4: compute utilization of plain DiLoCo vs Streaming DiLoCo with overlap, on an emulated
wide-area link where a full synchronization costs many inner steps.

Real peers (`diloco start` / `diloco join` processes training the bundled model) run in network
namespaces joined by shaped links (`diloco.bench.wan.WanLab`: kernel netem where the kernel has it, else
tbf rate limiting plus a userspace delay line). Every variant runs on the same lab, one after the
other, with the same model, data, H, compression and number of outer steps; each peer reports its
own accounting (`DiLoCo.usage()`): compute utilization = inner-step time / wall time, time blocked
on the network, bytes. The report also states what a full-model synchronization costs in inner
steps on that link (measured from the plain variant's blocking rounds).

Needs root (network namespaces). `diloco bench overlap --help` lists the knobs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

from .lab import Tick, final, measure_link, run_swarm


@dataclass(frozen=True)
class Variant:
    name: str
    fragments: int = 1
    overlap: int = 0
    alpha: float = 0.0
    outer_overlap: str = "none"

    def flags(self) -> list[str]:
        return ["--fragments", str(self.fragments), "--overlap", str(self.overlap), "--alpha", str(self.alpha),
                "--outer-overlap", self.outer_overlap]


def default_variants(inner_steps: int, fragments: int, tau: int) -> list[Variant]:
    return [
        Variant("plain DiLoCo"),
        Variant(f"streaming P={fragments}, no overlap", fragments=fragments),
        Variant(f"streaming P={fragments}, overlap tau={tau}, alpha=0.5", fragments=fragments, overlap=tau, alpha=0.5),
        Variant("eager (whole outer step overlapped)", outer_overlap="eager"),
    ]


@dataclass
class OverlapSetup:
    peers: int = 2
    rate_mbit: float = 1.0
    delay_ms: float = 50.0
    inner_steps: int = 60
    outer_steps: int = 3
    fragments: int = 4
    tau: int = 10
    compression: str = "e3m0"
    d_model: int = 192
    layers: int = 4
    batch_size: int = 8
    timeout_s: float = 900.0
    variants: list[Variant] = field(default_factory=list)


@dataclass
class VariantResult:
    name: str
    utilization: float  # mean over peers
    blocked_seconds: float  # mean over peers
    blocked_waits: float
    wall_seconds: float
    steps: int
    rounds_committed: int
    bytes_sent: int  # all peers
    peak_mbit: float  # largest per-step rate seen by any peer
    mean_mbit: float
    seconds_per_step: float
    eval_loss: float
    digests_agree: bool
    per_peer: list[dict[str, Any]]




def run(setup: OverlapSetup, *, workdir: Path | None = None,
        progress: Callable[[str], None] = print, tick: Tick | None = None) -> dict[str, Any]:
    """Build one WAN lab and run every variant on it; returns the report (also the JSON). `progress`
    gets a line per event; `tick`, how far the benchmark is (about every 2 s while a variant runs)."""
    from .wan import WanLab

    workdir = Path(workdir or tempfile.mkdtemp(prefix="diloco-bench-overlap-"))
    workdir.mkdir(parents=True, exist_ok=True)
    variants = setup.variants or default_variants(setup.inner_steps, setup.fragments, setup.tau)
    results: list[VariantResult] = []
    with WanLab(hosts=setup.peers, rate_mbit=setup.rate_mbit, delay_ms=setup.delay_ms) as lab:
        link = lab.describe()
        progress(link)
        measured = measure_link(lab, setup.rate_mbit, progress)
        for k, v in enumerate(variants):
            progress(f"[{k + 1}/{len(variants)}] {v.name} ...")
            status = f"[{k + 1}/{len(variants)}] {v.name}"
            share = partial(_share_done, k, len(variants), status, tick) if tick is not None else None
            res = _run_variant(lab, setup, v, workdir / f"v{k}", share)
            results.append(res)
            progress(f"    utilization {100 * res.utilization:.1f}%, blocked {res.blocked_seconds:.1f} s/peer, "
                     f"{res.seconds_per_step * 1000:.0f} ms/step, wall {res.wall_seconds:.0f} s, "
                     f"loss {res.eval_loss:.4f}, digests agree: {res.digests_agree}")
    plain = next((r for r in results if r.name == "plain DiLoCo"), None)
    full_sync_steps = None
    if plain is not None and plain.rounds_committed and plain.seconds_per_step > 0:
        full_sync_steps = round(plain.blocked_seconds / setup.outer_steps / plain.seconds_per_step, 1)
    return {
        "setup": {k: v for k, v in asdict(setup).items() if k != "variants"},
        "link": link,
        "measured_link": {"rtt_ms": measured.rtt_ms, "goodput_mbit": measured.goodput_mbit},
        "full_sync_costs_inner_steps": full_sync_steps,
        "results": [asdict(r) for r in results],
    }


def _share_done(k: int, variants: int, status: str, tick: Tick, share: float) -> None:
    tick(k + min(1.0, share), variants, status)


def rounds_share(lines: list[dict[str, Any]], outer_steps: int, fragments: int) -> float:
    """How far a variant is, from its first peer's metrics: committed rounds over the rounds it runs."""
    done = sum(1 for ln in lines if ln.get("event") == "round" and ln.get("committed"))
    return done / max(1, outer_steps * fragments)


def _run_variant(lab: Any, setup: OverlapSetup, v: Variant, workdir: Path,
                 share: Callable[[float], None] | None = None) -> VariantResult:
    args = ["--rounds", str(setup.outer_steps), "--inner-steps", str(setup.inner_steps),
            "--compression", setup.compression, "--d-model", str(setup.d_model), "--layers", str(setup.layers),
            "--batch-size", str(setup.batch_size), "--wait-for", str(setup.peers), "--gather-timeout", "60",
            "--round-timeout", "120", "--verbose", *v.flags()]
    watch = (lambda lines: share(rounds_share(lines, setup.outer_steps, v.fragments))) if share is not None else None
    try:
        peers = run_swarm(lab, setup.peers, args, workdir, setup.timeout_s, watch)
    except RuntimeError as e:
        raise RuntimeError(f"{v.name}: {e}") from e
    finals = [final(lines) for lines in peers]
    rounds = [sum(1 for ln in lines if ln.get("event") == "round" and ln.get("committed")) for lines in peers]
    usage = [f["usage"] for f in finals]
    steps = min(u["steps"] for u in usage)
    return VariantResult(
        name=v.name,
        utilization=statistics.fmean(u["utilization"] for u in usage),
        blocked_seconds=statistics.fmean(u["blocked_seconds"] for u in usage),
        blocked_waits=statistics.fmean(u["blocked_waits"] for u in usage),
        wall_seconds=statistics.fmean(u["wall_seconds"] for u in usage),
        steps=steps,
        rounds_committed=min(rounds),
        bytes_sent=sum(f["bytes_sent"] for f in finals),
        peak_mbit=max(u["peak_bandwidth_bytes_per_s"] for u in usage) * 8 / 1e6,
        mean_mbit=statistics.fmean(u["mean_bandwidth_bytes_per_s"] for u in usage) * 8 / 1e6,
        seconds_per_step=statistics.fmean((u["wall_seconds"] - u["sync_seconds"]) / max(1, u["steps"]) for u in usage),
        eval_loss=finals[0]["eval_loss"],
        digests_agree=len({f["digest"] for f in finals}) == 1,
        per_peer=[{"usage": u, "rounds_committed": r} for u, r in zip(usage, rounds)],
    )


def markdown_table(report: dict[str, Any]) -> str:
    peers = report["setup"]["peers"]
    rows = ["| variant | compute utilization | blocked s/peer | ms/inner step | wall s | rounds | MB sent (all) "
            "| MB per round per peer | fastest round Mbit/s | held-out loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        per_round = r["bytes_sent"] / max(1, r["rounds_committed"]) / peers
        rows.append(f"| {r['name']} | {100 * r['utilization']:.1f}% | {r['blocked_seconds']:.1f} | "
                    f"{1000 * r['seconds_per_step']:.0f} | {r['wall_seconds']:.0f} | {r['rounds_committed']} | "
                    f"{r['bytes_sent'] / 1e6:.2f} | {per_round / 1e6:.3f} | {r['peak_mbit']:.1f} | {r['eval_loss']:.4f} |")
    return "\n".join(rows)


def write_json(report: dict[str, Any], path: Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
