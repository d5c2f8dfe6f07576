"""The device a benchmark runs on: how its figures are labelled, and how a timing on it waits for it."""

from __future__ import annotations

import statistics
import time
from typing import Callable

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
