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

Where the code lives (imports run one way, top to bottom):

* :mod:`.blockscale` -- what every scaled quantizer shares: block-size
  parsing, chunked processing in :data:`CHUNK`-value steps (a fixed number of
  vectorized operations per chunk, never a Python loop over elements), block
  absmax and scales, stochastic-rounding noise, the decoder's checks and table
  look-ups, and :class:`~.blockscale.BlockScaledCodec`.
* :mod:`.intquant` -- integer codes: ``q8``/``q4``/``q2`` and ``s4``/``s2``.
* :mod:`.floatquant` -- float codes: ``bf16``, ``fp8``, ``e3m0``.
* this module -- the registry: stage names, their factories, and
  :func:`make_quantizer`. It re-exports the codecs and constants (the chunk
  size knob itself is :data:`.blockscale.CHUNK`).
"""

from __future__ import annotations

from typing import Final, Protocol

from . import blockscale
from .blockscale import BLOCK_MAX, BLOCK_MIN, FLT_MAX  # noqa: F401 -- re-exported
from .codecs import Codec
from .floatquant import BF16_MAX, FP8_MAX, Bf16Codec, E3M0Codec, Fp8Codec  # noqa: F401 -- re-exported
from .intquant import BlockQuantCodec, StatCodec

__all__ = [
    "Bf16Codec",
    "BlockQuantCodec",
    "StatCodec",
    "Fp8Codec",
    "E3M0Codec",
    "QUANTIZERS",
    "QuantizerFactory",
    "make_quantizer",
]




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
