"""The DiLoCo math: pseudo-gradients and the outer step (Douillard et al., arXiv 2311.08105).

Each worker starts a round at the global parameters θ, takes H inner steps to θ_m, and forms the
pseudo-gradient Δ_m = θ − θ_m. The swarm averages Δ_m into Δ̄, which an outer optimizer (by
default SGD, lr 0.7, momentum 0.9, Nesterov) uses as the gradient of θ. Two identities pin the
math down (tests/test_outer.py): one worker with outer SGD lr 1 and no momentum is plain local
training, and H=1 with inner SGD and that outer optimizer is data-parallel SGD.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable, Sequence

import torch

from .compression.errors import ConfigError

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def nesterov(lr: float = 0.7, momentum: float = 0.9) -> OuterFactory:
    """The paper's outer optimizer: SGD with Nesterov momentum (plain SGD when momentum is 0). Its foreach form
    everywhere (torch picks it by itself on a GPU only): the same arithmetic as the per-tensor loop, bit for bit
    (tests/test_outer.py), with the momentum added to the gradients in place instead of into a fresh copy of
    them (`outer_step` hands it gradients it may write)."""
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0, foreach=True)


def default_outer(error_feedback: bool, lr: float | None = None, momentum: float | None = None) -> OuterFactory:
    """DiLoCo's Nesterov SGD (lr 0.7, momentum 0.9) for pipelines without error feedback; SparseLoCo's
    plain SGD (lr 1.0, no momentum) with it, where the residual plays momentum's part. Measured on the
    demo (docs/BENCHMARKS.md): topk:64/4096+s2+ef:0.95 reaches 2.437 held-out loss with SparseLoCo's
    outer step and 2.819 with Nesterov after the same 8 rounds. `lr` / `momentum` override either."""
    base_lr, base_momentum = (1.0, 0.0) if error_feedback else (0.7, 0.9)
    return nesterov(base_lr if lr is None else lr, base_momentum if momentum is None else momentum)


def warmup_scale(rnd: int, warmup: int) -> float:
    """The outer lr's factor for the outer step that commits global round `rnd` (1-based): it rises linearly
    over the first `warmup` rounds (rnd/warmup), then stays 1; 0 or less: no warmup."""
    if rnd < 1:
        raise ValueError(f"rounds are counted from 1, got {rnd}")
    return 1.0 if warmup <= 0 else min(1.0, rnd / warmup)


def lr_schedule(warmup: int = 0, schedule: Callable[[int], float] | None = None) -> Callable[[int], float]:
    """The outer lr's factor for the step that commits global round r (1-based): `schedule`, or a linear warmup over
    `warmup` rounds (`warmup_scale`); a function of r alone, so every peer (and one that caught up) steps with the
    same lr. Raises ConfigError for a negative warmup, or for both."""
    if warmup < 0:
        raise ConfigError(f"outer_warmup must be >= 0 rounds, got {warmup}")
    if warmup and schedule is not None:
        raise ConfigError("give outer_warmup or outer_lr_schedule, not both (a schedule can warm up itself)")
    return schedule or partial(warmup_scale, warmup=warmup)


def set_outer_lr(outer: torch.optim.Optimizer, scale: float) -> None:
    """Scale every param group's lr to `scale` × the lr its optimizer was made with (kept as `initial_lr`,
    as torch's schedulers keep it). The lr is no part of the global state: every peer sets it from the round."""
    for group in outer.param_groups:
        group["lr"] = group.setdefault("initial_lr", group["lr"]) * scale


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """All tensors as one contiguous fp32 vector (a copy)."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like `like`."""
    need = sum(t.numel() for t in like)
    if flat.numel() != need:
        raise ValueError(f"flat vector has {flat.numel()} values, the parameters need {need}")
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def is_pinned(t: torch.Tensor) -> bool:
    """Whether `t` is in pinned host memory, asked without starting CUDA (nothing is pinned before it starts)."""
    return bool(torch.cuda.is_initialized()) and t.is_pinned()  # type: ignore[no-untyped-call]


def _crosses(local_params: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether forming Δ on `device` (host memory) reads parameters from a GPU."""
    return device.type == "cpu" and any(p.is_cuda for p in local_params)


def wait_for_gpus(tensors: Iterable[torch.Tensor]) -> None:
    """Wait until the work queued on the current stream of every GPU holding one of `tensors` has run: a copy
    between such a GPU and host memory queued without waiting has landed. (Each GPU's own: waiting for the
    current device alone misses a model on another GPU.)"""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


PIECE = 1 << 22
"""Values of θ in host memory that cross to a GPU at a time to form Δ there (`subtract_on_gpus`): 16 MiB of fp32,
the GPU memory it borrows."""


@torch.no_grad()
def subtract_on_gpus(outs: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor],
                     local_params: Sequence[torch.Tensor]) -> None:
    """outs[i] ← global_params[i] − local_params[i], for θ in host memory and a model on a GPU, where the model is:
    each piece of θ (at most `PIECE` values) crosses to its parameter's GPU, is subtracted there and crosses back
    into `outs[i]` (host memory, pinned, contiguous), all queued on the current stream without waiting; the caller
    waits once (`wait_for_gpus`) before reading `outs` or changing θ. The bus twice and one kernel, instead of Δ's
    crossing and a pass over host memory: the host's subtraction took 75 ms of a sync for 85M parameters on an
    H200's host with 16 threads, the crossings 6.5 ms each way (docs/BENCHMARKS.md, "On a GPU"). The same values
    as the host's subtraction (an fp32 subtraction is correctly rounded on either device; a wider parameter is
    rounded to fp32 first, as there), except where the host flushes subnormal results to zero
    (`torch.set_flush_denormal`) and the GPU keeps them. A non-contiguous parameter is first made contiguous on its
    GPU (the memory borrowed is then its size)."""
    for out, g, p in zip(outs, global_params, local_params):
        flat_out, flat_g, flat_p = out.view(-1), g.reshape(-1), p.detach().reshape(-1)
        if flat_p.dtype == torch.float64:
            flat_p = flat_p.float()
        wide = torch.promote_types(flat_g.dtype, torch.float32)  # θ narrower than fp32 (never the wrapper's) widens
        for lo in range(0, flat_g.numel(), PIECE):
            hi = min(lo + PIECE, flat_g.numel())
            piece = flat_g[lo:hi].to(flat_p.device, dtype=wide, non_blocking=True, copy=True)  # never θ itself
            torch.sub(piece, flat_p[lo:hi], out=piece)
            flat_out[lo:hi].copy_(piece, non_blocking=True)  # the allocator reuses `piece` only after this copy


@torch.no_grad()
def pseudo_gradient(global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor],
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Δ = θ_global − θ_local, flat fp32, where θ_global lives. One allocation: Δ itself, or none into `out` (a
    flat fp32 buffer of the right size there: a fresh allocation this large costs more in page faults than the
    subtraction). With the model on a GPU and θ in host memory, Δ is allocated pinned and formed on the GPU
    (`subtract_on_gpus`), then the GPU is waited for once (not once per parameter)."""
    device = global_params[0].device if global_params else torch.device("cpu")
    crossing = _crosses(local_params, device)
    numel = sum(p.numel() for p in global_params)
    fits = out is not None and out.numel() == numel and out.device == device and out.dtype == torch.float32 and \
        (not crossing or is_pinned(out))
    delta = out if fits and out is not None else torch.empty(numel, dtype=torch.float32, device=device,
                                                             pin_memory=crossing)
    views = unflatten(delta, global_params)
    if crossing:
        subtract_on_gpus(views, global_params, local_params)
        wait_for_gpus(local_params)  # every piece has landed before the host reads Δ or θ changes
        return delta
    if _one_gpu_fp32(global_params, local_params):  # a few fused kernels, not a launch per parameter
        torch._foreach_copy_(views, list(global_params))
        torch._foreach_sub_(views, [p.detach() for p in local_params])
        return delta
    for out, g, p in zip(views, global_params, local_params):
        torch.sub(g, p.detach().to(device=device, dtype=torch.float32), out=out)
    return delta


def _one_gpu_fp32(*groups: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is fp32 on one GPU: there foreach kernels replace a launch per parameter (a CPU gains
    nothing from them, and pays their extra pass over memory)."""
    tensors = [t for group in groups for t in group]
    return bool(tensors) and tensors[0].is_cuda and \
        all(t.device == tensors[0].device and t.dtype == torch.float32 for t in tensors)


@torch.no_grad()
def pseudo_gradient_pieces(global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor],
                           piece: int = 1 << 24) -> list[torch.Tensor]:
    """`pseudo_gradient` as consecutive pieces of at most `piece` values, each its own allocation, in flat
    order: a round frees each once it has encoded it (`diloco.comms.rounds.PiecewiseHandoff`), so Δ and its
    whole encoding never coexist. From a GPU, as `pseudo_gradient`: pinned pieces formed on the GPU, one wait."""
    crossing = bool(global_params) and _crosses(local_params, global_params[0].device)
    pieces = []
    for g, p in zip(global_params, local_params):
        flat_g, flat_p = g.reshape(-1), p.detach().reshape(-1)
        for lo in range(0, flat_g.numel(), piece):
            hi = min(lo + piece, flat_g.numel())
            if crossing:
                out = torch.empty(hi - lo, dtype=torch.float32, pin_memory=True)
                subtract_on_gpus([out], [flat_g[lo:hi]], [flat_p[lo:hi]])
                pieces.append(out)
            elif flat_p.device == g.device and flat_p.dtype == torch.float32:
                pieces.append(torch.sub(flat_g[lo:hi], flat_p[lo:hi]))  # one pass, into the piece's fresh memory
            else:  # another dtype: its values widened into the piece, then subtracted there
                out = torch.empty(hi - lo, dtype=torch.float32, device=g.device)
                pieces.append(torch.sub(flat_g[lo:hi], out.copy_(flat_p[lo:hi]), out=out))
    if crossing:
        wait_for_gpus(local_params)
    return pieces


@torch.no_grad()
def outer_step(outer: torch.optim.Optimizer, global_params: Sequence[torch.Tensor], aggregate: torch.Tensor,
               lr_scale: float | None = None) -> None:
    """Use the averaged pseudo-gradient as the gradient of θ and step the outer optimizer (at `lr_scale` × its
    own lr when given: `set_outer_lr`). The optimizer may write the gradients it is given (foreach Nesterov SGD
    adds its momentum to them in place), and where θ lives with the aggregate they are views of it: a caller
    that reads the aggregate afterwards passes a copy."""
    if lr_scale is not None:
        set_outer_lr(outer, lr_scale)
    for p, g in zip(global_params, unflatten(aggregate, global_params)):
        p.grad = g.to(device=p.device)
    outer.step()
    for p in global_params:
        p.grad = None


@torch.no_grad()
def copy_into(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """dst[i] ← src[i], for every i. Copies between host memory and a GPU are queued without waiting, and the GPUs
    are waited for once at the end (not once per tensor): on return every copy has landed, so either side may
    change its tensors."""
    if _one_gpu_fp32(dst, src):
        torch._foreach_copy_(list(dst), list(src))
        return  # queued on the stream that uses them next: nothing crosses to the host
    gpu: list[torch.Tensor] = []
    for d, s in zip(dst, src):
        crossing = d.is_cuda or s.is_cuda
        d.copy_(s, non_blocking=crossing)
        if crossing:
            gpu.append(d if d.is_cuda else s)
    wait_for_gpus(gpu)


@torch.no_grad()
def mix_into(local: Sequence[torch.Tensor], global_: Sequence[torch.Tensor], alpha: float) -> None:
    """Streaming DiLoCo's mixing: θ_local ← α·θ_local + (1−α)·θ_global (α = 0 copies θ_global exactly)."""
    if alpha == 0.0 and _one_gpu_fp32(local, global_):
        torch._foreach_copy_(list(local), list(global_))
        return
    for d, g in zip(local, global_):
        if alpha == 0.0:
            d.copy_(g)
        elif alpha != 1.0:
            d.lerp_(g.to(device=d.device, dtype=d.dtype), 1.0 - alpha)
