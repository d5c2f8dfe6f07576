"""B1, `diloco bench convergence`: DiLoCo variants against synchronous data-parallel training.

Every variant trains the bundled GPT on the bundled corpus with M workers and the same token budget:
`steps` inner steps of `batch_size` sequences per worker. The DiLoCo variants run through
`diloco.simulate` (the real round protocol, codecs and outer optimizer; worker i on data shard i).
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
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from . import progress as progress_output
from .config import SwarmConfig
from .corpus import BatchSampler, evaluate, heldout_batches
from .model import GPTConfig, build_model
from .simulate import NetworkModel, simulate
from .train import JobConfig, load_corpus

SPARSE = "topk:64/4096+s2+ef:0.95"  # 1.56% of each chunk, 2-bit values, error feedback (SparseLoCo's recipe)


@dataclass(frozen=True)
class Variant:
    name: str
    inner_steps: int = 50
    compression: str = "fp32"
    fragments: int = 1
    overlap: int = 0
    alpha: float = 0.0


VARIANTS = (
    Variant("DiLoCo H=50", 50),
    Variant("DiLoCo H=100", 100),
    Variant("Streaming P=2, τ=1, α=0.5, e3m0", 50, "e3m0", fragments=2, overlap=1, alpha=0.5),
    Variant("Sparse top-k 1.6%, 2-bit, EF", 50, SPARSE),
)


Progress = Callable[[float, float | None, str | None], None]
"""(done, total, status) of one variant, in inner steps of all workers (data-parallel: steps × M)."""


def data_parallel(job: JobConfig, workers: int, steps: int, eval_every: int = 0,
                  progress: Progress | None = None) -> dict[str, Any]:
    """The baseline: `steps` AdamW steps on one model, each on one batch from every worker's shard;
    with `eval_every`, the held-out loss every that many steps goes into the result's `curve`."""
    torch.set_num_threads(min(job.threads * workers, os.cpu_count() or 1))  # it does the work of M workers
    corpus = load_corpus(job)
    model = build_model(GPTConfig(context=job.context, d_model=job.d_model, n_layer=job.n_layer), seed=job.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, betas=(0.9, 0.95), weight_decay=0.1)
    samplers = [BatchSampler(corpus.train, batch_size=job.batch_size, context=job.context, seed=job.seed, shard=i,
                             num_shards=100_000) for i in range(workers)]
    heldout = heldout_batches(corpus.heldout, batch_size=16, context=job.context, max_batches=job.eval_batches)
    started = time.monotonic()
    params = sum(p.numel() for p in model.parameters())
    per_step = 2 * (workers - 1) / workers * 4 * params * workers  # all workers' bytes of one all-reduce
    curve = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = job.lr * min(1.0, (step + 1) / max(1, job.warmup))
        batches = [s.next() for s in samplers]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            curve.append(dict(step=step + 1, eval_loss=evaluate(model, heldout), bytes_sent=int(per_step * (step + 1))))
        if progress is not None:
            progress((step + 1) * workers, steps * workers, None)
    eval_loss = evaluate(model, heldout)
    curve.append(dict(step=steps, eval_loss=eval_loss, bytes_sent=int(per_step * steps)))
    return dict(variant="data-parallel", eval_loss=eval_loss, params=params,
                bytes_sent=int(per_step * steps), bits_per_param_sync=32.0, syncs=steps,
                wall_seconds=round(time.monotonic() - started, 1), projected_utilization=None, curve=curve)


def run(job: JobConfig, workers: int, steps: int, variants: tuple[Variant, ...] = VARIANTS,
        progress: Callable[[dict[str, Any]], None] = lambda r: None, curves: bool = False,
        reporter: progress_output.Reporter | None = None) -> list[dict[str, Any]]:
    """Data-parallel first, then each variant on the same token budget; one result row each. With
    `curves`, each row's `curve` holds the held-out loss during training (data-parallel every 50 steps,
    the variants after every round), with inner steps and bytes sent so far. `reporter` (default: the
    running command's) shows the whole benchmark and the variant running, in inner steps of all workers."""
    for v in variants:
        if steps % v.inner_steps:
            raise ValueError(f"--steps ({steps}) must be a multiple of H={v.inner_steps} ({v.name})")
    rep = reporter or progress_output.current()
    names = ["data-parallel", *(v.name for v in variants)]
    budget = steps * workers  # inner steps of all workers, per variant
    with rep.task("convergence", total=budget * len(names)) as overall:
        def shown(k: int, task: progress_output.Task) -> Progress:
            def update(done: float, total: float | None, status: str | None) -> None:
                task.update(done, total, status)
                overall.update(k * budget + done, status=f"variant {k + 1}/{len(names)}: {names[k]}")
            return update

        with rep.task(f"[1/{len(names)}] data-parallel") as task:
            rows = [data_parallel(job, workers, steps, eval_every=50 if curves else 0, progress=shown(0, task))]
        progress(rows[0])
        for k, v in enumerate(variants, start=1):
            with rep.task(f"[{k + 1}/{len(names)}] {v.name}") as task:
                rows.append(_variant(job, workers, steps, v, curves, shown(k, task)))
            progress(rows[-1])
    base = rows[0]
    for r in rows:
        r["loss_gap"] = r["eval_loss"] / base["eval_loss"] - 1
        r["bytes_ratio"] = base["bytes_sent"] / r["bytes_sent"] if r["bytes_sent"] else None
    return rows


def _variant(job: JobConfig, workers: int, steps: int, v: Variant, curves: bool, progress: Progress) -> dict[str, Any]:
    """One DiLoCo variant through the simulator: its result row."""
    net = NetworkModel(bandwidth_mbit=100.0, latency_ms=50.0)
    cfg = replace(job, inner_steps=v.inner_steps, rounds=steps // v.inner_steps, fragments=v.fragments,
                  overlap=v.overlap, alpha=v.alpha, eval_every=1 if curves else 0)
    started = time.monotonic()
    out = simulate(cfg, workers, swarm=SwarmConfig(run_id="bench-convergence", compression=v.compression), net=net,
                   progress=progress)
    return dict(variant=v.name, eval_loss=out["eval_loss"], params=out["params"], bytes_sent=out["bytes_sent"],
                bits_per_param_sync=out["bits_per_param_sync"], syncs=cfg.rounds,
                wall_seconds=round(time.monotonic() - started, 1),
                projected_utilization=out["projection"]["min_utilization"], digests=out["digests"],
                curve=[dict(step=c["step"], eval_loss=c["eval_loss"], bytes_sent=c["bytes_sent"])
                       for c in out["curve"]])


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | held-out loss | gap to DP | bytes sent (all workers) | fewer bytes than DP | "
             "bits/param/sync | syncs | projected utilization (100 Mbit/s, 50 ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        util = "-" if r["projected_utilization"] is None else f"{r['projected_utilization']:.1%}"
        ratio = "-" if r["variant"] == "data-parallel" or not r["bytes_ratio"] else f"{r['bytes_ratio']:,.0f}×"
        lines.append(f"| {r['variant']} | {r['eval_loss']:.4f} | {r['loss_gap']:+.2%} | {r['bytes_sent'] / 1e6:,.1f} MB | "
                     f"{ratio} | {r['bits_per_param_sync']:.3f} | {r['syncs']} | {util} |")
    return "\n".join(lines)


def write_json(rows: list[dict[str, Any]], path: Path, setup: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"setup": setup, "results": rows}, indent=2) + "\n")


def plots(rows: list[dict[str, Any]], directory: Path, tokens_per_step: int) -> list[Path]:
    """Held-out loss vs tokens and vs bytes sent (log scale) of every row's curve, as PNG files in
    `directory` (drawn by matplotlib: `pip install "diloco[plot]"`)."""
    from .plot import Series, line_plot

    with_curves = [r for r in rows if r.get("curve")]
    tokens = [Series(r["variant"], [c["step"] * tokens_per_step for c in r["curve"]],
                     [c["eval_loss"] for c in r["curve"]]) for r in with_curves]
    moved = [Series(r["variant"], [c["bytes_sent"] for c in r["curve"]], [c["eval_loss"] for c in r["curve"]])
             for r in with_curves]
    return [line_plot(directory / "b1-loss-vs-tokens.png", tokens, x_label="tokens seen (all workers)",
                      y_label="held-out loss", x_unit="", title="B1: held-out loss vs tokens"),
            line_plot(directory / "b1-loss-vs-bytes.png", moved, log_x=True, x_label="bytes sent (all workers)",
                      y_label="held-out loss", x_unit="B", title="B1: held-out loss vs bytes sent")]


def replot_rows(path: Path, context: int) -> tuple[list[dict[str, Any]], int]:
    """The rows of a result written by `write_json` and the tokens per step of its setup (all workers)."""
    saved = json.loads(Path(path).read_text())
    setup = saved["setup"]
    if not any(r.get("curve") for r in saved["results"]):
        raise ValueError("it holds no curves: it was written by a run without --plots")
    return saved["results"], int(setup["workers"]) * int(setup["batch_size"]) * context
