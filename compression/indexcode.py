"""Index codecs: how a chunked top-k selection becomes body bytes and back.

A sparse message carries *which* entries were kept as well as their values.
The selections of :mod:`.sparse` have a rigid shape -- strictly ascending
global indices with exactly ``spec.counts(numel)[c]`` of them in chunk ``c`` --
so an index codec only has to store each index *relative to its chunk*
(``local = index - c * spec.chunk``), chunk after chunk; the counts, and so
the chunk boundaries, are implied by ``(numel, spec)``, which the frame
header carries. Two codecs are provided (:data:`INDEX_CODECS`):

* ``idx12`` (:class:`Packed12`) -- every local index in 12 bits; needs
  ``spec.chunk <= 4096``. Indices are taken in order and packed in pairs
  ``(a, b)`` into the 24-bit little-endian word ``a | b << 12``, i.e. three
  bytes ``a & 0xFF, (a >> 8) | (b & 0xF) << 4, b >> 4``. An odd final index
  is written as the 16-bit little-endian word ``a`` whose top four (padding)
  bits must be zero. The size is exactly ``ceil(12 * kept / 8)`` bytes.

* ``rice`` (:class:`RiceGaps`) -- Rice-coded gaps: 7.56 bits per index for
  uniformly spread ``k = 64`` of ``C = 4096`` (7.50 for the gaps plus 4/64 for
  the chunk's parameter; the information bound is
  ``log2 binom(4096, 64) / 64 = 7.36``) against 12 for ``idx12``. In each
  chunk the sorted local indices ``l_0 < l_1 < ...`` become gaps
  ``g_0 = l_0, g_i = l_i - l_{i-1} - 1 >= 0``, and each gap is split by the
  chunk's Rice parameter ``r`` into a quotient ``q = g >> r`` (sent in unary)
  and ``r`` low bits. The encoder picks, per chunk, the ``r`` in ``0..15``
  that minimises the chunk's exact bit count (smallest ``r`` on a tie); the
  decoder accepts any ``r`` in ``0..15``.

Rice bit layout. The payload is one bit stream, **LSB-first**: stream bit
``i`` is bit ``i % 8`` of byte ``i // 8``, and every multi-bit field is
written least-significant bit first. It has three sections, one after the
other, so that both directions are vectorised (cumulative sums give every
field's position; no per-index or per-chunk Python loop): the encoder in tensor
operations where the indices are (a GPU's selection is coded there, as it is
for ``idx12``), the decoder likewise where the caller wants the indices (a GPU receives the bytes
and decodes them there)::

    section      bits                    content
    parameters   4 * n_chunks            r of chunk 0, chunk 1, ... (4 bits each)
    remainders   sum over indices of r   g & (2**r - 1) of every index, in order
    quotients    sum over indices of q+1 q zeros then a one, for every index
    padding      0..7                    zero bits up to the byte boundary

The remainder section's length follows from the parameters and the implied
counts, so the decoder reads it directly; the quotients are found as the
positions of the first ``kept`` one-bits of the last section.

Decoding treats the payload as hostile and raises :class:`PayloadRejected`
and nothing else for a well-typed call (bytes-like payload, ``int`` numel,
:class:`~.sparse.ChunkSpec`). ``numel`` is validated and the payload size is
compared with bounds computed from ``(numel, spec)`` *before* anything is
allocated, so every allocation is at most a small multiple of the payload
already in memory. Reasons:

=============  ==========================================================
WRONG_SIZE     negative/non-int ``numel``; ``idx12`` byte count not exactly
               ``ceil(12 * kept / 8)``; nonzero padding bits; ``rice``
               payload above its maximum size, or extra one-bits or bytes
               after the last index (trailing garbage)
TRUNCATED      ``rice`` stream ends before all ``kept`` indices are read
BAD_HEADER     an index outside its chunk (or beyond ``numel``), indices
               out of order, a unary quotient larger than the chunk allows,
               or a spec the codec cannot carry (``idx12`` with chunk > 4096)
DUPLICATE      the same index twice in a chunk (``idx12``; Rice gaps are
               non-negative by construction, so it cannot express one)
=============  ==========================================================

The decoded tensor is a new ``int64`` tensor, never aliasing the payload, in
exactly the form :func:`~.sparse.topk_select` returns, on the ``device`` asked
for (host memory by default): only the payload's bytes cross to a GPU, and
decoding waits for it three times (``idx12`` once) to read the sizes and the verdict.
The checks above run on the device all the same. Encoding is a pure
function of the indices, and decoding of the bytes; changing either layout
changes bytes on the wire and requires a protocol version bump.
"""

from __future__ import annotations

from typing import Final, Protocol, runtime_checkable

import torch

from .bits import pack_codes, unpack_codes
from .codecs import byte_view, host_bytes, wire_bytes
from .errors import PayloadRejected, Reason
from .sparse import ChunkSpec

__all__ = [
    "IndexCodec",
    "Packed12",
    "RiceGaps",
    "INDEX_CODECS",
    "get_index_codec",
    "decode_indices",
]

PACKED12_MAX_CHUNK: Final[int] = 4096
"""Largest chunk whose local indices fit the 12 bits of ``idx12``."""

RICE_MAX_PARAMETER: Final[int] = 15
"""Rice parameters are stored in 4 bits: 0..15."""


@runtime_checkable
class IndexCodec(Protocol):
    """Encodes the chunked, sorted global indices of a selection into bytes."""

    name: str
    """Wire name, as recorded by the caller next to ``numel`` and the spec."""

    def max_encoded_size(self, numel: int, spec: ChunkSpec) -> int:
        """Upper bound on the payload length (for a receiver's size limit)."""
        ...

    def encode(self, indices: torch.Tensor, numel: int, spec: ChunkSpec) -> bytes | memoryview:
        """Encode ``indices`` shaped as :func:`~.sparse.topk_select` returns them.

        Raises ``TypeError``/``ValueError`` if they are not (local misuse)."""
        ...

    def decode(self, payload: bytes | bytearray | memoryview, numel: int, spec: ChunkSpec,
               device: torch.device | None = None) -> torch.Tensor:
        """Decode into a new 1-D ``int64`` tensor of ``spec.kept(numel)`` validated
        global indices on ``device`` (host memory when None); raises :class:`PayloadRejected` and nothing else."""
        ...


# --------------------------------------------------------------------------- shared helpers


def _check_spec(spec: ChunkSpec) -> None:
    if not isinstance(spec, ChunkSpec):
        raise TypeError(f"expected a ChunkSpec, got {type(spec).__name__}")


def _wire_shape(name: str, numel: int, spec: ChunkSpec) -> tuple[int, int]:
    """``(n_chunks, kept)`` for a ``numel`` that came off the wire (pure arithmetic)."""
    _check_spec(spec)
    if type(numel) is not int or numel < 0:
        raise PayloadRejected(Reason.WRONG_SIZE, f"{name}: invalid element count {numel!r}")
    return spec.n_chunks(numel), spec.kept(numel)


class _Layout:
    """Per-chunk bookkeeping derived from ``(numel, spec)`` only (never from the wire), on the decoder's device."""

    def __init__(self, numel: int, spec: ChunkSpec, device: torch.device) -> None:
        self.kept = spec.kept(numel)
        self.counts = spec.counts(numel).to(device)  # kept per chunk, all >= 1
        n = len(self.counts)
        self.starts = torch.cumsum(self.counts, 0) - self.counts  # first position of each chunk
        self.chunk = spec.chunk
        short = numel - (n - 1) * spec.chunk  # the last chunk's length
        self.lengths = torch.full((n,), spec.chunk, dtype=torch.int64, device=device)  # elements per chunk
        self.lengths[n - 1 :] = short
        # every chunk but a short last one keeps spec.k, so index i is in chunk i // k
        self.chunk_of = torch.arange(n, device=device)[:, None].expand(n, spec.k).reshape(-1)[: self.kept]
        self.index_lengths = torch.full((self.kept,), spec.chunk, dtype=torch.int64, device=device)  # of its chunk
        self.index_lengths[(n - 1) * spec.k :] = short

    def per_index(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-chunk tensor to one entry per kept index (no wait for a GPU)."""
        return per_chunk[self.chunk_of]

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        return local + self.chunk_of * self.chunk


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


NONZERO_PIECE: Final[int] = 1 << 30
"""Bits searched for ones at a time: torch before 2.6 cannot take `nonzero` of more than 2**31 - 1 elements on a GPU."""


def _ones(bits: torch.Tensor) -> torch.Tensor:
    """The positions of the one-bits of `bits` (int64), in order."""
    if len(bits) <= NONZERO_PIECE:
        return torch.nonzero(bits).squeeze(1)
    return torch.cat([torch.nonzero(bits[i : i + NONZERO_PIECE]).squeeze(1) + i
                      for i in range(0, len(bits), NONZERO_PIECE)])


def _local_indices(name: str, indices: torch.Tensor, numel: int, spec: ChunkSpec) -> torch.Tensor:
    """Validate an encode() argument; return its chunk-local indices, on its device (two waits for a GPU)."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int64 or indices.dim() != 1:
        raise TypeError(f"{name}: expected a 1-D int64 tensor, got {indices.dtype} of shape {tuple(indices.shape)}")
    _check_spec(spec)
    kept = spec.kept(numel)  # also checks numel
    if indices.numel() != kept:
        raise ValueError(f"{name}: {spec} over {numel} elements keeps {kept} indices, got {indices.numel()}")
    idx = indices.detach()
    if kept == 0:
        return idx.clone()
    bad = (idx[0] < 0) | (idx[-1] >= numel)
    if kept > 1:
        bad |= (idx[1:] <= idx[:-1]).any()
    if bool(bad):
        raise ValueError(f"{name}: indices must be strictly ascending within [0, {numel})")
    chunk_of = idx // spec.chunk
    if not torch.equal(torch.bincount(chunk_of, minlength=spec.n_chunks(numel)).cpu(), spec.counts(numel)):
        raise ValueError(f"{name}: indices must hold exactly {spec.k} per chunk (fewer only in a short last chunk)")
    return idx - chunk_of * spec.chunk


# --------------------------------------------------------------------------- idx12


class Packed12:
    """Chunk-local indices, 12 bits each, two per three bytes (``chunk <= 4096``)."""

    name = "idx12"
    bits_per_index = 12.0

    def encoded_size(self, numel: int, spec: ChunkSpec) -> int:
        """Exact payload length: ``ceil(12 * spec.kept(numel) / 8)`` bytes."""
        return (12 * spec.kept(numel) + 7) // 8

    def max_encoded_size(self, numel: int, spec: ChunkSpec) -> int:
        return self.encoded_size(numel, spec)

    def encode(self, indices: torch.Tensor, numel: int, spec: ChunkSpec) -> bytes | memoryview:
        _check_spec(spec)
        if spec.chunk > PACKED12_MAX_CHUNK:
            raise ValueError(f"idx12 needs spec.chunk <= {PACKED12_MAX_CHUNK}, got {spec.chunk}; use 'rice'")
        local = _local_indices(self.name, indices, numel, spec)  # where the indices are: only the bytes cross
        return host_bytes(pack_codes(local, 12)) if local.numel() else b""  # bits.py's 12-bit layout

    def decode(self, payload: bytes | bytearray | memoryview, numel: int, spec: ChunkSpec,
               device: torch.device | None = None) -> torch.Tensor:
        view = byte_view(payload)
        _, kept = _wire_shape(self.name, numel, spec)
        if spec.chunk > PACKED12_MAX_CHUNK:
            raise PayloadRejected(Reason.BAD_HEADER,
                                  f"idx12 cannot carry chunks of {spec.chunk} > {PACKED12_MAX_CHUNK}")
        expected = (12 * kept + 7) // 8
        if view.nbytes != expected:
            raise PayloadRejected(Reason.WRONG_SIZE, f"idx12: {kept} indices need {expected} bytes, got {view.nbytes}")
        where = _device(device)
        if kept == 0:
            return torch.empty(0, dtype=torch.int64, device=where)
        if kept % 2 and view[expected - 1] >> 4:  # the top half of an odd final pair
            raise PayloadRejected(Reason.WRONG_SIZE, "idx12: nonzero padding bits after the last index")
        local = unpack_codes(wire_bytes(view, 0, expected, where), 12, kept)
        layout = _Layout(numel, spec, where)
        step = torch.diff(local)
        step[layout.starts[1:] - 1] = 1  # a new chunk restarts the order
        verdict = torch.stack([(local >= layout.index_lengths).any(), (step < 0).any(), (step == 0).any()])
        outside, descending, duplicate = verdict.tolist()  # the one wait for a GPU
        if outside:
            raise PayloadRejected(Reason.BAD_HEADER, "idx12: index outside its chunk")
        if descending:
            raise PayloadRejected(Reason.BAD_HEADER, "idx12: indices not ascending within a chunk")
        if duplicate:
            raise PayloadRejected(Reason.DUPLICATE, "idx12: the same index twice in a chunk")
        return layout.to_global(local)

    def __repr__(self) -> str:
        return "<index codec idx12: 12 bits/index>"


# --------------------------------------------------------------------------- rice


def _rice_max_bits(numel: int, spec: ChunkSpec) -> int:
    """Largest valid stream: per chunk the quotients sum to at most
    ``sum(gaps) <= length - count``, plus ``1 + r <= 16`` bits per index."""
    n, kept = spec.n_chunks(numel), spec.kept(numel)
    return 4 * n + numel + RICE_MAX_PARAMETER * kept


class RiceGaps:
    """Per-chunk Rice-coded gaps between sorted local indices (see module docstring)."""

    name = "rice"

    def max_encoded_size(self, numel: int, spec: ChunkSpec) -> int:
        return (_rice_max_bits(numel, spec) + 7) // 8

    def encode(self, indices: torch.Tensor, numel: int, spec: ChunkSpec) -> bytes | memoryview:
        """The stream, built where the indices are (on a GPU only the packed bytes cross to the host): each byte the
        sum of what the fields put in it (their bits are their own); three waits for a GPU (two validating the
        indices, one for the stream's length)."""
        local = _local_indices(self.name, indices, numel, spec)
        kept, n = local.numel(), spec.n_chunks(numel)
        if kept == 0:
            return b""
        device = local.device
        counts = spec.counts(numel).to(device)
        starts = torch.cumsum(counts, 0) - counts
        gaps = torch.empty_like(local)
        gaps[0] = local[0]
        gaps[1:] = local[1:] - local[:-1] - 1
        gaps[starts] = local[starts]

        # Exact cost of every parameter for every chunk; argmin keeps the smallest r on ties. Chunk c's gaps are
        # row c: every chunk but a short last one keeps spec.k, so the rows are padded (with zero gaps) at the end.
        rows = torch.zeros(n * spec.k, dtype=torch.int64, device=device)
        rows[:kept] = gaps
        rows = rows.view(n, spec.k)
        parameters = torch.arange(RICE_MAX_PARAMETER + 1, device=device)
        cost = torch.stack([(rows >> r).sum(1) for r in range(RICE_MAX_PARAMETER + 1)])
        r_chunk = (cost + counts * (1 + parameters[:, None])).argmin(0)
        r_idx = torch.repeat_interleave(r_chunk, counts, output_size=kept)
        quotient = gaps >> r_idx
        remainder = gaps & ((torch.ones_like(r_idx) << r_idx) - 1)
        sum_r, sum_q = torch.stack([r_idx.sum(), quotient.sum()]).tolist()

        # Every field's bits are its own, so each byte is the sum of what the fields put in it.
        rem_start = 4 * n
        unary_start = rem_start + sum_r
        nbytes = -(-(unary_start + sum_q + kept) // 8)
        out = torch.zeros(nbytes + 2, dtype=torch.int32, device=device)  # + 2: the last remainder's window
        chunks = torch.arange(n, device=device)  # the parameters from bit 0, two a byte, low nibble first
        out.index_add_(0, chunks >> 1, (r_chunk << ((chunks & 1) * 4)).to(torch.int32))
        position = rem_start + torch.cumsum(r_idx, 0) - r_idx  # a remainder's r <= 15 bits: within 3 bytes
        shifted = remainder << (position & 7)
        for k in range(3):
            out.index_add_(0, (position >> 3) + k, ((shifted >> (8 * k)) & 0xFF).to(torch.int32))
        ones = unary_start + torch.cumsum(quotient + 1, 0) - 1  # each quotient's terminating one
        out.index_add_(0, ones >> 3, (torch.ones_like(ones) << (ones & 7)).to(torch.int32))
        return host_bytes(out[:nbytes].to(torch.uint8))

    def decode(self, payload: bytes | bytearray | memoryview, numel: int, spec: ChunkSpec,
               device: torch.device | None = None) -> torch.Tensor:
        view = byte_view(payload)
        n, kept = _wire_shape(self.name, numel, spec)
        nbytes = view.nbytes
        where = _device(device)
        if kept == 0:
            if nbytes:
                raise PayloadRejected(Reason.WRONG_SIZE, f"rice: no indices expected, got {nbytes} bytes")
            return torch.empty(0, dtype=torch.int64, device=where)
        # Size bounds from (numel, spec) before anything is allocated.
        if 8 * nbytes < 4 * n + kept:
            raise PayloadRejected(Reason.TRUNCATED, f"rice: {nbytes} bytes cannot hold {kept} indices")
        limit = self.max_encoded_size(numel, spec)
        if nbytes > limit:
            raise PayloadRejected(Reason.WRONG_SIZE, f"rice: {nbytes} bytes exceed the maximum {limit}")

        raw = torch.zeros(nbytes + 2, dtype=torch.uint8, device=where)  # + 2: the last remainder's window
        raw[:nbytes] = wire_bytes(view, 0, nbytes, where)
        layout = _Layout(numel, spec, where)
        r_chunk = unpack_codes(raw[: (n + 1) // 2], 4, n).to(torch.int64)  # 4-bit codes from bit 0
        r_idx = layout.per_index(r_chunk)
        rem_start = 4 * n
        unary_start = rem_start + int(r_idx.sum())  # the first wait for a GPU
        if unary_start + kept > 8 * nbytes:
            raise PayloadRejected(Reason.TRUNCATED, "rice: stream ends inside the remainders")

        # A remainder of r <= 15 bits from bit p lies in the 24-bit little-endian window of bytes p // 8 .. + 2.
        position = rem_start + torch.cumsum(r_idx, 0) - r_idx
        at = position >> 3
        window = raw[at].to(torch.int64) | (raw[at + 1].to(torch.int64) << 8) | (raw[at + 2].to(torch.int64) << 16)
        remainder = (window >> (position & 7)) & ((torch.ones_like(r_idx) << r_idx) - 1)

        unary = raw[unary_start >> 3 : nbytes]
        unary = unpack_codes(unary, 1, 8 * len(unary))[unary_start & 7 :]
        ones = _ones(unary)  # its size: the second wait
        if len(ones) < kept:
            raise PayloadRejected(Reason.TRUNCATED, f"rice: stream ends after {len(ones)} of {kept} indices")
        if len(ones) > kept:
            raise PayloadRejected(Reason.WRONG_SIZE, "rice: one-bits after the last index (trailing garbage)")
        quotient = torch.diff(ones, prepend=ones.new_full((1,), -1)) - 1
        step = ((quotient << r_idx) | remainder) + 1  # gap + 1: local_i - local_{i-1}
        running = torch.cumsum(step, 0)
        before_chunk = running[layout.starts] - step[layout.starts]
        local = running - layout.per_index(before_chunk) - 1
        last = local[layout.starts + layout.counts - 1]
        verdict = torch.stack([ones[-1], (quotient > (layout.index_lengths - 1) >> r_idx).any(),
                               (last >= layout.lengths).any()])
        last_one, long_run, outside = verdict.tolist()
        needed = -(-(unary_start + last_one + 1) // 8)
        if needed != nbytes:
            raise PayloadRejected(Reason.WRONG_SIZE, f"rice: {nbytes - needed} trailing bytes after the last index")
        if long_run:
            raise PayloadRejected(Reason.BAD_HEADER, "rice: unary run longer than the chunk allows")
        if outside:
            raise PayloadRejected(Reason.BAD_HEADER, "rice: index outside its chunk")
        return layout.to_global(local)

    def __repr__(self) -> str:
        return "<index codec rice: Rice-coded gaps>"


# --------------------------------------------------------------------------- registry


INDEX_CODECS: Final[dict[str, IndexCodec]] = {"idx12": Packed12(), "rice": RiceGaps()}
"""Index codecs by wire name."""


def get_index_codec(name: str) -> IndexCodec:
    """Return the index codec called ``name`` (local configuration: ``ValueError`` if unknown)."""
    codec = INDEX_CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ValueError(f"unknown index codec {name!r}; choose one of: {', '.join(INDEX_CODECS)}")
    return codec


def decode_indices(name: str, payload: bytes | bytearray | memoryview, numel: int, spec: ChunkSpec) -> torch.Tensor:
    """Like ``get_index_codec(name).decode(...)`` for a name that came off the wire:
    an unknown name raises ``PayloadRejected(BAD_DTYPE)`` instead of ``ValueError``."""
    codec = INDEX_CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise PayloadRejected(Reason.BAD_DTYPE, f"unknown index codec {name!r}")
    return codec.decode(payload, numel, spec)
