"""Dense value quantizers: fp32 tensors to 2..16 bits per value and back.

Each quantizer is a :class:`~diloco.compression.codecs.Codec` and obeys the same
three rules as ``fp32``/``fp16`` (exact sizes checked first, decoding copies,
decoding is bit-for-bit deterministic), plus two more:

4. **Decoded values are always finite.** Every scale and lookup-table entry read
   off the wire is checked -- NaN/inf, or a scale so large that a code times it
   would overflow, raises ``PayloadRejected(NON_FINITE)``; a negative block scale
   (sign bit set, ``-0.0`` included; encoders never write one) raises
   ``BAD_HEADER``; bit patterns the encoder never produces (the spare code of a
   signed integer quantizer, ``e3m0``'s negative zero, non-zero padding bits)
   raise ``BAD_DTYPE`` ("not this codec's encoding"). All sizes derive from the
   receiver's own ``numel``; nothing sized from the wire is allocated.
5. **Encoding refuses non-finite input** with ``ValueError`` (callers check for
   divergence before they encode; a quantizer cannot represent inf anyway).

Wire layout: ``[header][codes]``, all multi-byte numbers little-endian fp32
(``'<f4'``), codes bit-packed LSB-first by :mod:`.bits`. An empty tensor
encodes to ``b""`` for every quantizer.

The quantizers (``name`` = canonical spec; ``n`` values; bounds per value):

* ``bf16`` -- 16-bit bfloat16, round-to-nearest-even, no header.
  ``|x - x_hat| <= 2**-8 |x|`` in the normal range; finite values beyond
  bf16's range are clamped to +-(2 - 2**-7) * 2**127.
* ``q8:N``, ``q4:N``, ``q2:N`` (``[:sr]``) -- ``ceil(n/N)`` fp32 block scales
  ``s = absmax/qmax``, then two's complement codes in ``[-qmax, qmax]``,
  ``qmax`` = 127 / 7 / 1 (``q2`` is ternary); the spare code ``-(qmax+1)`` is
  rejected. ``|x - x_hat| <= s/2``; with ``:sr`` ``< s`` and unbiased.
* ``s4``, ``s2`` -- 16 / 4 fp32 bin centroids, then 4 / 2-bit bin indices.
  No per-element bound (outliers clamp into the end bins); relative L2 error
  about 0.11 / 0.42 on Gaussian data.
* ``fp8:N`` -- ``ceil(n/N)`` fp32 block scales ``s = absmax/448``, then one
  OCP e4m3 byte of ``x/s`` per value. ``|x - x_hat| <= 2**-4 |x|`` for
  ``|x| >= 2**-6 s``, else ``<= 2**-10 s``.
* ``e3m0:N`` (``[:sr]``) -- one fp32 scale ``a = absmax`` per tensor (``N = 0``)
  or per block of ``N``, then 4-bit sign + 3-bit-exponent codes with magnitudes
  ``{0, a/64, a/32, ..., a/2, a}``. ``|x - x_hat| <= |x|/3`` for
  ``|x| >= a/64``, else ``<= a/128``.

(Bounds are exact-arithmetic bounds; fp32 rounding of ``x/s`` and of the
decoder's ``code * s`` adds at most a few ulps of the block's absmax.)

Block sizes ``N`` are powers of two between 16 and 65536 (``e3m0`` also takes 0,
meaning one scale for the whole tensor). Block scales are stored as **fp32**,
not fp16: pseudo-gradient blocks with absmax below fp16's normal range (6e-5)
are common and would lose precision or underflow, and 32 bits per block is
0.125 bits/value at N = 256. Stochastic rounding (``:sr``) draws from a
``torch.Generator`` the codec owns (seeded from ``os.urandom`` unless a ``seed``
is given); it only changes what the *encoder* picks, never how bytes decode, so
the seed is not part of the name and peers need not agree on it.

:data:`QUANTIZERS` maps a stage name to a factory taking the stage's
colon-separated arguments; :func:`make_quantizer` parses a whole spec such as
``"q4:128:sr"``. A codec's ``name`` is its canonical spec with every argument
explicit (``"q4"`` -> ``"q4:256"``), so peers whose names are equal encode
compatibly.

Speed: every codec works through the tensor in chunks of :data:`CHUNK` values
(a few MB of reused scratch that stays in the last-level cache, instead of
tensor-sized temporaries whose page faults alone cost as much as a clone), with
a fixed number of vectorized torch/numpy operations per chunk -- never a Python
loop over elements. The encoder is free to be approximate (its statistics are
computed in whatever order is fastest); the decoder only does exact table
look-ups and one IEEE fp32 multiply per value, so every machine decodes the
same bits.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Final, Protocol

import numpy as np
import torch

from .bits import pack_bits_tensor, packed_size, padding_bits_clear
from .codecs import Codec, _byte_view, _check_input, _expect_size
from .errors import PayloadRejected, Reason

__all__ = [
    "CHUNK",
    "Bf16Codec",
    "BlockQuantCodec",
    "StatCodec",
    "Fp8Codec",
    "E3M0Codec",
    "QUANTIZERS",
    "QuantizerFactory",
    "make_quantizer",
]

CHUNK: int = 1 << 20
"""Values processed per vectorized step (a tuning knob, not part of the format; it
must stay a multiple of every block size, i.e. of 65536)."""

BLOCK_MIN: Final[int] = 16
BLOCK_MAX: Final[int] = 65536
FLT_MAX: Final[float] = float(np.finfo(np.float32).max)
BF16_MAX: Final[float] = float.fromhex("0x1.fep127")
"""Largest finite bfloat16, (2 - 2**-7) * 2**127."""
FP8_MAX: Final[float] = 448.0
"""Largest finite float8_e4m3fn."""

_F32: Final[str] = "<f4"


def _max_scale(top: float) -> float:
    """Largest fp32 ``s`` whose fp32 product with ``top`` is still finite.

    Encoders clamp block scales to it and decoders reject larger ones, so that
    ``code * s`` can never overflow for any code of magnitude <= ``top``.
    """
    t = np.float32(top)
    s = np.float32(FLT_MAX / top)
    with np.errstate(over="ignore"):
        while not np.isfinite(t * s):
            s = np.nextafter(s, np.float32(0))
        while np.isfinite(t * np.nextafter(s, np.float32(np.inf))):
            s = np.nextafter(s, np.float32(np.inf))
    return float(s)


# --------------------------------------------------------------------------- shared plumbing


def _chunks(n: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, CHUNK):
        yield start, min(n, start + CHUNK)


def _blockwise(op: Callable[..., torch.Tensor], src: torch.Tensor, scales: torch.Tensor, block: int,
               out: torch.Tensor) -> None:
    """``out = op(src, scale of each value's block)`` for a chunk that starts on a
    block boundary; the chunk's last block may be partial."""
    n = src.numel()
    full = n // block
    if full:
        op(src[: full * block].view(full, block), scales[:full, None], out=out[: full * block].view(full, block))
    if n > full * block:
        op(src[full * block :], scales[full : full + 1], out=out[full * block :])


def _block_absmax(x: torch.Tensor, block: int) -> np.ndarray:
    """fp32 ``max |x|`` of each block of ``block`` values (the last may be partial).

    NaN and inf propagate, so one look at the (small) result checks the whole
    input for finiteness. ``-0.0`` is canonicalised to ``+0.0``.
    """
    a = x.numpy()
    full = a.size // block
    parts = []
    if full:
        rows = a[: full * block].reshape(full, block)
        parts.append(np.maximum(rows.max(axis=1), -rows.min(axis=1)))
    if a.size > full * block:
        tail = a[full * block :]
        parts.append(np.maximum(tail.max(keepdims=True), -tail.min(keepdims=True)))
    absmax = np.abs(np.concatenate(parts))
    if not np.isfinite(absmax).all():
        raise ValueError("cannot quantize non-finite values (NaN or inf in the input)")
    return absmax


def _safe(scales: np.ndarray) -> torch.Tensor:
    """Scales to divide by: a zero scale (all-zero block) becomes 1 (its codes are 0)."""
    return torch.from_numpy(np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32))


def _read_f32(view: memoryview, offset: int, count: int) -> np.ndarray:
    """``count`` little-endian fp32 values at ``offset``, as a new native array."""
    return np.frombuffer(view, dtype=_F32, count=count, offset=offset).astype(np.float32)


def _check_scales(codec: Codec, scales: np.ndarray, max_scale: float) -> None:
    if not np.isfinite(scales).all():
        raise PayloadRejected(Reason.NON_FINITE, f"{codec.name}: non-finite scale")
    if (scales > np.float32(max_scale)).any():
        raise PayloadRejected(Reason.NON_FINITE, f"{codec.name}: scale {float(scales.max()):g} would overflow fp32")
    if np.signbit(scales).any():
        raise PayloadRejected(Reason.BAD_HEADER, f"{codec.name}: negative scale")


def _check_padding(codec: Codec, view: memoryview, bits: int, numel: int) -> None:
    if not padding_bits_clear(view, bits, numel):
        raise PayloadRejected(Reason.BAD_DTYPE, f"{codec.name}: non-zero padding bits")


def _packed_chunk(view: memoryview, offset: int, bits: int, start: int, stop: int) -> np.ndarray:
    """Read-only uint8 array of the packed codes of values ``start:stop`` (start % 8 == 0)."""
    return np.frombuffer(view, dtype=np.uint8, count=packed_size(stop - start, bits),
                         offset=offset + start * bits // 8)


def _byte_table(values: np.ndarray, bits: int) -> np.ndarray:
    """(256, 8 // bits) fp32 table: row ``b`` holds the values of the codes packed in byte ``b``."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    byte = np.arange(256)
    codes = np.stack([(byte >> (bits * j)) & mask for j in range(per_byte)], axis=1)
    return values.astype(np.float32)[codes]


def _take_bytes(table: np.ndarray, packed: np.ndarray, out: np.ndarray) -> None:
    """``out`` = the values of ``out.size`` codes packed in ``packed``, via a byte table."""
    per_byte = table.shape[1]
    full = out.size // per_byte
    if full:
        np.take(table, packed[:full], axis=0, out=out[: full * per_byte].reshape(full, per_byte), mode="clip")
    if out.size > full * per_byte:
        out[full * per_byte :] = table[packed[full], : out.size - full * per_byte]


def _decode_table(codec: Codec, view: memoryview, numel: int, head: int, bits: int, table: np.ndarray,
                  scales: torch.Tensor | None, block: int, reason: Reason, what: str) -> torch.Tensor:
    """Decode ``numel`` packed codes after ``head`` header bytes: a byte-table look-up,
    then (when ``scales`` is given) one fp32 multiply by each value's block scale.

    Table entries that must never be received are NaN; one ``aminmax`` over the
    result then rejects them with ``reason`` (finite entries times checked scales
    cannot overflow).
    """
    out = np.empty(numel, dtype=np.float32)
    result = torch.from_numpy(out)
    for start, stop in _chunks(numel):
        _take_bytes(table, _packed_chunk(view, head, bits, start, stop), out[start:stop])
        if scales is not None:
            o = result[start:stop]
            _blockwise(torch.mul, o, scales[start // block :], block, o)
    _require_finite_output(codec, result, reason, what)
    return result


def _require_finite_output(codec: Codec, out: torch.Tensor, reason: Reason, what: str) -> None:
    if out.numel():
        low, high = torch.aminmax(out)  # NaN propagates; one pass, no allocation
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            raise PayloadRejected(reason, f"{codec.name}: {what}")


class _Dither:
    """Uniform [0, 1) noise for stochastic rounding, from a generator the codec owns.

    torch's CPU ``uniform_`` draws fp32 values on a 2**-24 grid, so ``P(u < p)`` is within
    2**-24 of ``p``: rounding up with that probability is unbiased to 2**-24 of a
    quantization step. A lock makes one codec safe to share between threads.
    """

    def __init__(self, seed: int | None) -> None:
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        elif type(seed) is not int or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        self._generator = torch.Generator()
        self._generator.manual_seed(seed)
        self._lock = threading.Lock()

    def fill(self, buffer: torch.Tensor) -> torch.Tensor:
        with self._lock:
            return buffer.uniform_(0.0, 1.0, generator=self._generator)


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32)


# --------------------------------------------------------------------------- bf16


class Bf16Codec(Codec):
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

    def encoded_size(self, numel: int) -> int:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return 2 * numel

    def encode(self, t: torch.Tensor) -> bytes:
        x = _check_input(t)
        if x.numel() == 0:
            return b""
        low, high = torch.aminmax(x)
        low_f, high_f = float(low), float(high)
        if not (math.isfinite(low_f) and math.isfinite(high_f)):
            raise ValueError("cannot quantize non-finite values (NaN or inf in the input)")
        if max(-low_f, high_f) > BF16_MAX:
            x = x.clamp(-BF16_MAX, BF16_MAX)
        half = x.to(torch.bfloat16).view(torch.int16).numpy()
        return half.astype("<i2", copy=False).tobytes()

    def decode(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        view = _byte_view(payload)
        _expect_size(self, view, numel)
        words = np.frombuffer(view, dtype="<u2", count=numel)
        wide = np.empty(numel, dtype=np.uint32)
        np.left_shift(words, np.uint32(16), out=wide, dtype=np.uint32)
        out = torch.from_numpy(wide.view(np.float32))
        _require_finite_output(self, out, Reason.NON_FINITE, "inf or NaN value")
        return out


# --------------------------------------------------------------------------- blockwise absmax integers


def _parse_block(stage: str, text: str, *, per_tensor_ok: bool) -> int:
    allowed = f"a power of two between {BLOCK_MIN} and {BLOCK_MAX}"
    if per_tensor_ok:
        allowed += " (or 0 for one scale per tensor)"
    if not re.fullmatch(r"0|[1-9][0-9]{0,9}", text):
        raise ValueError(f"{stage} block size must be {allowed}, got {text!r}")
    block = int(text)
    if block == 0 and per_tensor_ok:
        return 0
    if not (BLOCK_MIN <= block <= BLOCK_MAX and block & (block - 1) == 0):
        raise ValueError(f"{stage} block size must be {allowed}, got {block}")
    return block


def _parse_block_args(stage: str, args: list[str], *, default_block: int, per_tensor_ok: bool = False,
                      sr_ok: bool = True) -> tuple[int, bool]:
    """Parse ``[BLOCK][:sr]`` stage arguments into (block, stochastic)."""
    usage = f"{stage}[:BLOCK]" + ("[:sr]" if sr_ok else "")
    if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"{stage} arguments must be a list of strings, got {args!r}")
    rest = list(args)
    stochastic = False
    if rest and rest[-1] == "sr":
        if not sr_ok:
            raise ValueError(f"{stage} has no stochastic rounding; expected {usage}")
        stochastic = True
        rest.pop()
    if len(rest) > 1:
        raise ValueError(f"too many arguments for {stage}: {':'.join(args)!r}; expected {usage}")
    block = _parse_block(stage, rest[0], per_tensor_ok=per_tensor_ok) if rest else default_block
    return block, stochastic


def _check_block(stage: str, block: int, *, per_tensor_ok: bool = False) -> int:
    if type(block) is not int:
        raise ValueError(f"{stage} block size must be an int, got {block!r}")
    return _parse_block(stage, str(block), per_tensor_ok=per_tensor_ok)


class BlockQuantCodec(Codec):
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
        self.block = _check_block(f"q{bits}", block)
        self.qmax = (1 << (bits - 1)) - 1
        self.stochastic = bool(stochastic)
        self.name = f"q{bits}:{self.block}" + (":sr" if self.stochastic else "")
        self.bits_per_value = bits + 32.0 / self.block
        self._max_scale = _max_scale(self.qmax)
        self._dither = _Dither(seed) if self.stochastic else None
        codes = np.arange(1 << bits)
        values = np.where(codes <= self.qmax, codes, codes - (1 << bits)).astype(np.float32)
        values[self.qmax + 1] = np.nan  # the spare code -(qmax + 1)
        self._table = _byte_table(values, bits)  # two's complement value(s) of each byte

    @classmethod
    def from_args(cls, bits: int, args: list[str], *, seed: int | None = None) -> BlockQuantCodec:
        block, stochastic = _parse_block_args(f"q{bits}", args, default_block=256)
        return cls(bits, block, stochastic=stochastic, seed=seed)

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def encoded_size(self, numel: int) -> int:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return 4 * self._blocks(numel) + packed_size(numel, self.bits)

    def encode(self, t: torch.Tensor) -> bytes:
        x = _check_input(t)
        n = x.numel()
        if n == 0:
            return b""
        absmax = _block_absmax(x, self.block)
        scales = np.minimum(np.divide(absmax, np.float32(self.qmax), dtype=np.float32), np.float32(self._max_scale))
        divisors = _safe(scales)
        head = 4 * scales.size
        out = np.empty(self.encoded_size(n), dtype=np.uint8)
        out[:head].view(_F32)[:] = scales
        body = torch.from_numpy(out[head:])
        work = torch.empty(min(n, CHUNK), dtype=torch.float32)
        codes = torch.empty(min(n, CHUNK), dtype=torch.int8)
        if self._dither is not None:
            floor = torch.empty_like(work)
            noise = torch.empty_like(work)
            up = torch.empty(work.numel(), dtype=torch.bool)
        mask = (1 << self.bits) - 1
        for start, stop in _chunks(n):
            m = stop - start
            v = work[:m]
            _blockwise(torch.div, x[start:stop], divisors[start // self.block :], self.block, v)
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
                body[start:stop].copy_(c.view(torch.uint8))
            else:
                packed = pack_bits_tensor(c.view(torch.uint8) & mask, self.bits)
                body[first : first + packed.numel()].copy_(packed)
        return out.tobytes()

    def decode(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        view = _byte_view(payload)
        _expect_size(self, view, numel)
        if numel == 0:
            return _empty()
        blocks = self._blocks(numel)
        scales = _read_f32(view, 0, blocks)
        _check_scales(self, scales, self._max_scale)
        _check_padding(self, view, self.bits, numel)
        # The spare code is NaN in the table; valid codes times a checked scale are finite.
        return _decode_table(self, view, numel, 4 * blocks, self.bits, self._table, torch.from_numpy(scales),
                             self.block, Reason.BAD_DTYPE, f"spare code {-self.qmax - 1}")


# --------------------------------------------------------------------------- statistical codebook


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
        work = torch.empty(min(n, CHUNK), dtype=torch.float64)
        count, mean, m2 = 0, 0.0, 0.0
        for start, stop in _chunks(n):
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

    def encode(self, t: torch.Tensor) -> bytes:
        x = _check_input(t)
        n = x.numel()
        if n == 0:
            return b""
        low, high = torch.aminmax(x)
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            raise ValueError("cannot quantize non-finite values (NaN or inf in the input)")
        mean, sigma = self._mean_std(x)
        half = self.levels // 2
        width = 6.0 * sigma / self.levels
        # 1/w as an fp32 multiplier in [2**-126, FLT_MAX]: sigma == 0 (all values equal)
        # gives the largest one, and x - mean == 0 then still lands in the centre bin.
        inv_width = min(FLT_MAX, max(2.0**-126, 1.0 / width)) if width > 0 else FLT_MAX
        mean32 = float(np.float32(mean))
        counts = torch.zeros(self.levels, dtype=torch.int64)
        sums = torch.zeros(self.levels, dtype=torch.float64)
        head = 4 * self.levels
        out = np.empty(self.encoded_size(n), dtype=np.uint8)
        body = torch.from_numpy(out[head:])
        work = torch.empty(min(n, CHUNK), dtype=torch.float32)
        wide = torch.empty(min(n, CHUNK), dtype=torch.float64)
        codes = torch.empty(min(n, CHUNK), dtype=torch.uint8)
        for start, stop in _chunks(n):
            m = stop - start
            xc = x[start:stop]
            v = torch.sub(xc, mean32, out=work[:m])
            v.mul_(inv_width).round_().clamp_(-half, half - 1).add_(half)  # inf clamps; no NaN
            c = codes[:m]
            c.copy_(v)
            counts += torch.bincount(c, minlength=self.levels)
            sums += torch.bincount(c, weights=wide[:m].copy_(xc), minlength=self.levels)
            packed = pack_bits_tensor(c, self.bits)
            first = start * self.bits // 8
            body[first : first + packed.numel()].copy_(packed)
        centres = mean + (np.arange(self.levels) - half) * width
        centroids = np.where(counts.numpy() > 0, sums.numpy() / np.maximum(counts.numpy(), 1), centres)
        out[:head].view(_F32)[:] = np.clip(centroids, -FLT_MAX, FLT_MAX).astype(np.float32)
        return out.tobytes()

    def decode(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        view = _byte_view(payload)
        _expect_size(self, view, numel)
        if numel == 0:
            return _empty()
        table = _read_f32(view, 0, self.levels)
        if not np.isfinite(table).all():
            raise PayloadRejected(Reason.NON_FINITE, f"{self.name}: non-finite centroid")
        _check_padding(self, view, self.bits, numel)
        by_byte = _byte_table(table, self.bits)
        out = np.empty(numel, dtype=np.float32)
        for start, stop in _chunks(numel):
            _take_bytes(by_byte, _packed_chunk(view, 4 * self.levels, self.bits, start, stop), out[start:stop])
        return torch.from_numpy(out)


# --------------------------------------------------------------------------- fp8 e4m3


_FP8_TABLE: Final[np.ndarray] = _byte_table(
    torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy(), 8)
"""The exact fp32 value of every e4m3 byte (NaN for 0x7f and 0xff), from torch's conversion."""


class Fp8Codec(Codec):
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

    def __init__(self, block: int = 256) -> None:
        self.block = _check_block("fp8", block)
        self.name = f"fp8:{self.block}"
        self.bits_per_value = 8 + 32.0 / self.block
        self._max_scale = _max_scale(FP8_MAX)

    @classmethod
    def from_args(cls, args: list[str]) -> Fp8Codec:
        block, _ = _parse_block_args("fp8", args, default_block=256, sr_ok=False)
        return cls(block)

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def encoded_size(self, numel: int) -> int:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return 4 * self._blocks(numel) + numel

    def encode(self, t: torch.Tensor) -> bytes:
        x = _check_input(t)
        n = x.numel()
        if n == 0:
            return b""
        absmax = _block_absmax(x, self.block)
        scales = np.minimum(np.divide(absmax, np.float32(FP8_MAX), dtype=np.float32), np.float32(self._max_scale))
        divisors = _safe(scales)
        head = 4 * scales.size
        out = np.empty(self.encoded_size(n), dtype=np.uint8)
        out[:head].view(_F32)[:] = scales
        body = torch.from_numpy(out[head:])
        work = torch.empty(min(n, CHUNK), dtype=torch.float32)
        for start, stop in _chunks(n):
            v = work[: stop - start]
            _blockwise(torch.div, x[start:stop], divisors[start // self.block :], self.block, v)
            v.clamp_(-FP8_MAX, FP8_MAX)
            body[start:stop].copy_(v.to(torch.float8_e4m3fn).view(torch.uint8))
        return out.tobytes()

    def decode(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        view = _byte_view(payload)
        _expect_size(self, view, numel)
        if numel == 0:
            return _empty()
        blocks = self._blocks(numel)
        scales = _read_f32(view, 0, blocks)
        _check_scales(self, scales, self._max_scale)
        return _decode_table(self, view, numel, 4 * blocks, 8, _FP8_TABLE, torch.from_numpy(scales), self.block,
                             Reason.NON_FINITE, "e4m3 NaN code")


# --------------------------------------------------------------------------- e3m0 (FP4)


_E3M0_UNIT: Final[np.ndarray] = np.array(
    [0.0, *(2.0 ** (k - 7) for k in range(1, 8)), np.nan, *(-(2.0 ** (k - 7)) for k in range(1, 8))],
    dtype=np.float32,
)
"""Value of each 4-bit e3m0 code for a scale of 1 (code 8, "negative zero", is reserved)."""


class E3M0Codec(Codec):
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

    def __init__(self, block: int = 0, *, stochastic: bool = False, seed: int | None = None) -> None:
        self.block = _check_block("e3m0", block, per_tensor_ok=True)
        self.stochastic = bool(stochastic)
        self.name = f"e3m0:{self.block}" + (":sr" if self.stochastic else "")
        self.bits_per_value = 4.0 + (32.0 / self.block if self.block else 0.0)
        self._dither = _Dither(seed) if self.stochastic else None

    @classmethod
    def from_args(cls, args: list[str], *, seed: int | None = None) -> E3M0Codec:
        block, stochastic = _parse_block_args("e3m0", args, default_block=0, per_tensor_ok=True)
        return cls(block, stochastic=stochastic, seed=seed)

    def _blocks(self, numel: int) -> int:
        if self.block == 0:
            return min(numel, 1)
        return -(-numel // self.block)

    def encoded_size(self, numel: int) -> int:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return 4 * self._blocks(numel) + packed_size(numel, 4)

    def _chunk_scales(self, scales: np.ndarray, numel: int) -> tuple[int, torch.Tensor]:
        """(block, per-block scales) to use chunk by chunk; a per-tensor scale is
        repeated over virtual blocks of CHUNK values."""
        table = torch.from_numpy(scales)
        if self.block:
            return self.block, table
        return CHUNK, table.expand(-(-numel // CHUNK))

    def encode(self, t: torch.Tensor) -> bytes:
        x = _check_input(t)
        n = x.numel()
        if n == 0:
            return b""
        scales = _block_absmax(x, self.block or n)
        block, divisors = self._chunk_scales(_safe(scales).numpy(), n)
        head = 4 * scales.size
        out = np.empty(self.encoded_size(n), dtype=np.uint8)
        out[:head].view(_F32)[:] = scales
        body = torch.from_numpy(out[head:])
        size = min(n, CHUNK)
        ratio = torch.empty(size, dtype=torch.float32)
        exponent = torch.empty(size, dtype=torch.int32)
        flag = torch.empty(size, dtype=torch.bool)
        if self._dither is not None:
            low = torch.empty(size, dtype=torch.float32)
            noise = torch.empty(size, dtype=torch.float32)
        for start, stop in _chunks(n):
            m = stop - start
            xc = x[start:stop]
            r = torch.abs(xc, out=ratio[:m])
            _blockwise(torch.div, r, divisors[start // block :], block, r)  # r in [0, 1]
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
            packed = pack_bits_tensor(k.to(torch.uint8), 4)
            first = start // 2
            body[first : first + packed.numel()].copy_(packed)
        return out.tobytes()

    def decode(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        view = _byte_view(payload)
        _expect_size(self, view, numel)
        if numel == 0:
            return _empty()
        blocks = self._blocks(numel)
        scales = _read_f32(view, 0, blocks)
        _check_scales(self, scales, FLT_MAX)
        _check_padding(self, view, 4, numel)
        table = _byte_table(_E3M0_UNIT, 4)
        multipliers: torch.Tensor | None = torch.from_numpy(scales)
        if self.block == 0:  # fold the one scale into the table: the same fp32 products
            table, multipliers = table * scales[0], None
        return _decode_table(self, view, numel, 4 * blocks, 4, table, multipliers, self.block,
                             Reason.BAD_DTYPE, "reserved code 0b1000 (negative zero)")


# --------------------------------------------------------------------------- registry


class QuantizerFactory(Protocol):
    """Builds a quantizer from a stage's colon-separated arguments (``ValueError``
    saying what is allowed if they are bad); ``seed`` seeds stochastic rounding."""

    def __call__(self, args: list[str], *, seed: int | None = None) -> Codec: ...


def _bf16(args: list[str], *, seed: int | None = None) -> Codec:
    if list(args):
        raise ValueError(f"bf16 takes no arguments, got {':'.join(map(str, args))!r}")
    return Bf16Codec()


def _q(bits: int) -> QuantizerFactory:
    def make(args: list[str], *, seed: int | None = None) -> Codec:
        return BlockQuantCodec.from_args(bits, args, seed=seed)

    make.__name__ = f"q{bits}"
    make.__doc__ = f"q{bits}[:BLOCK=256][:sr] -> BlockQuantCodec"
    return make


def _s(bits: int) -> QuantizerFactory:
    def make(args: list[str], *, seed: int | None = None) -> Codec:
        return StatCodec.from_args(bits, args)

    make.__name__ = f"s{bits}"
    make.__doc__ = f"s{bits} -> StatCodec"
    return make


def _fp8(args: list[str], *, seed: int | None = None) -> Codec:
    return Fp8Codec.from_args(args)


def _e3m0(args: list[str], *, seed: int | None = None) -> Codec:
    return E3M0Codec.from_args(args, seed=seed)


QUANTIZERS: Final[dict[str, QuantizerFactory]] = {
    "bf16": _bf16,
    "q8": _q(8),
    "q4": _q(4),
    "q2": _q(2),
    "s4": _s(4),
    "s2": _s(2),
    "fp8": _fp8,
    "e3m0": _e3m0,
}
"""Stage name -> factory taking the stage's colon-separated arguments (and an
optional ``seed=`` keyword for stochastic rounding). Bad arguments raise
``ValueError`` saying what is allowed."""


def make_quantizer(spec: str, *, seed: int | None = None) -> Codec:
    """Build a quantizer from a spec such as ``"q4"``, ``"q4:128:sr"`` or ``"e3m0:0"``.

    ``make_quantizer(c.name)`` rebuilds an equivalent codec for any quantizer ``c``.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"quantizer spec must be a non-empty string, got {spec!r}")
    stage, *args = spec.split(":")
    factory = QUANTIZERS.get(stage)
    if factory is None:
        raise ValueError(f"unknown quantizer {stage!r}; choose one of: {', '.join(QUANTIZERS)}")
    return factory(args, seed=seed)
