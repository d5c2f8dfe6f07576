"""B5, `diloco bench wrapper`: what the wrapper costs a training loop, per inner step.

The bundled GPT trains in one process, with no network: each run of an H holds two copies of the model, one in
the bare loop (forward, backward, AdamW step) and one inside `DiLoCo(model, optimizer, inner_steps=H)`, stepped in
turns, so that the device's and the host's drift falls on both alike; every step is timed after a warm-up, and the
median of each H's runs is reported. A wrapped run's warm-up starts with one synchronization (`DiLoCo.sync()`): the first one of a process
allocates (and on a GPU pins) the buffers every later one reuses, a cost a run pays once, and with H as long as the
timed steps it would be the only synchronization timed. The wrapper's cost is split in two: what every step pays (the post-step hook, accounting,
the schedule's check), measured on the steps that do not synchronize, and what a synchronization
costs (pseudo-gradient, the local encode and decode, the outer step, loading θ), spread over its H
steps. The work a synchronization leaves beside training (hashing the new state) shares the host with both loops:
the bare steps taken while it runs are compared with the other plain ones (`beside_steps`, `beside_slowdown`).
Without a swarm the synchronization moves nothing: the network's share is what
`diloco bench overlap` and `diloco simulate` measure.

`device` puts the model and its batches on a GPU (`cuda`); θ and the outer state then stay in host memory
(the wrapper's default) unless `global_device` says otherwise, so a synchronization's share includes moving
Δ to the host and θ back. On a GPU each step is timed to its end (`torch.cuda.synchronize`), in both loops.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..job.corpus import BatchSampler
from ..job.model import GPTConfig, build_model
from ..job.train import ADAMW_BETAS, WEIGHT_DECAY, JobConfig, load_corpus
from ..outer import wait_for_gpus
from ..wrapper import DiLoCo, subnormals_flushed
from .devices import median_time, profiled, waiter

Tick = Callable[[float, float, str], None]


@dataclass(frozen=True)
class WrapperSetup:
    job: JobConfig
    """The model (width, blocks, batch, threads) of every run."""
    inner_steps: tuple[int, ...] = (50, 100, 500)
    steps: int = 500
    """Timed inner steps per run (each run takes `warmup` more first)."""
    warmup: int = 20
    repeats: int = 3
    compression: str = "fp32"
    device: str = "cpu"
    """Where the model trains (cpu, cuda, cuda:N)."""
    global_device: str = "cpu"
    """Where the wrapper keeps θ and the outer state (`DiLoCo(global_device=...)`)."""
    flush_denormal: bool = True
    """Flush subnormal floats to zero in both loops (`torch.set_flush_denormal`). On a CPU, DiLoCo's
    weights make the model's arithmetic meet subnormals that plain training's do not (measured: the
    bundled GPT's inner step grows from 118 to 191 ms by step 500 at H=50, flat at 114-119 ms with
    flushing): a cost of the weights' values, not of the wrapper's code, which this benchmark measures."""
    checkpoints: bool = False
    """Also time a synchronization that makes a periodic checkpoint due (`checkpoint_cost`)."""
    autocast: bool = False
    """Run the forward pass under bf16 autocast (fp32 weights), in both loops: how large models train on a GPU."""
    profile: Path | None = None
    """Write a `torch.profiler` table of `sync_cost`'s timed rounds here (the operators by time on the training
    thread, and on the GPU where there is one)."""


def _model(job: JobConfig, device: torch.device) -> torch.nn.Module:
    """The bundled GPT at `job`'s size from `job`'s seed (every copy starts equal), on `device`."""
    return build_model(GPTConfig(context=job.context, d_model=job.d_model, n_layer=job.n_layer),
                       seed=job.seed).to(device)


class _Loop:
    """One copy of the bundled GPT at `setup.job`'s size on `device`, its AdamW and its batches (the same seed, so
    every copy starts equal), stepped and timed one step at a time."""

    def __init__(self, setup: WrapperSetup, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device):
        self.model = _model(setup.job, device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=setup.job.lr, betas=ADAMW_BETAS,
                                     weight_decay=WEIGHT_DECAY)
        self.batches, self.device, self.autocast = batches, device, setup.autocast
        self.finish = waiter(device)

    def step(self, k: int) -> float:
        """One inner step (forward, backward, AdamW), in seconds to its end: a GPU step ends when its kernels have
        run, not when Python has queued them."""
        x, y = self.batches[k % len(self.batches)]
        started = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            _, loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.finish()
        return time.perf_counter() - started


def _run(setup: WrapperSetup, h: int, corpus: Any) -> dict[str, Any]:
    """One run of H: the bare loop and the same loop inside `DiLoCo(inner_steps=h)`, on two copies of the model with
    the same batches, in turns step by step (which of the two goes first alternates). A drift of the device or the
    host moves the mean step of separate runs by several percent (measured on an H200: bare runs of 19.8-25.5 ms);
    in turns it falls on both loops alike. Per timed step: both times (seconds), whether the wrapped one
    synchronized, and whether the wrapper's state was being hashed beside training then (that work shares the host
    with both loops: `beside`)."""
    job = setup.job
    torch.set_num_threads(job.threads)
    device = torch.device(setup.device)
    sampler = BatchSampler(corpus.train, batch_size=job.batch_size, context=job.context, seed=job.seed, shard=0,
                           num_shards=100_000)
    # the same few batches, already on the device: the loop, not the sampler or the copy, is timed
    batches = [(x.to(device), y.to(device)) for x, y in (sampler.next() for _ in range(16))]
    bare, wrapped = _Loop(setup, batches, device), _Loop(setup, batches, device)
    times: dict[str, list[float]] = {"bare": [], "wrapped": []}
    synced: list[bool] = []
    beside: list[bool] = []
    with DiLoCo(wrapped.model, wrapped.opt, swarm=None, inner_steps=h, compression=setup.compression,
                global_device=setup.global_device) as d:
        holding = d.member.holding

        def hashing() -> bool:
            return holding.known() == ""

        d.sync()  # the first synchronization is the cold one: in the warm-up
        for k in range(setup.warmup + setup.steps):
            before, busy = d.round, hashing()
            for name in ("bare", "wrapped") if k % 2 == 0 else ("wrapped", "bare"):
                times[name].append((bare if name == "bare" else wrapped).step(k))
            synced.append(d.round != before)
            beside.append(busy or hashing())
    cut = setup.warmup
    return {"bare": times["bare"][cut:], "wrapped": times["wrapped"][cut:], "synced": synced[cut:],
            "beside": beside[cut:], "params": sum(p.numel() for p in bare.model.parameters())}


REFERENCE = 8
"""Plain bare steps just before a sync that its cost is measured against (`_reference`)."""


def _reference(bare: list[float], synced: list[bool], i: int) -> float:
    """What the bare loop took for a step around sync step `i`: the median of the last `REFERENCE` bare steps
    before it that were not syncs (the first ones after it when there are none). Not the bare step taken in turn
    with the sync: after the sync it runs beside the hash the sync starts, and which of the two goes first at a
    sync depends on H's parity."""
    before = [b for b, s in zip(bare[:i], synced[:i]) if not s][-REFERENCE:]
    return statistics.median(before or [b for b, s in zip(bare[i + 1:], synced[i + 1:]) if not s][:REFERENCE]
                             or [bare[i]])


def _figures(x: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: each loop's mean step, the wrapper's overhead over the bare steps taken in turn with its
    own, every step's share (the steps that do not synchronize), each sync less the bare loop's step just before it
    (`_reference`), and the bare steps beside the hash of the wrapper's state against the other plain ones, with
    their number per sync (None when the run had no sync)."""
    steps = list(zip(x["bare"], x["wrapped"], x["synced"], x["beside"]))
    plain = [(b, w) for b, w, s, _ in steps if not s]
    quiet = [b for b, _, s, h in steps if not s and not h]
    near = [b for b, _, s, h in steps if not s and h]
    syncs = sum(x["synced"])
    return {"bare": statistics.fmean(x["bare"]), "wrapped": statistics.fmean(x["wrapped"]),
            "overhead": sum(x["wrapped"]) / sum(x["bare"]) - 1,
            "per_step": sum(w for _, w in plain) / sum(b for b, _ in plain) - 1 if plain else 0.0,
            "syncs": [w - _reference(x["bare"], x["synced"], i) for i, (_, w, s, _) in enumerate(steps) if s],
            "beside_steps": len(near) / syncs if syncs else None,
            "beside": statistics.fmean(near) / statistics.fmean(quiet) - 1 if near and quiet else None}


def run(setup: WrapperSetup, tick: Tick = lambda done, total, status: None, loops: bool = True) -> dict[str, Any]:
    """Each H `repeats` times (`_run`: the bare and the wrapped loop in turns); per H the median run's figures
    (`_figures`); the bare row is the median of every run's bare mean. Then a synchronization's time on the training
    thread against its floor (`sync`); `loops` False: only that. All of it with subnormals flushed or not as
    `setup.flush_denormal` says (the floor and the sync as the loops)."""
    with subnormals_flushed(setup.flush_denormal):
        return _measured(setup, tick, loops)


def _measured(setup: WrapperSetup, tick: Tick, loops: bool) -> dict[str, Any]:
    if not loops:
        cost = sync_cost(setup)
        tick(1, 1, "done")
        return {"params": cost["params"], "rows": [], "sync": cost,
                **({"checkpoint": checkpoint_cost(setup)} if setup.checkpoints else {})}
    corpus = load_corpus(setup.job)
    runs: dict[int, list[dict[str, Any]]] = {h: [] for h in setup.inner_steps}
    total = setup.repeats * len(setup.inner_steps)
    params = 0
    for r in range(setup.repeats):
        for i, h in enumerate(setup.inner_steps):
            tick(r * len(setup.inner_steps) + i, total, f"H={h}")
            x = _run(setup, h, corpus)
            params = x["params"]
            runs[h].append({"synced": sum(x["synced"]), **_figures(x)})
    tick(total, total, "done")

    bares = [f["bare"] for h in setup.inner_steps for f in runs[h]]
    bare = statistics.median(bares)
    rows = [dict(kind="bare", inner_steps=None, mean_step_ms=bare * 1e3, overhead=0.0, per_step_overhead=0.0,
                 sync_ms=None, sync_overhead=0.0, syncs=[0] * len(bares), runs=[b * 1e3 for b in bares],
                 beside_steps=None, beside_slowdown=None)]
    for h in setup.inner_steps:
        figs = runs[h]
        syncs = [t for f in figs for t in f["syncs"]]
        sync = statistics.median(syncs) if syncs else 0.0
        rows.append(dict(kind=f"DiLoCo H={h}", inner_steps=h,
                         mean_step_ms=statistics.median(f["wrapped"] for f in figs) * 1e3,
                         overhead=statistics.median(f["overhead"] for f in figs),
                         per_step_overhead=statistics.median(f["per_step"] for f in figs), sync_ms=sync * 1e3,
                         sync_overhead=sync / h / statistics.median(f["bare"] for f in figs),
                         syncs=[f["synced"] for f in figs], runs=[f["wrapped"] * 1e3 for f in figs],
                         bare_runs=[f["bare"] * 1e3 for f in figs],
                         beside_steps=_median_or_none([f["beside_steps"] for f in figs]),
                         beside_slowdown=_median_or_none([f["beside"] for f in figs])))
    return {"params": params, "rows": rows, "sync": sync_cost(setup),
            **({"checkpoint": checkpoint_cost(setup)} if setup.checkpoints else {})}


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def markdown_table(report: dict[str, Any]) -> str:
    lines = ["| loop | inner step (median run) | overhead | every step's share | a sync | its share over H "
             "| steps beside the hash a round | a bare step there |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        sync = "-" if r["sync_ms"] is None else f"{r['sync_ms']:.1f} ms"
        steps = "-" if r["beside_steps"] is None else f"{r['beside_steps']:.1f}"
        slow = "-" if r["beside_slowdown"] is None else f"{r['beside_slowdown']:+.2%}"
        lines.append(f"| {r['kind']} | {r['mean_step_ms']:.2f} ms | {r['overhead']:+.2%} | {r['per_step_overhead']:+.2%} | "
                     f"{sync} | {r['sync_overhead']:+.2%} | {steps} | {slow} |")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: Path, setup: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"setup": setup, **report}, indent=2) + "\n")


@torch.no_grad()
def _floor(theta: list[torch.Tensor], local: list[torch.Tensor], delta: list[torch.Tensor],
           outer: torch.optim.Optimizer) -> None:
    """The least a synchronization does on the training thread, in bare torch: Δ = θ − θ_local into memory kept
    for it (with θ in host memory and the model on a GPU: θ crosses to the GPU, the subtraction runs there and Δ
    crosses back, which beats Δ's crossing and a pass over host memory), the Nesterov step with Δ as θ's gradient
    (foreach, in place), and θ copied back into the model."""
    if delta[0].device != local[0].device:
        for d, t, p in zip(delta, theta, local):
            on_gpu = t.to(p.device, non_blocking=True)
            d.copy_(on_gpu.sub_(p), non_blocking=True)
        wait_for_gpus(local)
    else:
        for d, t, p in zip(delta, theta, local):
            torch.sub(t, p, out=d)
    for t, d in zip(theta, delta):
        t.grad = d
    outer.step()
    torch._foreach_copy_(local, theta, non_blocking=True)


def _fixed_gradients(setup: WrapperSetup) -> tuple[torch.nn.Module, list[torch.Tensor], list[torch.Tensor],
                                                   Callable[[], None]]:
    """The bundled GPT at `setup.job`'s size on `setup.device`, its parameters, a fixed gradient for each (the sync
    does not depend on forward or backward), and how to wait for the device."""
    job = setup.job
    torch.set_num_threads(job.threads)
    device = torch.device(setup.device)
    model = _model(job, device)
    params: list[torch.Tensor] = list(model.parameters())
    gen = torch.Generator().manual_seed(job.seed)
    grads = [(torch.randn(p.shape, generator=gen) * 1e-3).to(device) for p in params]
    return model, params, grads, waiter(device)


def _timed_rounds(d: DiLoCo, opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor],
                  finish: Callable[[], None], inner_steps: int, syncs: int) -> dict[str, Any]:
    """`syncs` rounds of `inner_steps` fixed-gradient steps through `d`, after one untimed: a plain step, a sync
    (its step less a plain one) and a round beyond its plain steps (the sync, and any step slowed by the work
    beside training), all in seconds (medians)."""
    times: list[float] = []
    synced: list[bool] = []
    waited = 0.0
    for k in range((syncs + 1) * inner_steps):
        for p, g in zip(params, grads):
            p.grad = g
        if k == inner_steps:
            waited = d.member.holding.waited
        before = d.round
        started = time.perf_counter()
        opt.step()
        finish()
        if k >= inner_steps:  # the first round is untimed
            times.append(time.perf_counter() - started)
            synced.append(d.round != before)
    plain = statistics.median(t for t, s in zip(times, synced) if not s)
    return {"plain": plain, "sync": statistics.median(t for t, s in zip(times, synced) if s) - plain,
            "round_extra": sum(times) / sum(synced) - inner_steps * plain, "syncs": sum(synced),
            "waited": (d.member.holding.waited - waited) / sum(synced)}


def sync_cost(setup: WrapperSetup, inner_steps: int = 32, syncs: int = 5) -> dict[str, Any]:
    """A synchronization's time on the training thread against the floor, measured in one process on one model
    (`setup.job`'s size: 85M parameters at width 768 and 12 blocks), fixed gradients, `inner_steps` steps a round,
    `syncs` rounds after one untimed (`_timed_rounds`). The floor (`_floor`) runs `syncs` times on copies of the same
    tensors. θ lives on `setup.global_device`, as the wrapper keeps it. A round shorter than the hash of the state
    before it (fixed-gradient steps on a GPU are short) waits for that hash at its sync: `waited_ms` says how long,
    `own_ratio` compares the rest with the floor."""
    model, params, grads, finish = _fixed_gradients(setup)
    device, global_device = torch.device(setup.device), torch.device(setup.global_device)
    local = [p.detach() for p in params]
    pinned = global_device.type == "cpu" and device.type == "cuda"
    theta = [p.detach().to(global_device, copy=True) for p in params]
    if pinned:  # as the wrapper keeps θ: a copy from pageable memory would wait for the GPU before each parameter
        theta = [t.pin_memory() for t in theta]
    delta = [torch.empty_like(t, pin_memory=pinned) for t in theta]
    outer = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True, foreach=True)
    floor, _ = median_time(lambda: _floor(theta, local, delta, outer), syncs, finish, warmup=1)
    del theta, delta, outer

    opt = torch.optim.SGD(params, lr=1e-3)
    with DiLoCo(model, opt, swarm=None, inner_steps=inner_steps, compression=setup.compression,
                global_device=setup.global_device) as d, profiled(setup.profile, device):
        t = _timed_rounds(d, opt, params, grads, finish, inner_steps, syncs)
    return {"params": sum(p.numel() for p in params), "floor_ms": floor * 1e3, "sync_ms": t["sync"] * 1e3,
            "ratio": t["sync"] / floor, "waited_ms": t["waited"] * 1e3,
            "own_ratio": max(0.0, t["sync"] - t["waited"]) / floor, "round_extra_ms": t["round_extra"] * 1e3,
            "round_ratio": t["round_extra"] / floor, "plain_step_ms": t["plain"] * 1e3, "inner_steps": inner_steps,
            "syncs": t["syncs"]}


def checkpoint_cost(setup: WrapperSetup, inner_steps: int = 256, syncs: int = 3) -> dict[str, Any]:
    """What a periodic checkpoint costs the training thread: `sync_cost`'s loop with a checkpoint every round
    (written beside training: the sync's time, and a round's beyond its plain steps, which includes any wait of the
    next round for the write: a round shorter than the write waits for it), against the same checkpoint written on
    the training thread (`DiLoCo.save_checkpoint`, median of `syncs`). The checkpoints go to a temporary directory,
    deleted after."""
    import tempfile

    model, params, grads, finish = _fixed_gradients(setup)
    opt = torch.optim.SGD(params, lr=1e-3)
    with tempfile.TemporaryDirectory(prefix="diloco-bench-ckpt-") as root:
        with DiLoCo(model, opt, swarm=None, inner_steps=inner_steps, compression=setup.compression,
                    global_device=setup.global_device, checkpoint_dir=root, checkpoint_every=1) as d:
            t = _timed_rounds(d, opt, params, grads, finish, inner_steps, syncs)
            saves = []
            for _ in range(syncs):
                started = time.perf_counter()
                d.save_checkpoint(keep=1)
                saves.append(time.perf_counter() - started)
    return {"sync_ms": t["sync"] * 1e3, "round_extra_ms": t["round_extra"] * 1e3,
            "save_ms": statistics.median(saves) * 1e3, "round_ms": inner_steps * t["plain"] * 1e3,
            "inner_steps": inner_steps, "syncs": t["syncs"]}


def checkpoint_table(cost: dict[str, Any]) -> str:
    return "\n".join([
        "| a round's plain steps | a sync with a checkpoint due | a round beyond its plain steps "
        "| the same checkpoint on the training thread |",
        "|---|---|---|---|",
        f"| {cost['inner_steps']} × = {cost['round_ms']:.0f} ms | {cost['sync_ms']:.1f} ms "
        f"| {cost['round_extra_ms']:.1f} ms | {cost['save_ms']:.1f} ms |"])


def sync_table(cost: dict[str, Any]) -> str:
    return "\n".join([
        "| parameters | the floor (bare torch) | a sync on the training thread | × the floor "
        "| of which waiting for the last round's digest | the rest × the floor "
        "| a round beyond its plain steps | × the floor |",
        "|---|---|---|---|---|---|---|---|",
        f"| {cost['params'] / 1e6:.1f}M | {cost['floor_ms']:.1f} ms | {cost['sync_ms']:.1f} ms | {cost['ratio']:.2f} "
        f"| {cost['waited_ms']:.1f} ms | {cost['own_ratio']:.2f} "
        f"| {cost['round_extra_ms']:.1f} ms | {cost['round_ratio']:.2f} |"])
