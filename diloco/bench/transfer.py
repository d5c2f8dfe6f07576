"""`diloco bench transfer`: what a synchronization moves between the model's device and the global state.

With the model on a GPU, the wrapper keeps θ and the outer optimizer's state in host memory (pinned when CUDA
is there; `DiLoCo(global_device=...)` keeps them on the GPU instead). Each synchronization then moves the
model twice: the local parameters to the host to form Δ = θ − θ_local (`outer.pseudo_gradient`), and θ back
after the outer step (`outer.copy_into`, what α = 0 mixing does). The training loop waits for both. This
measures them with the wrapper's own functions, on tensors shaped like the bundled GPT's parameters:

- `Δ to host`: forming Δ in host memory from the device's parameters (into pinned memory, from a GPU);
- `θ to device`: copying θ into the device's parameters, θ in pageable or (from a GPU's point of view) pinned
  host memory, as the wrapper keeps it;
- `Δ on device`: forming Δ with θ on the device (`global_device="cuda"`), the figure the copies add to.

Each figure is the median of `repeats` runs, timed to the device's end (`torch.cuda.synchronize`). On a CPU
the copies are memcpys of host memory (no pinned or on-device rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..job.model import GPT, GPTConfig
from ..outer import copy_into, pseudo_gradient
from .devices import device_name, gpu, median_time, waiter


@dataclass(frozen=True)
class TransferSetup:
    model: GPTConfig
    """Whose parameter shapes are moved (the values are random)."""
    device: str = "cpu"
    """Where the model lives (cpu, cuda, cuda:N)."""
    repeats: int = 5


def parameter_shapes(cfg: GPTConfig) -> list[tuple[int, ...]]:
    """The shapes of the bundled GPT's trainable parameters under `cfg` (built on the meta device: no memory)."""
    with torch.device("meta"):
        meta = GPT(cfg)
    return [tuple(p.shape) for p in meta.parameters() if p.requires_grad]


def run(setup: TransferSetup) -> dict[str, Any]:
    """Rows of (what, where θ is, bytes, median ms, GB/s)."""
    device = torch.device(setup.device)
    if device.type == "cuda":
        device = torch.device("cuda", gpu(device))  # `cuda` alone: the current GPU, named by its index
    finish = waiter(device)
    shapes = parameter_shapes(setup.model)
    generator = torch.Generator().manual_seed(0)
    host = [torch.randn(s, generator=generator) for s in shapes]
    local = [p.to(device) for p in host]
    numel = sum(p.numel() for p in host)
    nbytes = 4 * numel
    homes: list[tuple[str, list[torch.Tensor]]] = [("pageable host memory", [p.clone() for p in host])]
    if device.type == "cuda":
        homes.append(("pinned host memory", [p.clone().pin_memory() for p in host]))
    rows = []

    def row(what: str, theta_in: str, move: Callable[[], object]) -> None:
        # one untimed run first: the allocator's and CUDA's lazy set-up are no part of a round's cost
        seconds, _ = median_time(move, setup.repeats, finish, warmup=1)
        rows.append(dict(what=what, theta=theta_in, bytes=nbytes, ms=seconds * 1e3, gbps=nbytes / seconds / 1e9))

    theta = homes[-1][1]  # where θ lives does not change forming Δ: it is read on the host
    row("Δ to host (pseudo_gradient)", "host memory", lambda: pseudo_gradient(theta, local))
    for where, home in homes:
        row("θ to device (copy_into)", where, lambda: copy_into(local, home))
    if device.type != "cpu":
        on_device = [p.clone() for p in local]
        row("Δ on device (global_device)", str(device), lambda: pseudo_gradient(on_device, local))
    return {"device": device_name(device), "params": numel, "tensors": len(shapes), "rows": rows}


def markdown_table(report: dict[str, Any]) -> str:
    lines = [f"{report['params']:,} parameters in {report['tensors']} tensors, fp32 ({report['params'] * 4 / 1e6:.1f} "
             f"MB), model on {report['device']}", "",
             "| move | θ in | median | GB/s |", "|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['what']} | {r['theta']} | {r['ms']:.2f} ms | {r['gbps']:.2f} |")
    return "\n".join(lines)
