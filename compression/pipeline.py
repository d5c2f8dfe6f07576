"""Compression pipelines, built from a spec string.

A pipeline turns a flat fp32 pseudo-gradient into bytes and back. Its spec names the stages,
joined by ``+``; each stage is ``NAME[:ARG[:ARG...]]``; at most one stage of each kind::

    value codec   fp32 | fp16 | bf16 | q8 | q4 | q2 | s4 | s2 | fp8 | e3m0 (args: see quant.py)
    sparsifier    topk:K/C | randk:K/C       keep K of every C values (largest |x|, or seeded random)
    index code    rice | idx12               how topk's indices travel (default rice)
    zstd[:LEVEL]                             compress the bytes (default level 3)
    ef:BETA                                  error feedback with decay BETA (state kept by the caller)
    none                                     the same as fp32 alone

Examples: ``fp16``, ``e3m0``, ``q8+zstd``, ``topk:64/4096+s2+ef:0.95`` (SparseLoCo-style).

Payload layouts (before the optional zstd stage):

- dense:  value-codec bytes of all ``numel`` values
- topk:   u32 little-endian length L of the index section, L index bytes, value-codec bytes of
          the kept values (in index order)
- randk:  u64 little-endian seed, value-codec bytes of the kept values; the receiver regenerates
          the indices from the seed, so they are never sent

``decode`` treats its input as hostile: zstd output is capped at the largest size a valid payload
of ``numel`` values can have (no decompression bombs), every section is size-checked before
use, and anything wrong raises ``PayloadRejected``.
"""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass
from typing import Sequence

import torch
import zstandard

from .codecs import Codec, Fp32Codec, get_codec
from .errors import PayloadRejected, Reason, SpecError
from .indexcode import INDEX_CODECS
from .quant import QUANTIZERS
from .sparse import ChunkSpec, randk_select, topk_select

_BASE_CODECS = ("fp32", "fp16")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class Decoded:
    """A decoded contribution: `values` at `indices` (sorted, unique), or dense when indices is None."""

    indices: torch.Tensor | None
    values: torch.Tensor

    def dense(self, numel: int) -> torch.Tensor:
        if self.indices is None:
            return self.values
        out = torch.zeros(numel, dtype=torch.float32, device=self.values.device)
        out[self.indices.to(out.device)] = self.values
        return out


@dataclass(frozen=True)
class Spec:
    """A parsed pipeline spec; `text` is canonical (every default spelled out)."""

    text: str
    value: str
    sparsifier: str | None = None  # "topk" | "randk"
    chunk: ChunkSpec | None = None
    index: str | None = None
    zstd: int | None = None
    ef: float | None = None


def _value_codec(name: str, args: list[str]) -> Codec:
    if name in _BASE_CODECS:
        if args:
            raise SpecError(f"{name} takes no arguments, got {':'.join(args)!r}")
        return get_codec(name)
    return QUANTIZERS[name](args)


def value_codec_names() -> tuple[str, ...]:
    return (*_BASE_CODECS, *QUANTIZERS)


def parse(text: str) -> Spec:
    """Parse a spec string; raises `SpecError` (a ValueError) that says what is wrong and what is allowed."""
    try:
        return _parse(text)
    except SpecError:
        raise
    except (ValueError, TypeError) as e:  # a stage's own argument checks (quantizers, chunk specs)
        raise SpecError(f"compression spec {text!r}: {e}") from e


def _parse(text: str) -> Spec:
    if not isinstance(text, str):
        raise SpecError(f"a compression spec is a string such as 'fp16', got {type(text).__name__}")
    raw = text.strip()
    if not raw:
        raise SpecError("empty compression spec; try 'fp16' or 'topk:64/4096+s2+ef:0.95'")
    if raw == "none":
        raw = "fp32"
    value = sparsifier = index = None
    chunk = zstd_level = ef = None
    seen: set[str] = set()
    for stage in raw.split("+"):
        name, *args = stage.strip().split(":")
        kind = ("value" if name in value_codec_names() else "sparsifier" if name in ("topk", "randk")
                else "index" if name in INDEX_CODECS else name)
        if kind not in ("value", "sparsifier", "index", "zstd", "ef"):
            raise SpecError(
                f"unknown stage {name!r} in {text!r}; stages: value codecs ({', '.join(value_codec_names())}), "
                "topk:K/C, randk:K/C, index codes (" + ", ".join(INDEX_CODECS) + "), zstd[:LEVEL], ef:BETA"
            )
        if kind in seen:
            raise SpecError(f"two {kind} stages in {text!r}; use at most one of each")
        seen.add(kind)
        if kind == "value":
            value = _value_codec(name, args).name
        elif kind == "sparsifier":
            chunk = _parse_chunk(name, args)
            sparsifier = name
        elif kind == "index":
            if args:
                raise SpecError(f"index code {name} takes no arguments")
            index = name
        elif kind == "zstd":
            zstd_level = _parse_int("zstd level", args[0], 1, 19) if args else 3
            if len(args) > 1:
                raise SpecError("zstd takes one argument, the level (1-19)")
        else:
            if len(args) != 1:
                raise SpecError("ef takes one argument, the decay, e.g. ef:0.95")
            try:
                ef = float(args[0])
            except ValueError:
                raise SpecError(f"ef decay must be a number in (0, 1], got {args[0]!r}") from None
            if not 0 < ef <= 1:
                raise SpecError(f"ef decay must be in (0, 1], got {ef}")
    if index is not None and sparsifier != "topk":
        raise SpecError(f"index code {index!r} only applies to topk (randk sends a seed instead of indices)")
    if sparsifier == "topk" and index is None:
        index = "rice"
    if index == "idx12" and chunk is not None and chunk.chunk > 4096:
        raise SpecError(f"idx12 packs 12-bit local indices: chunk must be <= 4096, got {chunk.chunk}")
    value = value or "fp32"
    parts = [f"{sparsifier}:{chunk.k}/{chunk.chunk}"] if sparsifier and chunk else []
    parts += [value] + ([index] if index else []) + ([f"zstd:{zstd_level}"] if zstd_level else [])
    parts += [f"ef:{ef:g}"] if ef is not None else []
    return Spec("+".join(parts), value, sparsifier, chunk, index, zstd_level, ef)


def _parse_int(what: str, text: str, lo: int, hi: int) -> int:
    if not text.isdigit() or not lo <= int(text) <= hi:
        raise SpecError(f"{what} must be an integer in [{lo}, {hi}], got {text!r}")
    return int(text)


def _parse_chunk(name: str, args: list[str]) -> ChunkSpec:
    if len(args) != 1 or "/" not in args[0]:
        raise SpecError(f"{name} needs K/C, e.g. {name}:64/4096 (keep 64 of every 4096 values)")
    k, c = args[0].split("/", 1)
    chunk = _parse_int(f"{name} chunk C", c, 1, 65536)
    return ChunkSpec(_parse_int(f"{name} K", k, 1, chunk), chunk)


class Pipeline:
    """Encode/decode flat fp32 tensors per a `Spec`. Stateless (error feedback lives in `ef.py`)."""

    def __init__(self, spec: str | Spec) -> None:
        self.spec = parse(spec) if isinstance(spec, str) else spec
        name, *args = self.spec.value.split(":")
        self.value = _value_codec(name, args)
        self.index = INDEX_CODECS[self.spec.index] if self.spec.index else None
        self._zc = zstandard.ZstdCompressor(level=self.spec.zstd) if self.spec.zstd else None

    @property
    def name(self) -> str:
        return self.spec.text

    @property
    def sparse(self) -> bool:
        return self.spec.sparsifier is not None

    @property
    def exact(self) -> bool:
        """Whether decoding gives back the very values encoded, bit for bit (finite ones): fp32 values, dense (zstd
        is lossless)."""
        return self.spec.value == "fp32" and self.spec.sparsifier is None

    def dense_only(self) -> Pipeline:
        """The same value codec and zstd stage without sparsifier or EF (for averaged results)."""
        parts = [self.spec.value] + ([f"zstd:{self.spec.zstd}"] if self.spec.zstd else [])
        return Pipeline("+".join(parts))

    # ---------------------------------------------------------------------- encode

    def encode(self, t: torch.Tensor) -> bytes:
        """The wire bytes of `t` (any device and float dtype). Everything is computed where `t` is: on a GPU the
        selection, the index code and the value codec run there, and only the encoded bytes cross to the host. The
        bytes are the same on every device for every deterministic codec: top-k's selection is exact, rand-k's
        indices come from its seed, the value codecs do the same IEEE arithmetic (`s4`/`s2` sum their statistics in
        another order, so their bins may differ in the last bit)."""
        payload = self._encode(t)
        return payload if isinstance(payload, bytes) else payload.tobytes()

    def _encode(self, t: torch.Tensor) -> bytes | memoryview:
        """`encode(t)`, a dense payload as the value codec wrote it (`Codec.encode_view`: no copy into a new
        `bytes`; never a view of `t`)."""
        t = t.detach().reshape(-1).to(torch.float32)
        raw: bytes | memoryview
        if self.spec.sparsifier == "topk":
            assert self.spec.chunk is not None and self.index is not None
            idx = topk_select(t, self.spec.chunk)
            kept = t[idx].contiguous()
            index_bytes = self.index.encode(idx, t.numel(), self.spec.chunk)
            raw = _U32.pack(len(index_bytes)) + index_bytes + self.value.encode_view(kept)
        elif self.spec.sparsifier is None:
            raw = self.value.encode_view(t.contiguous())
        else:
            assert self.spec.chunk is not None
            seed = int.from_bytes(os.urandom(8), "little") >> 1  # torch seeds must fit in int64
            idx = randk_select(t.numel(), self.spec.chunk, seed)
            raw = _U64.pack(seed) + self.value.encode_view(t[idx.to(t.device)].contiguous())
        return self._zc.compress(raw) if self._zc is not None else raw

    def encode_parts(self, parts: Sequence[torch.Tensor]) -> bytes | memoryview:
        """`encode` of the concatenation of `parts` (1-D), as the swarm sends it: for dense fp32 without zstd in host
        memory, their bytes joined into the payload, one copy and no concatenated tensor; else a dense payload as the
        value codec wrote it (`Codec.encode_view`: on a GPU, the pinned memory its bytes crossed into, not copied
        again). Never a view of a part."""
        views = [self._own_bytes(p) for p in parts] if len(parts) > 1 else []
        if views and all(v is not None for v in views):
            return b"".join(v for v in views if v is not None)
        return self._encode(parts[0] if len(parts) == 1 else torch.cat(list(parts)) if parts else torch.empty(0))

    def _raw_fp32(self) -> Fp32Codec | None:
        """The value codec when its bytes are the payload (dense fp32, no other stage on): a tensor's own bytes are
        its encoding, and a payload decodes straight into a tensor; else None."""
        return self.value if isinstance(self.value, Fp32Codec) and self.exact and not self.spec.zstd else None

    def _own_bytes(self, t: torch.Tensor) -> memoryview | None:
        """`t`'s encoding as a view of its own memory where the value codec's bytes are `t`'s own (`own_bytes`);
        else None."""
        raw = self._raw_fp32()
        return raw.own_bytes(t) if raw is not None else None

    def encode_view(self, t: torch.Tensor) -> bytes | memoryview:
        """`encode(t)`, as a view of `t`'s own memory where the encoding is `t`'s bytes themselves (dense fp32 without
        zstd, a contiguous fp32 tensor in host memory, a little-endian host): valid only while `t` is unchanged."""
        view = self._own_bytes(t)
        return view if view is not None else self._encode(t)

    # ---------------------------------------------------------------------- decode

    def max_raw_size(self, numel: int) -> int:
        """Largest valid payload (before zstd) for `numel` values: the zstd output cap."""
        if self.spec.chunk is None:
            return self.value.encoded_size(numel)
        kept = self.spec.chunk.kept(numel)
        return 8 + 4 * kept + 64 * (numel // max(1, self.spec.chunk.chunk) + 1) + self.value.encoded_size(kept)

    def decode(self, payload: bytes | memoryview, numel: int, device: torch.device | None = None) -> Decoded:
        """The values (and indices) of `payload`, on `device` (host memory when None: on a GPU, the value codec's
        and a top-k selection's index codec's bytes cross to it and decode there; rand-k's indices, regenerated from
        the seed on the host, cross as they are)."""
        raw = memoryview(payload)
        if self.spec.zstd:
            raw = memoryview(_decompress(raw, self.max_raw_size(numel)))
        if self.spec.sparsifier is None:
            return Decoded(None, self.value.decode(raw, numel, device))
        assert self.spec.chunk is not None
        kept = self.spec.chunk.kept(numel)
        if self.spec.sparsifier == "topk":
            assert self.index is not None
            if raw.nbytes < 4:
                raise PayloadRejected(Reason.TRUNCATED, "topk payload shorter than its index length field")
            (n,) = _U32.unpack_from(raw, 0)
            if n > raw.nbytes - 4:
                raise PayloadRejected(Reason.TRUNCATED, f"index section of {n} bytes, {raw.nbytes - 4} present")
            idx = self.index.decode(raw[4 : 4 + n], numel, self.spec.chunk, device)
            values = self.value.decode(raw[4 + n :], kept, device)
        else:
            if raw.nbytes < 8:
                raise PayloadRejected(Reason.TRUNCATED, "randk payload shorter than its seed")
            (seed,) = _U64.unpack_from(raw, 0)
            if seed >= 1 << 63:
                raise PayloadRejected(Reason.BAD_HEADER, "randk seed out of range")
            idx = randk_select(numel, self.spec.chunk, seed)
            values = self.value.decode(raw[8:], kept, device)
        return Decoded(idx if device is None else idx.to(device), values)


    def decode_into(self, payload: bytes | memoryview, numel: int, out: torch.Tensor) -> torch.Tensor:
        """`decode(payload, numel).dense(numel)` written into `out` (`numel` fp32 values) and returned: for dense fp32
        without zstd into host memory, one pass from the payload's bytes and no tensor of its own."""
        if out.numel() != numel:
            raise ValueError(f"decode_into: {numel} values into a tensor of {out.numel()}")
        if (raw := self._raw_fp32()) is not None:
            return raw.decode_into(payload, numel, out)
        return out.copy_(self.decode(payload, numel).dense(numel))


def _decompress(data: memoryview, limit: int) -> bytes:
    """zstd-decompress, reading at most `limit` + 1 bytes of output: more is a rejection, so a
    decompression bomb costs at most `limit` bytes of memory. Any zstd error is a rejection."""
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=False) as reader:
            while len(out) <= limit:
                block = reader.read(min(1 << 20, limit + 1 - len(out)))
                if not block:
                    break
                out += block
    except zstandard.ZstdError as e:
        raise PayloadRejected(Reason.BAD_HEADER, f"zstd: {e}") from None
    if len(out) > limit:
        raise PayloadRejected(Reason.OVERSIZED, f"zstd output exceeds {limit} bytes")
    return bytes(out)
