"""Integer quantizers: blockwise absmax integers (``q8``/``q4``/``q2``) and the
statistical codebook (``s4``/``s2``).

Both send each value as a small integer *code*; they differ in what a code means.

* :class:`BlockQuantCodec` is **linear within a block**: code ``q`` means
  ``q * s`` for its block's fp32 scale ``s = absmax / qmax``. The grid is even
  and symmetric, zero is exact, and the error per value is at most half a step
  (``s/2``), so an outlier only coarsens its own block. Stochastic rounding
  (``:sr``) makes the rounding unbiased for callers without error feedback.
* :class:`StatCodec` is **one codebook per tensor**: ``2**bits`` bins spanning
  about +-3 standard deviations around the mean, and each code decodes to the
  *mean of the values that fell in its bin* (the bin's centroid), sent as a
  table of ``2**bits`` fp32 values. It has no per-value bound -- tails clamp into
  the end bins -- but at 2 or 4 bits and no per-block scales it is the cheapest
  format with a useful L2 error on bell-shaped data.

Both encoders work chunk by chunk with the helpers of :mod:`.blockscale`, and
both decoders are byte-table look-ups (plus one fp32 multiply per value for
``q``); registry names and argument parsing live in :mod:`.quant`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .bits import pack_codes, packed_size
from .blockscale import (
    F32,
    FLT_MAX,
    BlockScaledCodec,
    Dither,
    blockwise,
    byte_table,
    check_block,
    check_padding,
    chunks,
    decode_table,
    empty,
    land,
    packed_chunk,
    parse_block_args,
    read_f32,
    scale_limit,
    scratch,
    staging,
    take_bytes,
)
from .codecs import Codec, all_finite, byte_view, check_input, expect_size, landed, payload_buffer, whole
from .errors import PayloadRejected, Reason

__all__ = ["BlockQuantCodec", "StatCodec"]


# --------------------------------------------------------------------------- blockwise absmax integers


class BlockQuantCodec(BlockScaledCodec):
    """Blockwise absmax linear quantization to signed ``bits``-bit integers.

    The tensor is cut into blocks of ``block`` values (the last may be shorter).
    Each block gets one fp32 scale ``s = absmax / qmax`` and each value becomes
    ``q = round(x / s)`` (round-half-to-even), an integer in ``[-qmax, qmax]``
    with ``qmax = 2**(bits-1) - 1``: 127 for ``q8``, 7 for ``q4`` and 1 for
    ``q2`` -- a symmetric range, so zero is exact and the most negative two's
    complement code (-128 / -8 / -2) is a spare that is never sent (rejected as
    ``BAD_DTYPE``). ``q2`` is therefore ternary: ``{-s, 0, +s}`` with
    ``s = absmax``. Decoding is ``q * s`` in fp32. This is the blockwise absmax
    scheme of bitsandbytes (Dettmers et al., "8-bit Optimizers via Block-wise
    Quantization"): small blocks confine the damage of an outlier to its block.

    Error: ``|x - x_hat| <= s/2`` per value (plus fp32 rounding, ~2**-23 absmax).
    With ``stochastic=True`` (``:sr``) ``q = floor(x/s)`` rounded *up* with
    probability equal to the fractional part, so ``E[x_hat] = x`` (to 2**-24 s)
    and ``|x - x_hat| < s``: QSGD's (Alistarh et al.) unbiased stochastic
    rounding, for when no error feedback absorbs the rounding bias.

    Layout: ``ceil(n/block)`` scales (``'<f4'``), then the two's complement
    codes packed LSB-first (a byte per value for ``q8``). Scales are clamped to
    the largest fp32 for which ``qmax * s`` is finite, and the decoder rejects
    larger ones (``NON_FINITE``), so decoded values are always finite.
    """

    def __init__(self, bits: int, block: int = 256, *, stochastic: bool = False, seed: int | None = None) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"integer quantizers have 2, 4 or 8 bits, got {bits!r}")
        self.bits = bits
        self.block = check_block(f"q{bits}", block)
        self.qmax = (1 << (bits - 1)) - 1
        self.stochastic = bool(stochastic)
        self.name = f"q{bits}:{self.block}" + (":sr" if self.stochastic else "")
        self.bits_per_value = bits + 32.0 / self.block
        self._max_scale = scale_limit(self.qmax)
        self._dither = Dither(seed) if self.stochastic else None
        codes = np.arange(1 << bits)
        values = np.where(codes <= self.qmax, codes, codes - (1 << bits)).astype(np.float32)
        values[self.qmax + 1] = np.nan  # the spare code -(qmax + 1)
        self._table = byte_table(values, bits)  # two's complement value(s) of each byte

    @classmethod
    def from_args(cls, bits: int, args: list[str], *, seed: int | None = None) -> BlockQuantCodec:
        block, stochastic = parse_block_args(f"q{bits}", args, default_block=256)
        return cls(bits, block, stochastic=stochastic, seed=seed)

    def encode_view(self, t: torch.Tensor) -> bytes | memoryview:
        x = check_input(t)
        n = x.numel()
        if n == 0:
            return b""
        out, staged, divisors, whole_payload = self._begin(x, self.qmax)
        work = scratch(n, torch.float32, x.device)
        codes = scratch(n, torch.int8, x.device)
        if self._dither is not None:
            floor = torch.empty_like(work)
            noise = torch.empty_like(work)
            up = torch.empty(work.numel(), dtype=torch.bool, device=x.device)
        mask = (1 << self.bits) - 1
        for start, stop in chunks(n, x.device):
            m = stop - start
            v = work[:m]
            blockwise(torch.div, x[start:stop], divisors[start // self.block :], self.block, v)
            v.clamp_(-self.qmax, self.qmax)  # |x/s| <= qmax up to an ulp; keeps SR inside the range
            if self._dither is None:
                v.round_()
            else:
                f = torch.floor(v, out=floor[:m])
                v.sub_(f)  # fractional part in [0, 1)
                torch.lt(self._dither.fill(noise[:m]), v, out=up[:m])
                v.copy_(f).add_(up[:m])
            c = codes[:m]
            c.copy_(v)
            first = start * self.bits // 8
            if self.bits == 8:
                staged[start:stop].copy_(c.view(torch.uint8))
            else:
                packed = pack_codes(c.view(torch.uint8) & mask, self.bits)
                staged[first : first + packed.numel()].copy_(packed)
        return self._finish(out, whole_payload, n)

    def _decode_codes(self, view: memoryview, numel: int, scales: np.ndarray,
                      device: torch.device | None) -> torch.Tensor:
        # The spare code is NaN in the table; valid codes times a checked scale are finite.
        return decode_table(self, view, numel, 4 * scales.size, self.bits, self._table, torch.from_numpy(scales),
                             self.block, Reason.BAD_DTYPE, f"spare code {-self.qmax - 1}", device)


# --------------------------------------------------------------------------- statistical codebook


LANES = 4096
"""On a GPU, each level's totals are split over this many lanes (element ``i`` into lane ``i % LANES``)."""


def bin_totals(codes: torch.Tensor, weights: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How many ``codes`` fall in each of ``levels`` bins (int64) and the sum of their ``weights`` (float64).

    Neighbouring GPU threads adding into the same 4 or 16 addresses serialise on their atomics (torch's
    ``bincount``, 1-3 ms at 16M values on an H200): there the totals gather in ``lanes`` addresses a level
    (where codecs work as on a GPU, :func:`~.codecs.whole`; on the host ``bincount`` adds in order) and are summed after, each element's slot an int32 (4 bytes an element, on top of
    the codec's scratch). The sums differ from the host's in their float64 rounding only: an fp32 centroid changes
    (in its last bit) only where a sum lies within that rounding of an fp32 boundary, as with ``bincount``'s own
    atomics (tests/test_quant.py compares the bytes)."""
    lanes = LANES
    if not whole(codes.device):
        return torch.bincount(codes, minlength=levels), torch.bincount(codes, weights=weights, minlength=levels)
    n, rows = codes.numel(), codes.numel() // lanes
    slot = codes.to(torch.int32) * lanes  # levels * lanes <= 2**16
    slot[: rows * lanes].view(rows, lanes).add_(torch.arange(lanes, dtype=torch.int32, device=codes.device))
    slot[rows * lanes :].add_(torch.arange(n - rows * lanes, dtype=torch.int32, device=codes.device))
    counts = torch.bincount(slot, minlength=levels * lanes)
    sums = torch.zeros(levels * lanes, dtype=weights.dtype, device=codes.device).index_add_(0, slot, weights)
    return counts.view(levels, lanes).sum(1), sums.view(levels, lanes).sum(1)


class StatCodec(Codec):
    """Per-tensor "statistical" codebook quantization with a centroid lookup table.

    The value quantizer of templar/SparseLoCo (and the lookup-table int8
    all-reduce INTELLECT-1 describes): with ``L = 2**bits`` bins (16 for ``s4``, 4 for ``s2``), mean
    ``mu`` and (sample) standard deviation ``sigma`` of the tensor, bin width
    ``w = 6 sigma / L`` (the bins span about +-3 sigma), each value gets the code
    ``c = clamp(round((x - mu) / w) + L/2, 0, L-1)``. Code ``c`` is "centred" on
    ``mu + (c - L/2) w``, so like templar's the grid is asymmetric by half a bin:
    it has an exact-zero bin at ``mu`` and reaches ``-L/2 w`` below but only
    ``(L/2 - 1) w`` above, with everything beyond clamped into the end bins.

    Instead of bin centres the decoder maps each code to its bin's *centroid*:
    the mean (computed in float64, rounded once to fp32) of the original values
    that fell in that bin, or the bin centre for an empty bin. Centroids are the
    MSE-optimal reconstruction for the given bins (one Lloyd-Max step), which
    makes the end bins -- the ones that absorb the tails -- far more accurate.

    Layout: ``2**bits`` fp32 centroids, then the codes packed LSB-first. The
    centroids already include the mean, so no separate mean is sent (it would be
    4 bytes the decoder never reads). Decoding is a table look-up and any finite
    table is accepted (``NON_FINITE`` otherwise); every code is valid.

    Error: no per-element bound (an outlier is replaced by its end bin's
    centroid). On Gaussian data the relative L2 error is 0.107-0.116 for ``s4``
    and 0.408-0.431 for ``s2`` (measured over seeds and sizes 1e3..1e5; tests
    assert <= 0.125 / 0.45). ``bits_per_value`` excludes the constant 64/16-byte
    table.
    """

    def __init__(self, bits: int) -> None:
        if bits not in (2, 4):
            raise ValueError(f"statistical quantizers have 2 or 4 bits, got {bits!r}")
        self.bits = bits
        self.levels = 1 << bits
        self.name = f"s{bits}"
        self.bits_per_value = float(bits)

    @classmethod
    def from_args(cls, bits: int, args: list[str]) -> StatCodec:
        if list(args):
            raise ValueError(f"s{bits} takes no arguments, got {':'.join(map(str, args))!r}")
        return cls(bits)

    def encoded_size(self, numel: int) -> int:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return 0 if numel == 0 else 4 * self.levels + packed_size(numel, self.bits)

    @staticmethod
    def _mean_std(x: torch.Tensor) -> tuple[float, float]:
        """Mean and sample standard deviation in float64, one chunked pass
        (Chan et al.'s pairwise update), overflow-free for any finite fp32 input."""
        n = x.numel()
        work = scratch(n, torch.float64, x.device)
        count, mean, m2 = 0, 0.0, 0.0
        for start, stop in chunks(n, x.device):
            m = stop - start
            d = work[:m]
            d.copy_(x[start:stop])
            chunk_mean = float(d.sum()) / m
            d.sub_(chunk_mean)
            chunk_m2 = float(torch.dot(d, d))
            delta = chunk_mean - mean
            total = count + m
            mean += delta * m / total
            m2 += chunk_m2 + delta * delta * count * m / total
            count = total
        return mean, math.sqrt(m2 / (n - 1)) if n > 1 else 0.0

    def encode_view(self, t: torch.Tensor) -> bytes | memoryview:
        x = check_input(t)
        n = x.numel()
        if n == 0:
            return b""
        if not all_finite(x):
            raise ValueError("cannot quantize non-finite values (NaN or inf in the input)")
        mean, sigma = self._mean_std(x)
        half = self.levels // 2
        width = 6.0 * sigma / self.levels
        # 1/w as an fp32 multiplier in [2**-126, FLT_MAX]: sigma == 0 (all values equal)
        # gives the largest one, and x - mean == 0 then still lands in the centre bin.
        inv_width = min(FLT_MAX, max(2.0**-126, 1.0 / width)) if width > 0 else FLT_MAX
        mean32 = float(np.float32(mean))
        counts = torch.zeros(self.levels, dtype=torch.int64, device=x.device)
        sums = torch.zeros(self.levels, dtype=torch.float64, device=x.device)
        head = 4 * self.levels
        out = payload_buffer(self.encoded_size(n), x.device)
        body = torch.from_numpy(out[head:])
        staged = staging(body, x.device)
        work = scratch(n, torch.float32, x.device)
        wide = scratch(n, torch.float64, x.device)
        codes = scratch(n, torch.uint8, x.device)
        for start, stop in chunks(n, x.device):
            m = stop - start
            xc = x[start:stop]
            v = torch.sub(xc, mean32, out=work[:m])
            v.mul_(inv_width).round_().clamp_(-half, half - 1).add_(half)  # inf clamps; no NaN
            c = codes[:m]
            c.copy_(v)
            chunk_counts, chunk_sums = bin_totals(c, wide[:m].copy_(xc), self.levels)
            counts += chunk_counts
            sums += chunk_sums
            packed = pack_codes(c, self.bits)
            first = start * self.bits // 8
            staged[first : first + packed.numel()].copy_(packed)
        land(body, staged)
        centres = mean + (np.arange(self.levels) - half) * width
        counts_, sums_ = counts.cpu().numpy(), sums.cpu().numpy()
        centroids = np.where(counts_ > 0, sums_ / np.maximum(counts_, 1), centres)
        out[:head].view(F32)[:] = np.clip(centroids, -FLT_MAX, FLT_MAX).astype(np.float32)
        return landed(out)

    def decode(self, payload: bytes | bytearray | memoryview, numel: int,
               device: torch.device | None = None) -> torch.Tensor:
        view = byte_view(payload)
        expect_size(self, view, numel)
        if numel == 0:
            return empty(device)
        table = read_f32(view, 0, self.levels)
        if not np.isfinite(table).all():
            raise PayloadRejected(Reason.NON_FINITE, f"{self.name}: non-finite centroid")
        check_padding(self, view, self.bits, numel)
        by_byte = byte_table(table, self.bits)
        if device is not None and whole(device):
            return decode_table(self, view, numel, 4 * self.levels, self.bits, by_byte, None, 0, Reason.NON_FINITE,
                                "non-finite centroid", device)
        out = np.empty(numel, dtype=np.float32)
        for start, stop in chunks(numel):
            take_bytes(by_byte, packed_chunk(view, 4 * self.levels, self.bits, start, stop), out[start:stop])
        return torch.from_numpy(out)
