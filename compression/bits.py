"""Bit packing: small unsigned integers in, a dense little-endian bit stream out.

Quantizers produce one small code per value (2 bits for ``q2``, 4 for ``q4`` and
``e3m0``, ...). :func:`pack_bits` lays those codes out back to back in a single
*LSB-first* bit stream: value ``i`` occupies stream bits ``[i*bits, (i+1)*bits)``,
its least significant bit first, and stream bit ``k`` is bit ``k % 8`` of byte
``k // 8``. For 4-bit codes that means byte ``j`` holds value ``2j`` in its low
nibble and value ``2j+1`` in its high nibble; for 12-bit codes, values ``2j`` and
``2j+1`` form the little-endian 24-bit word ``v[2j] | v[2j+1] << 12``. The last
byte's unused high bits (the *padding*) are always zero when packing;
:func:`padding_bits_clear` lets a decoder insist on that, so every valid stream
has exactly one encoding.

Supported widths: :data:`SUPPORTED_BITS` = 1..8 and 12. Widths that divide 8 are
packed with a few whole-array byte operations (one per value in a byte); the
others go through 64-bit words holding ``8 / gcd(bits, 8)`` values each. Either
way the work is vectorized: a fixed number of tensor operations, never a Python
loop over elements.

The byte-level functions (:func:`pack_bits`, :func:`unpack_bits`) are the public
format; :func:`pack_bits_tensor` and :func:`unpack_bits_tensor` do the same on
``uint8`` tensors so that codecs can pack chunk by chunk without extra copies.
Misuse (an unsupported width, a value out of range, a byte count that does not
match ``count``) raises ``ValueError``/``TypeError``: these are local calls; the
codecs check sizes from the wire before they get here.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
import torch

__all__ = [
    "SUPPORTED_BITS",
    "packed_size",
    "pack_bits",
    "unpack_bits",
    "pack_bits_tensor",
    "pack_codes",
    "unpack_codes",
    "unpack_bits_tensor",
    "padding_bits_clear",
]

SUPPORTED_BITS: Final[tuple[int, ...]] = (1, 2, 3, 4, 5, 6, 7, 8, 12)
"""Code widths :func:`pack_bits` accepts."""

_INTEGER_DTYPES: Final[frozenset[torch.dtype]] = frozenset(
    {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)


def _check_bits(bits: int) -> None:
    if type(bits) is not int or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def _check_count(count: int) -> None:
    if type(count) is not int or count < 0:
        raise ValueError(f"count must be a non-negative int, got {count!r}")


def packed_size(count: int, bits: int) -> int:
    """Bytes needed for ``count`` values of ``bits`` bits: ``ceil(count * bits / 8)``."""
    _check_bits(bits)
    _check_count(count)
    return (count * bits + 7) // 8


def _group(bits: int) -> tuple[int, int]:
    """(values, bytes) in the smallest run of values that ends on a byte boundary."""
    values = 8 // math.gcd(bits, 8)
    return values, values * bits // 8


def pack_bits_tensor(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``values`` (each in ``[0, 2**bits)``) into a new 1-D uint8 tensor.

    ``values`` may have any shape (it is read in row-major order) and any integer
    dtype; out-of-range values raise ``ValueError``.
    """
    _check_bits(bits)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(values).__name__}")
    if values.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"expected an integer tensor, got {values.dtype}")
    flat = values.detach().cpu().reshape(-1)
    count = flat.numel()
    if count == 0:
        return torch.empty(0, dtype=torch.uint8)
    if not (flat.dtype == torch.uint8 and bits == 8):
        low, high = torch.aminmax(flat)
        if int(low) < 0 or int(high) >= 1 << bits:
            raise ValueError(f"values must lie in [0, {1 << bits}) for {bits}-bit packing, "
                             f"got range [{int(low)}, {int(high)}]")
    if bits == 8:
        return flat.to(torch.uint8, copy=True)
    return pack_codes(flat.to(torch.uint8 if 8 % bits == 0 else torch.int64), bits)


def pack_codes(flat: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D tensor of codes already known to lie in ``[0, 2**bits)`` into a new uint8 tensor on the same
    device (the codecs' own packing: no range check, no copy to the host): uint8 codes for ``bits`` dividing 8,
    int64 codes in little-endian words of whole bytes for the others (12 bits: two codes in three bytes)."""
    if 8 % bits:
        return _pack_words(flat, bits)
    per_byte = 8 // bits
    count = flat.numel()
    full = count // per_byte
    out = torch.empty(packed_size(count, bits), dtype=torch.uint8, device=flat.device)
    if full:
        columns = flat[: full * per_byte].view(full, per_byte)
        body = out[:full]
        body.copy_(columns[:, 0])
        for j in range(1, per_byte):  # one pass per value in a byte, not per element
            body.bitwise_or_(columns[:, j] << (bits * j))
    rest = flat[full * per_byte :]
    if rest.numel():
        shifts = torch.arange(rest.numel(), dtype=torch.int64, device=flat.device) * bits
        out[full] = (rest.to(torch.int64) << shifts).sum()  # < 256: fits the byte
    return out


def _pack_words(flat: torch.Tensor, bits: int) -> torch.Tensor:
    per_group, group_bytes = _group(bits)
    count = flat.numel()
    groups = -(-count // per_group)
    padded = torch.zeros(groups * per_group, dtype=torch.int64, device=flat.device)
    padded[:count] = flat
    columns = padded.view(groups, per_group)
    word = columns[:, 0].clone()
    for j in range(1, per_group):
        word.bitwise_or_(columns[:, j] << (bits * j))
    out = torch.empty(groups, group_bytes, dtype=torch.uint8, device=flat.device)
    for k in range(group_bytes):
        out[:, k] = (word >> (8 * k)) & 0xFF
    return out.view(-1)[: packed_size(count, bits)].clone()


def unpack_bits_tensor(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits_tensor`: ``count`` values from a 1-D uint8 tensor.

    Returns a new tensor, ``uint8`` for ``bits <= 8`` and ``int64`` for wider
    codes. ``packed`` must hold exactly ``packed_size(count, bits)`` bytes
    (``ValueError`` otherwise); padding bits are ignored (see
    :func:`padding_bits_clear`).
    """
    _check_bits(bits)
    _check_count(count)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError("expected a 1-D uint8 tensor of packed bytes")
    expected = packed_size(count, bits)
    if packed.numel() != expected:
        raise ValueError(f"{count} values of {bits} bits need {expected} bytes, got {packed.numel()}")
    out_dtype = torch.uint8 if bits <= 8 else torch.int64
    if count == 0:
        return torch.empty(0, dtype=out_dtype)
    if bits == 8:
        return packed.clone()
    return unpack_codes(packed, bits, count).to(out_dtype)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """``count`` codes of ``bits`` bits from a 1-D uint8 tensor holding exactly their packed bytes, as a new tensor
    on the same device (the codecs' own unpacking: sizes are checked before): uint8 for ``bits`` dividing 8, int64
    for the others (:func:`pack_codes`' words)."""
    if 8 % bits:
        return _unpack_words(packed, bits, count)
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    out = torch.empty(packed.numel(), per_byte, dtype=torch.uint8, device=packed.device)
    for j in range(per_byte):
        torch.bitwise_and(packed >> (bits * j), mask, out=out[:, j])
    flat = out.view(-1)
    return flat if flat.numel() == count else flat[:count].clone()


def _unpack_words(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    per_group, group_bytes = _group(bits)
    groups = -(-count // per_group)
    padded = torch.zeros(groups * group_bytes, dtype=torch.int64, device=packed.device)
    padded[: packed.numel()] = packed
    columns = padded.view(groups, group_bytes)
    word = columns[:, 0].clone()
    for k in range(1, group_bytes):
        word.bitwise_or_(columns[:, k] << (8 * k))
    mask = (1 << bits) - 1
    out = torch.empty(groups, per_group, dtype=torch.int64, device=packed.device)
    for j in range(per_group):
        out[:, j] = (word >> (bits * j)) & mask
    flat = out.view(-1)
    return flat if flat.numel() == count else flat[:count].clone()


def pack_bits(values: torch.Tensor, bits: int) -> bytes:
    """Pack integer ``values`` (each in ``[0, 2**bits)``) LSB-first into bytes."""
    return pack_bits_tensor(values, bits).numpy().tobytes()


def unpack_bits(data: bytes | bytearray | memoryview, bits: int, count: int) -> torch.Tensor:
    """Unpack ``count`` values of ``bits`` bits from ``data`` (exactly
    ``packed_size(count, bits)`` bytes) into a new uint8 (``bits <= 8``) or int64
    tensor. Never aliases ``data``."""
    _check_bits(bits)
    _check_count(count)
    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
    expected = packed_size(count, bits)
    if view.nbytes != expected:
        raise ValueError(f"{count} values of {bits} bits need {expected} bytes, got {view.nbytes}")
    packed = torch.from_numpy(np.frombuffer(view, dtype=np.uint8).copy())
    return unpack_bits_tensor(packed, bits, count)


def padding_bits_clear(data: bytes | bytearray | memoryview, bits: int, count: int) -> bool:
    """True when the unused high bits of the last byte of a packed stream are zero.

    ``data`` is the packed stream (or any buffer ending with it); an empty stream
    or one that ends on a byte boundary has no padding.
    """
    _check_bits(bits)
    _check_count(count)
    used = (count * bits) % 8
    if used == 0:
        return True
    view = memoryview(data)
    if view.nbytes == 0:
        return False
    return (view.cast("B")[-1] >> used) == 0
