"""Robust aggregation: what one bad-but-authorized peer can do to a span's mean, bounded.

Pure, deterministic functions of the contributions an owner (or, for sparse bundles, every member)
combines. Nothing here trusts a number from the wire: norms are computed locally from the decoded
values, and every contributor weighs the same (weights never come from the wire).

- **Admission** (`admit`): a contribution whose root-mean-square value exceeds `max_rms` is refused
  outright (the frame is rejected and counted; a pseudo-gradient that large is a bug or an attack,
  never training).
- **Clipping** (on by default): with at least `MIN_ROBUST` contributions, each one whose L2 norm
  exceeds `clip` × the median norm is scaled down to that bound, so one peer moves the mean by at
  most `clip` × median / n per span, however large its update.
- **Trimmed mean** (optional, dense pipelines): per coordinate, the `trim` fraction of largest and
  of smallest values is dropped before averaging.
- **Strikes** (`offenders`): a contribution above `strike` × the median norm is a strike against
  its sender; the caller bans a peer for the run after `ban_after` strikes.

Robust statistics need an honest majority of contributors: with fewer than `MIN_ROBUST`
contributions there is no median to trust, and nothing is clipped or struck.
Nothing is changed when nothing exceeds a bound, so honest rounds are bit-identical with or without
these defences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from diloco.compression.errors import ConfigError
from diloco.compression.pipeline import Decoded

from .reduce import average, uneven

MIN_ROBUST = 3


@dataclass(frozen=True, kw_only=True)
class RobustConfig:
    clip: float = 4.0
    """Clip each contribution's L2 norm to this multiple of the median norm (0: off)."""
    trim: float = 0.0
    """Trimmed mean: drop this fraction of largest and of smallest values per coordinate (dense only; 0: off)."""
    strike: float = 16.0
    """A contribution above this multiple of the median norm counts a strike against its sender."""
    ban_after: int = 3
    """Strikes after which a peer is banned for the run (0: never ban)."""
    max_rms: float = 1e3
    """Refuse a contribution whose root-mean-square value exceeds this (a pseudo-gradient that large is
    never training; raise it only if your parameters themselves are that large)."""
    max_weight: float = 8.0
    """Refuse a contribution whose weight (the inner steps it covers) exceeds this multiple of the lowest weight in
    its span (the slowest peer's; 0: no bound): a peer cannot outvote the others by claiming more work than the
    spread of its swarm's speeds allows."""

    def __post_init__(self) -> None:
        if not (self.clip == 0 or self.clip >= 1) or not math.isfinite(self.clip):
            raise ConfigError(f"clip must be 0 (off) or a finite multiple >= 1 of the median norm, got {self.clip}")
        if not 0 <= self.trim < 0.5:
            raise ConfigError(f"trim must be in [0, 0.5) (the fraction dropped at each end), got {self.trim}")
        if not self.strike > 1 or not math.isfinite(self.strike):
            raise ConfigError(f"strike must be a finite multiple > 1 of the median norm, got {self.strike}")
        if self.ban_after < 0:
            raise ConfigError(f"ban_after must be >= 0 strikes (0: never ban), got {self.ban_after}")
        if not self.max_rms > 0:
            raise ConfigError(f"max_rms must be > 0, got {self.max_rms}")
        if not (self.max_weight == 0 or 1 <= self.max_weight < math.inf):
            raise ConfigError(f"max_weight must be 0 (no bound) or a finite multiple >= 1 of the lowest weight, got "
                              f"{self.max_weight}")


_CHUNK = 1 << 20  # values per float64 piece: the norm's temporary stays 8 MiB whatever the span


def norm(part: Decoded) -> float:
    """L2 norm of a contribution's values, accumulated in float64, a piece at a time."""
    flat, squares = part.values.reshape(-1), 0.0
    for lo in range(0, flat.numel(), _CHUNK):
        squares += float(torch.linalg.vector_norm(flat[lo:lo + _CHUNK], dtype=torch.float64)) ** 2
    return math.sqrt(squares)


def assess(part: Decoded, cfg: RobustConfig) -> tuple[float, str]:
    """(a decoded contribution's L2 norm, why it may not be combined at all: "" when it may). One pass: the norm,
    summed in float64, is finite exactly when every value is (a float32's square cannot overflow it; NaN and Inf
    carry through). `combine` takes the norm back, so an admitted contribution is read once, not twice."""
    n = part.values.numel()
    size = norm(part)
    r = size / math.sqrt(n) if n else 0.0
    if not math.isfinite(r):
        return size, "holds NaN or Inf"
    if r > cfg.max_rms:
        return size, f"root-mean-square {r:.3g} exceeds max_rms={cfg.max_rms:g}"
    return size, ""


def admit(part: Decoded, cfg: RobustConfig) -> tuple[bool, str]:
    """Whether a decoded contribution may be combined at all, and why not (`assess`)."""
    why = assess(part, cfg)[1]
    return not why, why


def median(values: Sequence[float]) -> float:
    """The lower median (an element of `values`, so one outlier cannot set it on its own)."""
    s = sorted(values)
    return s[(len(s) - 1) // 2]


def clip_scales(norms: Sequence[float], clip: float) -> list[float]:
    """Per contribution, the factor that brings its norm down to `clip` × median (1.0: untouched)."""
    if clip == 0 or len(norms) < MIN_ROBUST:
        return [1.0] * len(norms)
    bound = clip * median(norms)
    if bound <= 0:
        return [1.0] * len(norms)
    return [bound / n if n > bound else 1.0 for n in norms]


def offenders(norms: Sequence[float], strike: float) -> list[int]:
    """Indices of contributions above `strike` × the median norm."""
    if len(norms) < MIN_ROBUST:
        return []
    bound = strike * median(norms)
    return [i for i, n in enumerate(norms) if n > bound and bound > 0]


@dataclass(frozen=True)
class Combined:
    values: torch.Tensor
    norms: list[float]
    scales: list[float]
    """Per input (same order), the clip factor applied (1.0: untouched)."""

    @property
    def clipped(self) -> list[int]:
        return [i for i, s in enumerate(self.scales) if s != 1.0]


def overweight(weights: Sequence[float], bound: float) -> list[int]:
    """Indices of weights above `bound` × the lowest one (none when `bound` is 0)."""
    if bound == 0 or not weights:
        return []
    floor = min(weights)
    return [i for i, w in enumerate(weights) if w > bound * floor]


def combine(parts: Sequence[Decoded], numel: int, cfg: RobustConfig,
            weights: Sequence[float] | None = None, norms: Sequence[float | None] | None = None) -> Combined:
    """The robust mean of `parts` (in the given order, which fixes the summation order), each weighted by
    `weights` (the trimmed mean, per coordinate, ignores them). Weighted, clipping and strikes judge each part's
    norm per unit of weight: a peer that trained four times as many steps may move four times as far. `norms`:
    the parts' `norm`s where their admission measured them already (`assess`; None: measured here)."""
    if norms is not None and len(norms) != len(parts):
        raise ValueError(f"{len(norms)} norms for {len(parts)} contributions")
    sizes = [norm(p) if known is None else known for p, known in zip(parts, norms or [None] * len(parts))]
    if weights is not None and uneven(weights):
        sizes = [n / w for n, w in zip(sizes, weights)]
    scales = clip_scales(sizes, cfg.clip)
    scaled = [p if s == 1.0 else Decoded(p.indices, p.values * torch.tensor(s, dtype=torch.float32))
              for p, s in zip(parts, scales)]
    k = math.floor(cfg.trim * len(parts))
    if k > 0 and all(p.indices is None for p in scaled):
        return Combined(trimmed_mean([p.values for p in scaled], k), sizes, scales)
    return Combined(average(scaled, numel, weights), sizes, scales)


def trimmed_mean(values: Sequence[torch.Tensor], k: int) -> torch.Tensor:
    """Per coordinate, the mean of the values left after dropping the k largest and k smallest.
    Independent of the input order (values are sorted per coordinate before summing)."""
    if not 0 <= 2 * k < len(values):
        raise ValueError(f"cannot trim {k} from each end of {len(values)} values")
    kept = torch.stack(list(values)).sort(dim=0).values[k:len(values) - k]
    return kept.sum(dim=0) / kept.shape[0]
