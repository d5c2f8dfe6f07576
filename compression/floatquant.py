"""Float quantizers: each value keeps a sign and an *exponent*, so the error is
relative to the value itself rather than to a block's largest value.

* :class:`Bf16Codec` -- bfloat16, fp32 with the mantissa cut to 7 bits. Keeps
  fp32's exponent range, so it needs no scale at all.
* :class:`Fp8Codec` -- OCP FP8 E4M3 (3 mantissa bits) after dividing each block
  by ``absmax / 448``, so the block's largest value lands on e4m3's largest.
* :class:`E3M0Codec` -- 4-bit codes with no mantissa: a sign and one of eight
  magnitudes ``{0, a/64, ..., a/2, a}``, powers of two below the absmax ``a``.

The scaled two are :class:`~.blockscale.BlockScaledCodec` subclasses
(``[fp32 scales][codes]``); all three decode by exact conversion or table
look-up, never by an approximate math function, so every peer gets the same
bits. Registry names and argument parsing live in :mod:`.quant`.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
import torch

from .bits import pack_codes
from .blockscale import (
    FLT_MAX,
    BlockScaledCodec,
    Dither,
    blockwise,
    byte_table,
    check_block,
    chunks,
    decode_table,
    parse_block_args,
    require_finite_output,
    scale_limit,
    scratch,
)
from .codecs import FixedWidthCodec, byte_view, check_input, expect_size, host_bytes, whole, wire_bytes
from .errors import Reason

__all__ = ["BF16_MAX", "FP8_MAX", "Bf16Codec", "Fp8Codec", "E3M0Codec"]

BF16_MAX: Final[float] = float.fromhex("0x1.fep127")
"""Largest finite bfloat16, (2 - 2**-7) * 2**127."""
FP8_MAX: Final[float] = 448.0
"""Largest finite float8_e4m3fn."""


# --------------------------------------------------------------------------- bf16


class Bf16Codec(FixedWidthCodec):
    """bfloat16: fp32's sign and 8-bit exponent with the mantissa rounded to 7 bits.

    Encoding is torch's round-to-nearest-even cast (``.to(torch.bfloat16)``), so
    the relative error is at most 2**-8 for magnitudes in the normal range
    (>= 2**-126) and the absolute error at most 2**-134 below it. Finite inputs
    beyond bf16's largest value (which would round to inf) are clamped to
    +-``BF16_MAX``. Decoding is exact: a bf16 is the top half of an fp32, so the
    decoder just shifts each 16-bit word left by 16. Words encoding inf/NaN are
    rejected (``NON_FINITE``). The usual mixed-precision storage format: half of
    fp32's bytes with fp32's full exponent range, so no scale is needed.
    """

    name = "bf16"
    bits_per_value = 16.0

    def encode_view(self, t: torch.Tensor) -> bytes | memoryview:
        x = check_input(t)
        if x.numel() == 0:
            return b""
        low, high = torch.aminmax(x)
        low_f, high_f = float(low), float(high)
        if not (math.isfinite(low_f) and math.isfinite(high_f)):
            raise ValueError("cannot quantize non-finite values (NaN or inf in the input)")
        if max(-low_f, high_f) > BF16_MAX:
            x = x.clamp(-BF16_MAX, BF16_MAX)
        return host_bytes(x.to(torch.bfloat16).view(torch.int16))

    def decode(self, payload: bytes | bytearray | memoryview, numel: int,
               device: torch.device | None = None) -> torch.Tensor:
        view = byte_view(payload)
        expect_size(self, view, numel)
        if device is not None and whole(device):  # each word becomes the high half of an fp32 (the shift drops the
            halves = wire_bytes(view, 0, 2 * numel, device).view(torch.int16)  # sign extension's bits)
            values = halves.to(torch.int32).bitwise_left_shift_(16).view(torch.float32)
            require_finite_output(self, values, Reason.NON_FINITE, "inf or NaN value")
            return values
        words = np.frombuffer(view, dtype="<u2", count=numel)
        wide = np.empty(numel, dtype=np.uint32)
        np.left_shift(words, np.uint32(16), out=wide, dtype=np.uint32)
        out = torch.from_numpy(wide.view(np.float32))
        require_finite_output(self, out, Reason.NON_FINITE, "inf or NaN value")
        return out


# --------------------------------------------------------------------------- fp8 e4m3


_FP8_TABLE: Final[np.ndarray] = byte_table(
    torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy(), 8)
"""The exact fp32 value of every e4m3 byte (NaN for 0x7f and 0xff), from torch's conversion."""


class Fp8Codec(BlockScaledCodec):
    """Blockwise-scaled OCP FP8 E4M3 (``torch.float8_e4m3fn``), as in DeepSeek-V3 /
    Transformer Engine FP8 training with fine-grained scaling.

    Each block of ``block`` values gets an fp32 scale ``s = absmax / 448`` so its
    largest value maps onto e4m3's largest finite value, 448; each value is
    ``x / s`` cast with torch's round-to-nearest-even e4m3 conversion (4
    exponent bits, bias 7, 3 mantissa bits, subnormals down to 2**-9, no inf).
    Decoding is the exact e4m3 -> fp32 conversion times ``s``.

    Error: relative ``<= 2**-4`` for ``|x| >= 2**-6 s`` (e4m3's normal range),
    absolute ``<= 2**-10 s`` below it (half the subnormal step), plus fp32
    rounding. Layout: ``ceil(n/block)`` scales (``'<f4'``), then one byte per
    value. The two NaN bytes (``0x7f``, ``0xff``) decode to NaN and are rejected
    (``NON_FINITE``).
    """

    bits = 8

    def __init__(self, block: int = 256) -> None:
        self.block = check_block("fp8", block)
        self.name = f"fp8:{self.block}"
        self.bits_per_value = 8 + 32.0 / self.block
        self._max_scale = scale_limit(FP8_MAX)

    @classmethod
    def from_args(cls, args: list[str]) -> Fp8Codec:
        block, _ = parse_block_args("fp8", args, default_block=256, sr_ok=False)
        return cls(block)

    def encoded_size(self, numel: int) -> int:
        # One byte per value: the same as the base class's packed_size(numel, 8) for an
        # int, but kept as plain arithmetic, which also accepts int-like numbers.
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return 4 * self._blocks(numel) + numel

    def encode_view(self, t: torch.Tensor) -> bytes | memoryview:
        x = check_input(t)
        n = x.numel()
        if n == 0:
            return b""
        out, codes, divisors, staged = self._begin(x, FP8_MAX)
        work = scratch(n, torch.float32, x.device)
        for start, stop in chunks(n, x.device):
            v = work[: stop - start]
            blockwise(torch.div, x[start:stop], divisors[start // self.block :], self.block, v)
            v.clamp_(-FP8_MAX, FP8_MAX)
            codes[start:stop].copy_(v.to(torch.float8_e4m3fn).view(torch.uint8))
        return self._finish(out, staged, n)

    def _decode_codes(self, view: memoryview, numel: int, scales: np.ndarray,
                      device: torch.device | None) -> torch.Tensor:
        return decode_table(self, view, numel, 4 * scales.size, 8, _FP8_TABLE, torch.from_numpy(scales),
                             self.block, Reason.NON_FINITE, "e4m3 NaN code", device)


# --------------------------------------------------------------------------- e3m0 (FP4)


_E3M0_UNIT: Final[np.ndarray] = np.array(
    [0.0, *(2.0 ** (k - 7) for k in range(1, 8)), np.nan, *(-(2.0 ** (k - 7)) for k in range(1, 8))],
    dtype=np.float32,
)
"""Value of each 4-bit e3m0 code for a scale of 1 (code 8, "negative zero", is reserved)."""


class E3M0Codec(BlockScaledCodec):
    """4-bit floats with 1 sign bit, 3 exponent bits and no mantissa (E3M0), as in
    Streaming DiLoCo's FP4 outer-gradient communication.

    A code is ``sign << 3 | e``: ``e = 0`` is exact zero, ``e = 1..7`` is the
    magnitude ``a * 2**(e - 7)``, i.e. ``{0, a/64, a/32, a/16, a/8, a/4, a/2, a}``,
    where ``a`` is the fp32 absmax of the whole tensor (``block = 0``, the
    default) or of each block of ``block`` values. The largest value maps to
    ``a`` exactly; magnitudes below ``a * 2**-7`` underflow to zero. Code
    ``0b1000`` (negative zero) is never sent and is rejected (``BAD_DTYPE``).

    Rounding is to the nearest representable magnitude *in the linear domain*
    (threshold between ``a 2**k`` and ``a 2**(k+1)`` at ``1.5 a 2**k``, between 0
    and ``a/64`` at ``a/128``; ties round up in magnitude), computed from the
    fp32 bits of ``|x|/a``. So the relative error is at most 1/3 for
    ``|x| >= a/64`` and the absolute error at most ``a/128`` below. With
    ``stochastic=True`` (``:sr``) a value between neighbours ``lo < |x| < hi`` is
    rounded up with probability ``(|x| - lo)/(hi - lo)``: unbiased (to 2**-24 of
    the step), including in the underflow range where ``lo = 0``.

    Layout: ``1`` (``block = 0``) or ``ceil(n/block)`` fp32 scales, then the codes
    packed two per byte, low nibble first. Decoding is a table look-up times the
    scale, in fp32.
    """

    bits = 4
    _max_scale = FLT_MAX  # a = absmax itself; |code| <= 1, so any finite scale is safe

    def __init__(self, block: int = 0, *, stochastic: bool = False, seed: int | None = None) -> None:
        self.block = check_block("e3m0", block, per_tensor_ok=True)
        self.stochastic = bool(stochastic)
        self.name = f"e3m0:{self.block}" + (":sr" if self.stochastic else "")
        self.bits_per_value = 4.0 + (32.0 / self.block if self.block else 0.0)
        self._dither = Dither(seed) if self.stochastic else None

    @classmethod
    def from_args(cls, args: list[str], *, seed: int | None = None) -> E3M0Codec:
        block, stochastic = parse_block_args("e3m0", args, default_block=0, per_tensor_ok=True)
        return cls(block, stochastic=stochastic, seed=seed)

    def encode_view(self, t: torch.Tensor) -> bytes | memoryview:
        x = check_input(t)
        n = x.numel()
        if n == 0:
            return b""
        out, codes, per_block, staged = self._begin(x, None)
        block, divisors = self._chunk_scales(per_block, n)
        ratio = scratch(n, torch.float32, x.device)
        exponent = scratch(n, torch.int32, x.device)
        flag = scratch(n, torch.bool, x.device)
        if self._dither is not None:
            low = scratch(n, torch.float32, x.device)
            noise = scratch(n, torch.float32, x.device)
        for start, stop in chunks(n, x.device):
            m = stop - start
            xc = x[start:stop]
            r = torch.abs(xc, out=ratio[:m])
            blockwise(torch.div, r, divisors[start // block :], block, r)  # r in [0, 1]
            bits = r.view(torch.int32)
            k = exponent[:m]
            if self._dither is None:
                # Nearest power of two: adding half a mantissa carries into the exponent
                # iff the mantissa is >= 1.5; e = biased exponent - 120 (2**-6 -> 1).
                torch.add(bits, 0x400000, out=k).bitwise_right_shift_(23).sub_(120).clamp_(0, 7)
                # [a/128, 1.5 a/128) also rounds up to a/64 (its other neighbour is 0).
                torch.maximum(k, torch.ge(bits, 0x3C000000, out=flag[:m]), out=k)
            else:
                torch.bitwise_right_shift(bits, 23, out=k).sub_(120).clamp_(0, 7)  # round down
                lo = low[:m]
                lo.copy_(torch.bitwise_and(bits, 0x7F800000).view(torch.float32))  # 2**floor(log2 r)
                lo.mul_(k > 0)  # below a/64 the lower neighbour is 0 ...
                r.sub_(lo).div_(lo.clamp_(min=2.0**-6))  # ... and the step a/64; r = P(up)
                k.add_(torch.lt(self._dither.fill(noise[:m]), r, out=flag[:m]))
            negative = torch.lt(xc, 0, out=flag[:m]).logical_and_(k > 0)
            k.add_(negative, alpha=8)
            packed = pack_codes(k.to(torch.uint8), 4)
            first = start // 2
            codes[first : first + packed.numel()].copy_(packed)
        return self._finish(out, staged, n)

    def _decode_codes(self, view: memoryview, numel: int, scales: np.ndarray,
                      device: torch.device | None) -> torch.Tensor:
        table = byte_table(_E3M0_UNIT, 4)
        multipliers: torch.Tensor | None = torch.from_numpy(scales)
        if self.block == 0:  # fold the one scale into the table: the same fp32 products
            table, multipliers = table * scales[0], None
        return decode_table(self, view, numel, 4 * scales.size, 4, table, multipliers, self.block,
                             Reason.BAD_DTYPE, "reserved code 0b1000 (negative zero)", device)
