"""How an owner combines the contributions to its span: pure, deterministic functions.

- Dense contributions: the fp32 mean over contributors, summed in view order.
- Sparse contributions (top-k / random-k): each coordinate is averaged over the contributors
  that sent it (SparseLoCo's sparse aggregation); coordinates nobody sent stay 0.
- Weighted (contributors that trained different numbers of inner steps, e.g. rounds by time): each
  contribution counts in proportion to its weight, Σ wᵢ·Δᵢ / Σ wᵢ (per coordinate over those that hold it).
  Equal weights take the unweighted path, so a swarm of equal workers computes exactly what it did without.

Every peer that holds the same inputs in the same order computes bit-identical outputs. The order
is canonical: contributions are summed sorted by the CRC-32 of their encoded bytes (the checksum their
frame carries and the receiver verified already: no pass of its own over the bytes), not by who sent
them, so a run's numbers depend only on its data and seeds, not on the random peer ids that
order a view (float addition is not associative). Equal keys (the same bytes, or a 1-in-2^32 collision)
keep the view's order, which every member of the view shares: the order is the same on every peer even
then. The key orders a sum; it guards nothing (the frame's CRC-32 and the transport's authentication do).
"""

from __future__ import annotations

import struct
import zlib
from typing import Sequence

import torch

from diloco.compression.pipeline import Decoded


def order_key(payload: bytes | memoryview, crc: int | None = None) -> bytes:
    """Where an encoded contribution goes in the summation order: the CRC-32 of its bytes (`crc` when the frame's
    verified checksum of them is at hand) and their length. An owner keeps this, not the bytes, of a dense
    contribution once decoded."""
    return struct.pack(">IQ", zlib.crc32(payload) if crc is None else crc, memoryview(payload).nbytes)


def summation_order(keys: Sequence[bytes]) -> list[int]:
    """Indices of contributions sorted by their `order_key`s `keys`: the summation order (equal keys keep their
    order in `keys`, the view's)."""
    return sorted(range(len(keys)), key=keys.__getitem__)


def canonical_order(payloads: Sequence[bytes | memoryview]) -> list[int]:
    """The summation order of encoded `payloads`."""
    return summation_order([order_key(p) for p in payloads])


def average(parts: Sequence[Decoded], numel: int, weights: Sequence[float] | None = None) -> torch.Tensor:
    """Per-coordinate mean of `parts` (in the given order) over the parts that hold the coordinate, each part
    counted `weights[i]` times (None, or all equal: the plain mean)."""
    if not parts:
        raise ValueError("cannot average zero contributions")
    if uneven(weights):
        assert weights is not None
        return _weighted(parts, numel, weights)
    total = torch.zeros(numel, dtype=torch.float32)
    if all(p.indices is None for p in parts):
        for p in parts:
            total += p.values
        return total.div_(len(parts))  # in place: the span's one buffer (the same values as `total / n`)
    count = torch.zeros(numel, dtype=torch.float32)
    for p in parts:
        if p.indices is None:
            total += p.values
            count += 1
        else:
            total.index_add_(0, p.indices, p.values)
            count.index_add_(0, p.indices, torch.ones_like(p.values))
    return torch.where(count > 0, total / count.clamp(min=1), total)


def uneven(weights: Sequence[float] | None) -> bool:
    """Whether `weights` change anything: given, and not all equal (equal weights are the plain mean)."""
    return weights is not None and len(set(weights)) > 1


def _weighted(parts: Sequence[Decoded], numel: int, weights: Sequence[float]) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.float32)
    if all(p.indices is None for p in parts):
        for p, w in zip(parts, weights):
            total.add_(p.values, alpha=w)
        return total.div_(float(sum(weights)))
    mass = torch.zeros(numel, dtype=torch.float32)
    for p, w in zip(parts, weights):
        if p.indices is None:
            total.add_(p.values, alpha=w)
            mass += w
        else:
            total.index_add_(0, p.indices, p.values, alpha=w)
            mass.index_add_(0, p.indices, torch.full_like(p.values, w))
    return torch.where(mass > 0, total / mass.clamp(min=1e-30), total)
