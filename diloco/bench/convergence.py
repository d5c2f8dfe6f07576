"""B1, `diloco bench convergence`: DiLoCo variants against synchronous data-parallel training.

Every variant trains the bundled GPT on the bundled corpus with M workers and the same token budget:
`steps` inner steps of `batch_size` sequences per worker. The DiLoCo variants run through
`diloco.sim.simulate` (the real round protocol, codecs and outer optimizer; worker i on data shard i).
The baseline is synchronous data-parallel training: one model, the same AdamW schedule, and each step
one batch from every worker's shard, which is gradient averaging over M workers every step. Reported
per variant: held-out loss of the global model, its gap to data-parallel, bytes on the wire, bits per
parameter per synchronization, and the projected compute utilization on a 100 Mbit/s, 50 ms link.

Data-parallel bytes are counted as a ring all-reduce of fp32 gradients every step: each worker sends
2·(M−1)/M · 4 bytes per parameter per step (the cheapest exact all-reduce).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .. import progress as progress_output
from ..comms import CollectiveConfig
from ..config import SwarmConfig
from ..fragments import HSchedule, inner_steps_at, parse_h_schedule
from ..job.corpus import BatchSampler, evaluate, heldout_batches
from ..job.model import GPTConfig, build_model
from ..job.train import ADAMW_BETAS, CLIP_NORM, WEIGHT_DECAY, JobConfig, inner_lr, load_corpus, save_weights
from ..sim.simulate import NetworkModel, simulate

SPARSE = "topk:64/4096+s2+ef:0.95"  # 1.56% of each chunk, 2-bit values, error feedback (SparseLoCo's recipe)


@dataclass(frozen=True)
class Variant:
    name: str
    inner_steps: int = 50
    compression: str = "fp32"
    fragments: int = 1
    overlap: int = 0
    alpha: float = 0.0
    outer_lr: float | None = None
    """None: the default outer optimizer of the compression (`diloco.outer.default_outer`)."""
    outer_momentum: float | None = None
    outer_warmup: int = 0
    """Rounds of linear outer-lr warmup."""
    lr: float | None = None
    """Inner AdamW lr of the workers (None: the job's, `--lr`)."""
    h_schedule: HSchedule = ()
    """Change H after a number of outer steps (`JobConfig.h_schedule`)."""
    warm_start: int = 0
    """Train data-parallel for this many of the budget's steps first (at the workers' lr, on the run's
    schedule), then DiLoCo from its weights for the rest."""

    def rounds(self, steps: int) -> int:
        """Outer steps that take exactly `steps` inner steps under this variant's H (and H schedule); raises
        ValueError when no number of them does."""
        done = rounds = 0
        while done < steps:
            done += inner_steps_at(rounds, self.inner_steps, self.h_schedule)
            rounds += 1
        if done != steps:
            raise ValueError(f"--steps ({steps}) must be a multiple of H={self.inner_steps} ({self.name})"
                             + (", counting each H of its schedule from where it changes" if self.h_schedule else "")
                             + (f", after its {self.warm_start} data-parallel steps" if self.warm_start else ""))
        return rounds


VARIANTS = (
    Variant("DiLoCo H=50", 50),
    Variant("DiLoCo H=100", 100),
    Variant("Streaming P=2, τ=1, α=0.5, e3m0", 50, "e3m0", fragments=2, overlap=1, alpha=0.5),
    Variant("Sparse top-k 1.6%, 2-bit, EF", 50, SPARSE),
)
NAMED = dict(zip(("h50", "h100", "streaming", "sparse"), VARIANTS))
"""The variants by the short names `--variant` takes."""
_KNOBS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "H": ("inner_steps", int), "compression": ("compression", str), "fragments": ("fragments", int),
    "overlap": ("overlap", int), "alpha": ("alpha", float), "outer_lr": ("outer_lr", float),
    "outer_momentum": ("outer_momentum", float), "outer_warmup": ("outer_warmup", int), "lr": ("lr", float),
    "h_schedule": ("h_schedule", parse_h_schedule), "warm_start": ("warm_start", int)}


def parse_variant(spec: str) -> Variant:
    """A variant from `NAME[,KNOB=VALUE...]`: one of `NAMED` with knobs changed, e.g.
    `h50,outer_lr=0.5,outer_momentum=0.8` or `sparse,H=20`. Knobs: H, compression, fragments, overlap,
    alpha, outer_lr, outer_momentum, outer_warmup, lr (the workers' inner lr), h_schedule (`80:10`, or
    `80:10+95:5` for several changes). Raises ValueError naming what is wrong."""
    name, *knobs = [part.strip() for part in spec.split(",")]
    if name not in NAMED:
        raise ValueError(f"unknown variant {name!r} in {spec!r}: choose one of {', '.join(NAMED)}")
    changes: dict[str, Any] = {}
    for knob in knobs:
        key, eq, value = knob.partition("=")
        if not eq or key not in _KNOBS:
            raise ValueError(f"{knob!r} in {spec!r}: write KNOB=VALUE with KNOB one of {', '.join(_KNOBS)}")
        field, kind = _KNOBS[key]
        try:
            changes[field] = kind(value)
        except ValueError as e:
            what = e if kind is parse_h_schedule else f"{value!r} is not a {getattr(kind, '__name__', kind)}"
            raise ValueError(f"{knob!r} in {spec!r}: {what}") from None
    base = NAMED[name]
    label = base.name
    if "inner_steps" in changes and f"H={base.inner_steps}" in label:  # 'DiLoCo H=20', not 'DiLoCo H=50 (H=20)'
        label = label.replace(f"H={base.inner_steps}", f"H={changes['inner_steps']}")
        knobs = [k for k in knobs if not k.startswith("H=")]
    return replace(base, name=f"{label} ({', '.join(knobs)})" if knobs else label, **changes)


def check_budget(v: Variant, steps: int) -> None:
    """`steps` inner steps are a warm start shorter than them plus whole outer steps of `v`; raises ValueError
    saying what does not fit."""
    if not 0 <= v.warm_start < steps:
        raise ValueError(f"warm_start ({v.warm_start}) must be below --steps ({steps}) ({v.name})")
    v.rounds(steps - v.warm_start)


Progress = Callable[[float, float | None, str | None], None]
"""(done, total, status) of one variant, in inner steps of all workers (data-parallel: steps × M)."""


def data_parallel(job: JobConfig, workers: int, steps: int, eval_every: int = 0,
                  progress: Progress | None = None, schedule_steps: int | None = None,
                  save_to: Path | None = None) -> dict[str, Any]:
    """The baseline: `steps` AdamW steps on one model, each on one batch from every worker's shard, at
    `job.lr` on `job.schedule` (`diloco.job.train.inner_lr`, as the workers); with `eval_every`, the held-out
    loss every that many steps goes into the result's `curve`. A warm start's first phase: `schedule_steps`,
    the whole run's steps its lr schedule spans (default `steps`); `save_to`, write the weights there
    (`diloco.job.train.save_weights`)."""
    torch.set_num_threads(min(job.threads * workers, os.cpu_count() or 1))  # it does the work of M workers
    corpus = load_corpus(job)
    model = build_model(GPTConfig(context=job.context, d_model=job.d_model, n_layer=job.n_layer), seed=job.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, betas=ADAMW_BETAS, weight_decay=WEIGHT_DECAY)
    samplers = [BatchSampler(corpus.train, batch_size=job.batch_size, context=job.context, seed=job.seed, shard=i,
                             num_shards=100_000) for i in range(workers)]
    heldout = heldout_batches(corpus.heldout, batch_size=16, context=job.context, max_batches=job.eval_batches)
    started = time.monotonic()
    params = sum(p.numel() for p in model.parameters())
    per_step = 2 * (workers - 1) / workers * 4 * params * workers  # all workers' bytes of one all-reduce
    curve = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = inner_lr(step, lr=job.lr, warmup=job.warmup, total=schedule_steps or steps,
                                   schedule=job.schedule)
        batches = [s.next() for s in samplers]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            curve.append(dict(step=step + 1, eval_loss=evaluate(model, heldout), bytes_sent=int(per_step * (step + 1))))
        if progress is not None:
            progress((step + 1) * workers, steps * workers, None)
    eval_loss = evaluate(model, heldout)
    curve.append(dict(step=steps, eval_loss=eval_loss, bytes_sent=int(per_step * steps)))
    if save_to is not None:
        save_weights(model, save_to)
    return dict(variant="data-parallel", workers=workers, lr=job.lr, eval_loss=eval_loss, params=params,
                bytes_sent=int(per_step * steps), bits_per_param_sync=32.0, syncs=steps,
                wall_seconds=round(time.monotonic() - started, 1), projected_utilization=None, curve=curve)


def run(job: JobConfig, workers: int, steps: int, variants: tuple[Variant, ...] = VARIANTS,
        progress: Callable[[dict[str, Any]], None] = lambda r: None, curves: bool = False,
        reporter: progress_output.Reporter | None = None, dp_lrs: Sequence[float] = ()) -> list[dict[str, Any]]:
    """Data-parallel first (once per learning rate in `dp_lrs`, default `job.lr`), then each variant on
    the same token budget; one result row each. Gaps and byte ratios are against the data-parallel row
    with the lowest held-out loss (`baseline: True`; its lr is the tuned one). With `curves`, each row's
    `curve` holds the held-out loss during training (data-parallel every 50 steps, the variants after
    every round), with inner steps and bytes sent so far. `reporter` (default: the running command's)
    shows the whole benchmark and the variant running, in inner steps of all workers."""
    for v in variants:
        check_budget(v, steps)  # raises before a run of minutes
    lrs = tuple(dp_lrs) or (job.lr,)
    dp_names = ["data-parallel"] if len(lrs) == 1 else [f"data-parallel lr={lr:g}" for lr in lrs]
    rep = reporter or progress_output.current()
    names = [*dp_names, *(v.name for v in variants)]
    budget = steps * workers  # inner steps of all workers, per variant
    with rep.task("convergence", total=budget * len(names)) as overall:
        def shown(k: int, task: progress_output.Task) -> Progress:
            def update(done: float, total: float | None, status: str | None) -> None:
                task.update(done, total, status)
                overall.update(k * budget + done, status=f"variant {k + 1}/{len(names)}: {names[k]}")
            return update

        rows = []
        for k, (name, lr) in enumerate(zip(dp_names, lrs)):
            with rep.task(f"[{k + 1}/{len(names)}] {name}") as task:
                rows.append(data_parallel(replace(job, lr=lr), workers, steps, eval_every=50 if curves else 0,
                                          progress=shown(k, task)) | dict(variant=name))
            progress(rows[-1])
        for k, v in enumerate(variants, start=len(lrs)):
            with rep.task(f"[{k + 1}/{len(names)}] {v.name}") as task:
                rows.append(_variant(job, workers, steps, v, curves, shown(k, task)))
            progress(rows[-1])
    base = min(rows[:len(lrs)], key=lambda r: r["eval_loss"])
    for r in rows:
        r["baseline"] = r is base
        r["loss_gap"] = r["eval_loss"] / base["eval_loss"] - 1
        r["bytes_ratio"] = base["bytes_sent"] / r["bytes_sent"] if r["bytes_sent"] else None
    return rows


def _variant(job: JobConfig, workers: int, steps: int, v: Variant, curves: bool, progress: Progress) -> dict[str, Any]:
    """One DiLoCo variant through the simulator (after its data-parallel warm start, if it has one): its row."""
    net = NetworkModel(bandwidth_mbit=100.0, latency_ms=50.0)
    streaming = replace(job.streaming, fragments=v.fragments, overlap=v.overlap, alpha=v.alpha)
    cfg = replace(job, lr=v.lr or job.lr, inner_steps=v.inner_steps, h_schedule=v.h_schedule,
                  rounds=v.rounds(steps - v.warm_start), streaming=streaming, outer_lr=v.outer_lr,
                  outer_momentum=v.outer_momentum, outer_warmup=v.outer_warmup, eval_every=1 if curves else 0)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="diloco-warm-") as tmp:
        warm: dict[str, Any] = dict(bytes_sent=0, curve=[])
        if v.warm_start:
            weights = Path(tmp) / "warm.safetensors"
            warm = data_parallel(cfg, workers, v.warm_start, eval_every=50 if curves else 0, schedule_steps=steps,
                                 save_to=weights)
            cfg = replace(cfg, init_from=str(weights), first_step=v.warm_start)
        out = simulate(cfg, workers, swarm=SwarmConfig(run_id="bench-convergence",
                                                          round=CollectiveConfig(compression=v.compression)),
                       net=net, progress=progress)
    diloco_curve = [dict(step=v.warm_start + c["step"], eval_loss=c["eval_loss"],
                         bytes_sent=warm["bytes_sent"] + c["bytes_sent"]) for c in out["curve"]]
    return dict(variant=v.name, workers=workers, lr=cfg.lr, eval_loss=out["eval_loss"], params=out["params"],
                bytes_sent=warm["bytes_sent"] + out["bytes_sent"], bits_per_param_sync=out["bits_per_param_sync"],
                syncs=v.warm_start + cfg.rounds, wall_seconds=round(time.monotonic() - started, 1),
                # the projection covers the DiLoCo rounds only: a warm start's data-parallel phase has none
                projected_utilization=None if v.warm_start else out["projection"]["min_utilization"],
                digests=out["digests"], curve=[*warm["curve"], *diloco_curve])


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| M | variant | held-out loss | gap to DP | bytes sent (all workers) | fewer bytes than DP | "
             "bits/param/sync | syncs | projected utilization (100 Mbit/s, 50 ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        util = "-" if r["projected_utilization"] is None else f"{r['projected_utilization']:.1%}"
        dp = r["variant"].startswith("data-parallel")
        ratio = "-" if dp or not r["bytes_ratio"] else f"{r['bytes_ratio']:,.0f}×"
        name = r["variant"] + (" (tuned)" if dp and r.get("baseline") and r["variant"] != "data-parallel" else "")
        lines.append(f"| {r['workers']} | {name} | {r['eval_loss']:.4f} | {r['loss_gap']:+.2%} | "
                     f"{r['bytes_sent'] / 1e6:,.1f} MB | {ratio} | {r['bits_per_param_sync']:.3f} | {r['syncs']} | {util} |")
    return "\n".join(lines)


def write_json(rows: list[dict[str, Any]], path: Path, setup: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"setup": setup, "results": rows}, indent=2) + "\n")


def plots(rows: list[dict[str, Any]], directory: Path, tokens_per_worker_step: int) -> list[Path]:
    """Held-out loss vs tokens (all workers) and vs bytes sent (log scale) of every row's curve, as PNG
    files in `directory` (drawn by matplotlib: `pip install "diloco[plot]"`): b1-loss-vs-{tokens,bytes}.png,
    or one pair per worker count, b1-M4-loss-vs-tokens.png..., when the rows hold several (M=1 moves no
    bytes: no bytes plot)."""
    from .plot import Series, line_plot

    counts = sorted({int(r["workers"]) for r in rows})
    written = []
    for m in counts:
        with_curves = [r for r in rows if r.get("curve") and int(r["workers"]) == m]
        stem, where = ("b1", "") if len(counts) == 1 else (f"b1-M{m}", f", M={m}")
        tokens = [Series(r["variant"], [c["step"] * tokens_per_worker_step * m for c in r["curve"]],
                         [c["eval_loss"] for c in r["curve"]]) for r in with_curves]
        moved = [Series(r["variant"], [c["bytes_sent"] for c in r["curve"]], [c["eval_loss"] for c in r["curve"]])
                 for r in with_curves if r["bytes_sent"]]  # M=1 sends nothing
        written.append(line_plot(directory / f"{stem}-loss-vs-tokens.png", tokens, x_label="tokens seen (all workers)",
                                 y_label="held-out loss", x_unit="", title=f"B1: held-out loss vs tokens{where}"))
        if moved:
            written.append(line_plot(directory / f"{stem}-loss-vs-bytes.png", moved, log_x=True,
                                     x_label="bytes sent (all workers)", y_label="held-out loss", x_unit="B",
                                     title=f"B1: held-out loss vs bytes sent{where}"))
    return written


def replot_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of a result written by `write_json` (each with its `workers`) and the tokens of one inner
    step of one worker in its setup."""
    saved = json.loads(Path(path).read_text())
    setup = saved["setup"]
    if not any(r.get("curve") for r in saved["results"]):
        raise ValueError("it holds no curves: it was written by a run without --plots")
    rows = [{"workers": setup["workers"]} | r for r in saved["results"]]  # results before several M name none
    return rows, int(setup["batch_size"]) * int(setup.get("context", JobConfig().context))
