"""Block scaling: the plumbing every scaled quantizer in :mod:`.quant` shares.

A scaled quantizer cuts the flat tensor into *blocks* of ``N`` values (the last
may be shorter), stores one **fp32 scale** per block, and sends each value as a
small code relative to its block's scale. Small blocks confine an outlier's
damage to its own block; ``N = 0`` (``e3m0`` only) means one scale for the whole
tensor. This module holds what that scheme needs, independent of the code
format:

* **Block sizes** -- :func:`parse_block_args` / :func:`check_block`: powers of
  two between :data:`BLOCK_MIN` and :data:`BLOCK_MAX` (or 0 where allowed).
* **Chunking** -- on a CPU, codecs walk the tensor in chunks of :data:`CHUNK`
  values (:func:`chunks`) with reused scratch (:func:`scratch`): a few MB that
  stay in the last-level cache, instead of tensor-sized temporaries whose page
  faults alone cost as much as a clone. Each chunk gets a fixed number of
  vectorized torch/numpy operations -- never a Python loop over elements.
  :func:`blockwise` applies ``op(value, its block's scale)`` to one chunk.
* **Devices** -- an encoder works where its input is. On a GPU (:func:`whole`)
  the tensor is one chunk (kernel launches, not the cache, set the pace there),
  the codes are written into a buffer beside it (:func:`staging`), and only the
  encoded bytes cross to the host (:func:`land`). A block-scaled encoder there
  (:meth:`BlockScaledCodec._begin`) forms its scales on the device too and stages
  the whole payload, scales and codes, so it waits for the device once, when the
  payload lands, not also for the scales. The bytes are the same as on
  the host for every deterministic codec: the same IEEE divisions, roundings and
  casts, on the same values; decoders look up the same table entries there.
  Tests run this path on a CPU (:data:`.codecs.DEVICE_PATH_ON_CPU`).
* **Encoding** -- :func:`block_absmax` (which also rejects non-finite input),
  :func:`safe` divisors, and :class:`Dither`, the noise for stochastic rounding.
* **Decoding** -- :func:`read_f32` and :func:`_check_scales` read and vet the
  scales, :func:`check_padding` insists on zero padding bits, and
  :func:`decode_table` turns packed codes into values with a 256-row byte table
  (:func:`byte_table`) and one fp32 multiply per value.
* :class:`BlockScaledCodec` -- the layout ``[fp32 scales][packed codes]`` with
  its exact size and the checks every decoder runs before it reads a code.

Why fp32 scales and not fp16: pseudo-gradient blocks with absmax below fp16's
normal range (6e-5) are common and would lose precision or underflow, and 32
bits per block is only 0.125 bits/value at ``N = 256``. Why the decoder is only
table look-ups and IEEE multiplies: every peer must decode the same bits, so the
encoder may be approximate (statistics in whatever order is fastest) but the
decoder may not.

:data:`CHUNK` is read at call time by the helpers here and nowhere else, so
changing it (``quant.CHUNK = ...`` forwards to it) takes effect for every codec.
"""

from __future__ import annotations

import abc
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Final

import numpy as np
import torch

from .bits import packed_size, padding_bits_clear, unpack_codes
from .codecs import Codec, all_finite, byte_view, expect_size, landed, payload_buffer, whole, wire_bytes
from .errors import PayloadRejected, Reason

__all__ = ["CHUNK", "BLOCK_MIN", "BLOCK_MAX", "FLT_MAX", "BlockScaledCodec"]

CHUNK: int = 1 << 20
"""Values processed per vectorized step (a tuning knob, not part of the format; it
must stay a multiple of every block size, i.e. of 65536)."""

BLOCK_MIN: Final[int] = 16
BLOCK_MAX: Final[int] = 65536
FLT_MAX: Final[float] = float(np.finfo(np.float32).max)

F32: Final[str] = "<f4"



def scale_limit(top: float) -> float:
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


# --------------------------------------------------------------------------- block sizes


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


def parse_block_args(stage: str, args: list[str], *, default_block: int, per_tensor_ok: bool = False,
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


def check_block(stage: str, block: int, *, per_tensor_ok: bool = False) -> int:
    if type(block) is not int:
        raise ValueError(f"{stage} block size must be an int, got {block!r}")
    return _parse_block(stage, str(block), per_tensor_ok=per_tensor_ok)


# --------------------------------------------------------------------------- chunking


def chunks(n: int, device: torch.device | None = None) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each chunk of an ``n``-value tensor on ``device`` (the host when None)."""
    step = max(n, 1) if device is not None and whole(device) else CHUNK
    for start in range(0, n, step):
        yield start, min(n, start + step)


def scratch(n: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """Uninitialised scratch for one chunk of an ``n``-value tensor on ``device`` (the host when None)."""
    if device is not None and whole(device):
        return torch.empty(n, dtype=dtype, device=device)
    return torch.empty(min(n, CHUNK), dtype=dtype)


def staging(body: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Where an encoder on ``device`` writes the codes that belong in ``body`` (host memory): ``body`` itself, or
    on a GPU a buffer of the same size beside the input, copied into ``body`` by :func:`land`."""
    if not whole(device):
        return body
    return torch.empty(body.numel(), dtype=body.dtype, device=device)


def land(body: torch.Tensor, staged: torch.Tensor) -> None:
    """Copy staged codes into ``body``: the only bytes that cross from a GPU to the host."""
    if staged is not body:
        body.copy_(staged)


def blockwise(op: Callable[..., torch.Tensor], src: torch.Tensor, scales: torch.Tensor, block: int,
               out: torch.Tensor) -> None:
    """``out = op(src, scale of each value's block)`` for a chunk that starts on a
    block boundary; the chunk's last block may be partial."""
    n = src.numel()
    full = n // block
    if full:
        op(src[: full * block].view(full, block), scales[:full, None], out=out[: full * block].view(full, block))
    if n > full * block:
        op(src[full * block :], scales[full : full + 1], out=out[full * block :])


# --------------------------------------------------------------------------- encoding


NON_FINITE_INPUT = "cannot quantize non-finite values (NaN or inf in the input)"


def device_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 ``max |x|`` of each block of ``block`` values (the last may be partial), on ``x``'s device, without
    waiting for it. NaN and inf propagate; ``-0.0`` becomes ``+0.0``."""
    full = x.numel() // block
    parts = []
    if full:
        low, high = torch.aminmax(x[: full * block].view(full, block), dim=1)
        parts.append(torch.maximum(high, low.neg()))
    if x.numel() > full * block:
        low, high = torch.aminmax(x[full * block :])
        parts.append(torch.maximum(high, low.neg()).view(1))
    return torch.cat(parts).abs()


def block_absmax(x: torch.Tensor, block: int) -> np.ndarray:
    """fp32 ``max |x|`` of each block of ``block`` values of a tensor in host memory (the last block may be
    partial), as a new array; raises ``ValueError`` for non-finite input.

    NaN and inf propagate, so one look at the (small) result checks the whole
    input for finiteness. ``-0.0`` is canonicalised to ``+0.0``. (On a GPU,
    :func:`device_absmax`, and the check comes with the landed payload.)
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
        raise ValueError(NON_FINITE_INPUT)
    return np.asarray(absmax, dtype=np.float32)


def safe(scales: torch.Tensor) -> torch.Tensor:
    """Scales to divide by, where ``scales`` are: a zero scale (all-zero block) becomes 1 (its codes are 0), and so
    does the NaN scale that marks a non-finite block on a GPU (the encoder refuses that input)."""
    return torch.where(scales > 0, scales, 1.0)


class Dither:
    """Uniform [0, 1) noise for stochastic rounding, from a generator the codec owns.

    torch's CPU ``uniform_`` draws fp32 values on a 2**-24 grid, so ``P(u < p)`` is within
    2**-24 of ``p``: rounding up with that probability is unbiased to 2**-24 of a
    quantization step. A GPU buffer is filled by a generator on its device, seeded
    from the host's. A lock makes one codec safe to share between threads.
    """

    def __init__(self, seed: int | None) -> None:
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        elif type(seed) is not int or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        self._generator = torch.Generator()
        self._generator.manual_seed(seed)
        self._on_devices: dict[torch.device, torch.Generator] = {}
        self._lock = threading.Lock()

    def fill(self, buffer: torch.Tensor) -> torch.Tensor:
        with self._lock:
            generator = self._generator
            if buffer.device.type != "cpu":
                generator = self._on_devices.get(buffer.device)  # type: ignore[assignment]
                if generator is None:
                    generator = self._on_devices[buffer.device] = torch.Generator(buffer.device)
                    generator.manual_seed(int(torch.randint(1 << 62, (1,), generator=self._generator)))
            return buffer.uniform_(0.0, 1.0, generator=generator)



# --------------------------------------------------------------------------- decoding


def read_f32(view: memoryview, offset: int, count: int) -> np.ndarray:
    """``count`` little-endian fp32 values at ``offset``, as a new native array."""
    return np.frombuffer(view, dtype=F32, count=count, offset=offset).astype(np.float32)


def _check_scales(codec: Codec, scales: np.ndarray, max_scale: float) -> None:
    if not np.isfinite(scales).all():
        raise PayloadRejected(Reason.NON_FINITE, f"{codec.name}: non-finite scale")
    if (scales > np.float32(max_scale)).any():
        raise PayloadRejected(Reason.NON_FINITE, f"{codec.name}: scale {float(scales.max()):g} would overflow fp32")
    if np.signbit(scales).any():
        raise PayloadRejected(Reason.BAD_HEADER, f"{codec.name}: negative scale")


def check_padding(codec: Codec, view: memoryview, bits: int, numel: int) -> None:
    if not padding_bits_clear(view, bits, numel):
        raise PayloadRejected(Reason.BAD_DTYPE, f"{codec.name}: non-zero padding bits")


def packed_chunk(view: memoryview, offset: int, bits: int, start: int, stop: int) -> np.ndarray:
    """Read-only uint8 array of the packed codes of values ``start:stop`` (start % 8 == 0)."""
    return np.frombuffer(view, dtype=np.uint8, count=packed_size(stop - start, bits),
                         offset=offset + start * bits // 8)


def byte_table(values: np.ndarray, bits: int) -> np.ndarray:
    """(256, 8 // bits) fp32 table: row ``b`` holds the values of the codes packed in byte ``b``."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    byte = np.arange(256)
    codes = np.stack([(byte >> (bits * j)) & mask for j in range(per_byte)], axis=1)
    return values.astype(np.float32)[codes]


def take_bytes(table: np.ndarray, packed: np.ndarray, out: np.ndarray) -> None:
    """``out`` = the values of ``out.size`` codes packed in ``packed``, via a byte table."""
    per_byte = table.shape[1]
    full = out.size // per_byte
    if full:
        np.take(table, packed[:full], axis=0, out=out[: full * per_byte].reshape(full, per_byte), mode="clip")
    if out.size > full * per_byte:
        out[full * per_byte :] = table[packed[full], : out.size - full * per_byte]


def decode_table(codec: Codec, view: memoryview, numel: int, head: int, bits: int, table: np.ndarray,
                  scales: torch.Tensor | None, block: int, reason: Reason, what: str,
                  device: torch.device | None = None) -> torch.Tensor:
    """Decode ``numel`` packed codes after ``head`` header bytes: a byte-table look-up,
    then (when ``scales`` is given) one fp32 multiply by each value's block scale.

    Table entries that must never be received are NaN; one ``aminmax`` over the
    result then rejects them with ``reason`` (finite entries times checked scales
    cannot overflow). On a GPU (``device``) the packed codes cross to it and are
    looked up there: the same table entries times the same scales, the same bits.
    """
    if device is not None and whole(device):
        return _decode_table_on(device, codec, view, numel, head, bits, table, scales, block, reason, what)
    out = np.empty(numel, dtype=np.float32)
    result = torch.from_numpy(out)
    for start, stop in chunks(numel):
        take_bytes(table, packed_chunk(view, head, bits, start, stop), out[start:stop])
        if scales is not None:
            o = result[start:stop]
            blockwise(torch.mul, o, scales[start // block :], block, o)
    require_finite_output(codec, result, reason, what)
    return result


def _decode_table_on(device: torch.device, codec: Codec, view: memoryview, numel: int, head: int, bits: int,
                     table: np.ndarray, scales: torch.Tensor | None, block: int, reason: Reason,
                     what: str) -> torch.Tensor:
    """`decode_table` on ``device``: the codes unpacked there, each looked up in the per-code table (column 0 of
    the byte table's first ``2**bits`` rows: byte ``b < 2**bits`` holds code ``b`` first)."""
    packed = wire_bytes(view, head, packed_size(numel, bits), device)
    codes = packed if bits == 8 else unpack_codes(packed, bits, numel)
    values = torch.from_numpy(np.ascontiguousarray(table[: 1 << bits, 0])).to(device)
    result = values[codes.long()]
    if scales is not None:
        blockwise(torch.mul, result, scales.to(device), block, result)
    require_finite_output(codec, result, reason, what)
    return result


def require_finite_output(codec: Codec, out: torch.Tensor, reason: Reason, what: str) -> None:
    if not all_finite(out):
        raise PayloadRejected(reason, f"{codec.name}: {what}")


def empty(device: torch.device | None = None) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)



# --------------------------------------------------------------------------- the codec layout


class BlockScaledCodec(Codec):
    """A codec whose payload is ``[fp32 scale per block][bits-bit codes, packed]``.

    Subclasses set ``block`` (0: one scale per tensor), ``bits`` (the code width)
    and ``_max_scale`` (the largest scale a decoder accepts), write payloads with
    :meth:`_new_payload`, and implement :meth:`_decode_codes`; :meth:`decode`
    runs the checks every such decoder needs first, in this order: exact size
    (``WRONG_SIZE``), the empty tensor, scales (``NON_FINITE`` / ``BAD_HEADER``),
    padding bits (``BAD_DTYPE``).
    """

    block: int
    bits: int
    _max_scale: float

    def _blocks(self, numel: int) -> int:
        """How many scales ``numel`` values carry."""
        if self.block == 0:
            return min(numel, 1)
        return -(-numel // self.block)

    def encoded_size(self, numel: int) -> int:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return 4 * self._blocks(numel) + packed_size(numel, self.bits)

    def _begin(self, x: torch.Tensor, top: float | None) -> tuple[np.ndarray, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor | None]:
        """Start the payload of ``x``: its block scales ``absmax / top`` (``absmax`` itself when ``top`` is None),
        which map each block's largest value onto code magnitude ``top``, clamped to ``_max_scale`` so ``top * s``
        stays finite. Returns (the payload in host memory, :func:`.codecs.payload_buffer`, its scales written;
        where the codes go, on ``x``'s device; the divisors per block there, :func:`safe`; the staged payload to
        pass to :meth:`_finish`). Raises ``ValueError`` for non-finite input (on a GPU, at :meth:`_finish`).

        On a GPU (:func:`.codecs.whole`) the scales are formed there with the same fp32 division and clamp, a NaN
        scale marking a block that holds NaN or inf, and written into a staging buffer of the whole payload that
        crosses to the host at once: the encoder waits for the device once, not first for its scales."""
        n, block = x.numel(), self.block or x.numel()
        if not whole(x.device):
            scales = block_absmax(x, block)
            if top is not None:
                scales = np.asarray(np.minimum(np.divide(scales, np.float32(top), dtype=np.float32),
                                               np.float32(self._max_scale)), dtype=np.float32)
            head = 4 * scales.size
            out = payload_buffer(self.encoded_size(n), x.device)
            out[:head].view(F32)[:] = scales
            return out, torch.from_numpy(out[head:]), safe(torch.from_numpy(scales)), None
        absmax = device_absmax(x, block)
        # a divisor on the device: CUDA divides by a host scalar as a multiply by its reciprocal (an ulp off)
        fitted = absmax if top is None else \
            torch.div(absmax, torch.full((), top, dtype=torch.float32, device=x.device)).clamp_(max=self._max_scale)
        marked = torch.where(torch.isfinite(absmax), fitted, torch.nan)
        out = payload_buffer(self.encoded_size(n), x.device)
        staged = torch.empty(out.size, dtype=torch.uint8, device=x.device)
        head = 4 * marked.numel()
        staged[:head].view(torch.float32).copy_(marked)
        return out, staged[head:], safe(marked), staged

    def _finish(self, out: np.ndarray, staged: torch.Tensor | None, numel: int) -> memoryview:
        """The payload :meth:`_begin` started, its codes written: from a GPU its one crossing to the host, after
        which its scales say whether the input held NaN or inf."""
        if staged is not None:
            torch.from_numpy(out).copy_(staged)
            if not np.isfinite(np.frombuffer(out, dtype=F32, count=self._blocks(numel))).all():
                raise ValueError(NON_FINITE_INPUT)
        return landed(out)

    def _chunk_scales(self, scales: torch.Tensor, numel: int) -> tuple[int, torch.Tensor]:
        """(block, per-block scales) to use chunk by chunk; a per-tensor scale is
        repeated over virtual blocks of CHUNK values."""
        if self.block:
            return self.block, scales
        return CHUNK, scales.expand(-(-numel // CHUNK))

    def decode(self, payload: bytes | bytearray | memoryview, numel: int,
               device: torch.device | None = None) -> torch.Tensor:
        view = byte_view(payload)
        expect_size(self, view, numel)
        if numel == 0:
            return empty(device)
        scales = read_f32(view, 0, self._blocks(numel))
        _check_scales(self, scales, self._max_scale)
        if self.bits < 8:
            check_padding(self, view, self.bits, numel)
        return self._decode_codes(view, numel, scales, device)

    @abc.abstractmethod
    def _decode_codes(self, view: memoryview, numel: int, scales: np.ndarray,
                      device: torch.device | None) -> torch.Tensor:
        """Decode the codes that follow the (checked) ``scales`` in ``view``, on ``device`` (the host when None)."""
