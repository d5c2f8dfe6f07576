"""`diloco bench transfer`: what a synchronization moves between the model's device and the global state.

With the model on a GPU, the wrapper keeps θ and the outer optimizer's state in host memory (pinned when CUDA
is there; `DiLoCo(global_device=...)` keeps them on the GPU instead). Each synchronization then moves the
model twice: the local parameters to the host to form Δ = θ − θ_local (`outer.pseudo_gradient`), and θ back
after the outer step (`outer.copy_into`, what α = 0 mixing does). The training loop waits for both. This
measures them with the wrapper's own functions, on tensors shaped like the bundled GPT's parameters:

- `to host`: forming Δ from the device's parameters, θ in pageable or pinned host memory;
- `to device`: copying θ into the device's parameters;
- `on device`: forming Δ with θ on the device (`global_device="cuda"`), the figure the copies add to.

Each figure is the median of `repeats` runs, timed to the device's end (`torch.cuda.synchronize`). On a CPU
the copies are memcpys of host memory (no pinned rows: pinning needs CUDA).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..job.model import GPT, GPTConfig
from ..outer import copy_into, pseudo_gradient


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


def _median_seconds(fn: Callable[[], object], finish: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up (allocator, lazy CUDA state) and is not counted
        started = time.perf_counter()
        fn()
        finish()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def run(setup: TransferSetup) -> dict[str, Any]:
    """Rows of (what, where θ is, bytes, median ms, GB/s)."""
    device = torch.device(setup.device)
    finish: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    shapes = parameter_shapes(setup.model)
    generator = torch.Generator().manual_seed(0)
    host = [torch.randn(s, generator=generator) for s in shapes]
    local = [p.to(device) for p in host]
    numel = sum(p.numel() for p in host)
    nbytes = 4 * numel
    homes: list[tuple[str, list[torch.Tensor]]] = [("pageable host memory", [p.clone() for p in host])]
    if torch.cuda.is_available():
        homes.append(("pinned host memory", [p.clone().pin_memory() for p in host]))
    rows = []

    def row(what: str, theta_in: str, seconds: float) -> None:
        rows.append(dict(what=what, theta=theta_in, bytes=nbytes, ms=seconds * 1e3, gbps=nbytes / seconds / 1e9))

    for where, theta in homes:
        row("Δ to host (pseudo_gradient)", where, _median_seconds(lambda: pseudo_gradient(theta, local), finish,
                                                                  setup.repeats))
        row("θ to device (copy_into)", where, _median_seconds(lambda: copy_into(local, theta), finish, setup.repeats))
    if device.type != "cpu":
        on_device = [p.clone() for p in local]
        row("Δ on device (global_device)", str(device), _median_seconds(lambda: pseudo_gradient(on_device, local),
                                                                        finish, setup.repeats))
    return {"device": device_name(device), "params": numel, "tensors": len(shapes), "rows": rows}


def device_name(device: torch.device) -> str:
    """`cpu`, or the GPU's name and index (`NVIDIA H100 80GB HBM3 (cuda:0)`): how figures are labelled."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{torch.cuda.get_device_name(index)} (cuda:{index})"


def markdown_table(report: dict[str, Any]) -> str:
    lines = [f"{report['params']:,} parameters in {report['tensors']} tensors, fp32 ({report['params'] * 4 / 1e6:.1f} "
             f"MB), model on {report['device']}", "",
             "| move | θ in | median | GB/s |", "|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['what']} | {r['theta']} | {r['ms']:.2f} ms | {r['gbps']:.2f} |")
    return "\n".join(lines)
