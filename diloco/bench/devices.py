"""The device a benchmark runs on: how its figures are labelled, and how a timing on it waits for it."""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


def device_name(device: torch.device) -> str:
    """`cpu`, or the GPU's name and index (`NVIDIA H100 80GB HBM3 (cuda:0)`): how figures are labelled."""
    if device.type != "cuda":
        return str(device)
    return f"{torch.cuda.get_device_name(gpu(device))} (cuda:{gpu(device)})"


def gpu(device: torch.device) -> int:
    """The index of a CUDA device (`cuda` alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def waiter(device: torch.device) -> Callable[[], None]:
    """What ends a timing on `device`: on a GPU, waiting until the work queued there has run (a timing of
    Python's queueing alone would flatter it); on the CPU, nothing."""
    if device.type != "cuda":
        return lambda: None
    index = gpu(device)
    return lambda: torch.cuda.synchronize(index)


def median_time(fn: Callable[[], object], repeats: int, finish: Callable[[], None] = lambda: None,
                warmup: int = 0) -> tuple[float, object]:
    """The median of `repeats` timings of `fn()` (each ended by `finish()`: `waiter`), after `warmup` untimed
    runs (allocator, lazy CUDA state); and what the last run returned."""
    times, out = [], None
    for k in range(warmup + repeats):
        started = time.perf_counter()
        out = fn()
        finish()
        if k >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times), out


def _activities(device: torch.device) -> list[Any]:
    """What `torch.profiler` records on `device`: the host's operators, and on a GPU its kernels and copies."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def _operator_tables(prof: Any, device: torch.device, host_rows: int, gpu_rows: int) -> list[str]:
    """A profile's operators by their own time on the host, and on a GPU by their own time there."""
    tables = [prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=host_rows)]
    if device.type == "cuda":
        tables.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=gpu_rows))
    return tables


def kernel_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """The GPU's own work in one run of `fn()`: the summed time of what it ran there (`torch.profiler`: kernels,
    copies within the GPU), less its copies between host and GPU, which the bus sets. 0 on the CPU."""
    if device.type != "cuda":
        return 0.0
    from torch._C._autograd import DeviceType
    from torch.profiler import profile

    fn()  # warm: the profiler then sees the steady state
    finish = waiter(device)
    finish()
    with profile(activities=_activities(device)) as prof:
        fn()
        finish()
    # the events on the GPU itself, as the profiler's own table sums them ("Self CUDA time total"), but the copies
    # across the bus ("Memcpy DtoH (Device -> Pinned)", "Memcpy HtoD (...)"); a clone is "Memcpy DtoD" and counts
    return sum(float(event.self_device_time_total) for event in prof.key_averages()
               if event.device_type == DeviceType.CUDA and not event.is_user_annotation
               and not event.key.startswith(("Memcpy DtoH", "Memcpy HtoD"))) / 1e6


def profile_tables(fn: Callable[[], object], device: torch.device, rows: int = 25) -> str:
    """Run `fn()` once under `torch.profiler` (the GPU's kernels too on a GPU) and `cProfile` (the host's Python,
    where numpy copies and waits for the GPU show), ended by `waiter(device)`: their tables, operators by their own
    time on the host, then on the GPU, then Python functions by their own time."""
    from torch.profiler import profile

    finish = waiter(device)
    python = cProfile.Profile()
    with profile(activities=_activities(device)) as prof:
        python.enable()
        fn()
        finish()
        python.disable()
    tables = _operator_tables(prof, device, rows, rows)
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(rows)
    tables.append(text.getvalue().strip())
    return "\n\n".join(tables) + "\n"


@contextlib.contextmanager
def profiled(path: Path | None, device: torch.device) -> Iterator[None]:
    """Profile the block with `torch.profiler` (the GPU's kernels too on a GPU) and write its operators, by their
    own time on the host, into `path`; nothing when `path` is None."""
    if path is None:
        yield
        return
    from torch.profiler import profile

    with profile(activities=_activities(device)) as prof:
        yield
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(_operator_tables(prof, device, 40, 25)) + "\n")
