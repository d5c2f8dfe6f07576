"""Unit tests for diloco.compression.sparse and diloco.compression.indexcode.

The contract under test: selections have exactly the per-chunk counts of their
ChunkSpec, are strictly ascending and reproducible bit for bit (ties and seeds
included); index codecs round-trip those selections exactly, and decoding any
other bytes returns a valid selection or raises PayloadRejected -- never any
other exception.
"""

from __future__ import annotations

import functools
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.compression import PayloadRejected, Reason, indexcode
from diloco.compression.indexcode import (
    INDEX_CODECS,
    IndexCodec,
    Packed12,
    RiceGaps,
    decode_indices,
    get_index_codec,
)
from diloco.compression.sparse import ChunkSpec, gather, randk_select, scatter_dense, topk_select

pytestmark = pytest.mark.unit

FUZZ = settings(
    max_examples=3000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROPERTY = settings(FUZZ, max_examples=150)

# --------------------------------------------------------------------------- helpers


def reference_topk(values: np.ndarray, spec: ChunkSpec) -> np.ndarray:
    """Per-chunk top-k by |value|, lower index first among equals, by a global lexsort
    on (chunk, -|value|, index): independent of topk_select's threshold trick."""
    numel = len(values)
    index = np.arange(numel)
    chunk = index // spec.chunk
    order = np.lexsort((index, -np.abs(values.astype(np.float64)), chunk))
    rank = np.empty(numel, dtype=np.int64)
    rank[order] = np.arange(numel) - chunk[order] * spec.chunk  # position within its chunk's ranking
    return np.flatnonzero(rank < spec.k)


def random_values(rng: np.random.Generator, numel: int, kind: str) -> torch.Tensor:
    if kind == "normal":
        array = rng.standard_normal(numel).astype(np.float32)
    elif kind == "ties":  # few distinct magnitudes, both signed zeros: ties everywhere
        array = rng.choice(np.array([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5], dtype=np.float32), numel)
    else:  # "scales": magnitudes over many binades, including subnormals
        array = (rng.standard_normal(numel) * 10.0 ** rng.uniform(-44, 30, numel)).astype(np.float32)
    return torch.from_numpy(array)


def check_selection(indices: torch.Tensor, numel: int, spec: ChunkSpec) -> None:
    """Shape invariants of every selection (and of every successful decode)."""
    assert indices.dtype == torch.int64 and indices.dim() == 1
    assert indices.numel() == spec.kept(numel)
    array = indices.numpy()
    if array.size:
        assert array[0] >= 0 and array[-1] < numel
        assert (np.diff(array) > 0).all()
    counts = np.bincount(array // spec.chunk, minlength=spec.n_chunks(numel))
    assert counts.tolist() == spec.counts(numel).tolist()


def chunk_local(indices: torch.Tensor, spec: ChunkSpec, numel: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(spec.n_chunks(numel))]
    for index in indices.tolist():
        out[index // spec.chunk].append(index % spec.chunk)
    return out


def reference_rice(local_chunks: list[list[int]]) -> bytes:
    """Bit-by-bit reference of the documented 'rice' layout (LSB-first stream:
    4-bit parameters, then remainders, then unary quotients, zero padding)."""
    bits: list[int] = []

    def put(value: int, width: int) -> None:
        bits.extend((value >> j) & 1 for j in range(width))

    chunks = []
    for local in local_chunks:
        gaps = [local[0]] + [b - a - 1 for a, b in zip(local, local[1:])]
        costs = [sum((g >> r) + 1 + r for g in gaps) for r in range(16)]
        chunks.append((costs.index(min(costs)), gaps))
    for r, _ in chunks:
        put(r, 4)
    for r, gaps in chunks:
        for g in gaps:
            put(g & ((1 << r) - 1), r)
    for r, gaps in chunks:
        for g in gaps:
            bits.extend([0] * (g >> r) + [1])
    bits.extend([0] * (-len(bits) % 8))
    return bytes(sum(bit << j for j, bit in enumerate(bits[i : i + 8])) for i in range(0, len(bits), 8))


def rejected(codec: IndexCodec, payload: bytes, numel: int, spec: ChunkSpec) -> Reason:
    with pytest.raises(PayloadRejected) as info:
        codec.decode(payload, numel, spec)
    assert isinstance(info.value.reason, Reason)
    return info.value.reason


specs = st.integers(1, 5000).flatmap(lambda chunk: st.builds(ChunkSpec, k=st.integers(1, chunk), chunk=st.just(chunk)))
small_specs = st.sampled_from([1, 2, 3, 5, 8, 16, 64, 4096]).flatmap(
    lambda chunk: st.builds(ChunkSpec, k=st.integers(1, chunk), chunk=st.just(chunk)))

# --------------------------------------------------------------------------- ChunkSpec


def test_chunk_spec_defaults_and_arithmetic() -> None:
    spec = ChunkSpec()
    assert (spec.k, spec.chunk) == (64, 4096)
    assert spec.kept(0) == 0 and spec.n_chunks(0) == 0 and spec.counts(0).tolist() == []
    assert spec.kept(4096) == 64 and spec.kept(4096 + 10) == 74 and spec.kept(2 * 4096 + 100) == 192
    assert spec.counts(2 * 4096 + 10).tolist() == [64, 64, 10]
    assert ChunkSpec(k=4, chunk=4).kept(10) == 10  # k == chunk keeps everything
    assert ChunkSpec(1, 65536).kept(10**12) == -(-(10**12) // 65536)  # pure arithmetic, no allocation


@pytest.mark.parametrize("k, chunk, message", [
    (0, 4096, "k must be in 1..chunk"), (65, 64, "k must be in 1..chunk"),
    (1, 0, "chunk must be in 1..65536"), (1, 65537, "chunk must be in 1..65536"),
])
def test_chunk_spec_validation(k: int, chunk: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChunkSpec(k, chunk)
    with pytest.raises(PayloadRejected) as info:
        ChunkSpec.from_wire(k, chunk)
    assert info.value.reason is Reason.BAD_HEADER


def test_chunk_spec_types() -> None:
    with pytest.raises(TypeError):
        ChunkSpec(True, 4096)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ChunkSpec(64, 4096.0)  # type: ignore[arg-type]
    for bad in ((True, 8), ("4", 8), (4, None)):
        with pytest.raises(PayloadRejected):
            ChunkSpec.from_wire(*bad)
    assert ChunkSpec.from_wire(4, 8) == ChunkSpec(4, 8)
    with pytest.raises(ValueError):
        ChunkSpec().kept(-1)


# --------------------------------------------------------------------------- topk_select


@PROPERTY
@given(numel=st.integers(1, 20000), spec=specs, seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["normal", "ties", "scales"]))
def test_topk_select_matches_reference(numel: int, spec: ChunkSpec, seed: int, kind: str) -> None:
    t = random_values(np.random.default_rng(seed), numel, kind)
    got = topk_select(t, spec)
    check_selection(got, numel, spec)
    assert got.tolist() == reference_topk(t.numpy(), spec).tolist()


@pytest.mark.parametrize("numel, k, chunk", [(4096 * 3 + 7, 64, 4096), (100, 10, 10), (37, 5, 8), (5, 8, 8), (9, 1, 1)])
def test_topk_select_counts_partial_last_chunk(numel: int, k: int, chunk: int) -> None:
    spec = ChunkSpec(k, chunk)
    got = topk_select(torch.randn(numel, generator=torch.Generator().manual_seed(numel)), spec)
    check_selection(got, numel, spec)


def test_topk_select_ties_go_to_lower_index() -> None:
    spec = ChunkSpec(k=3, chunk=8)
    assert topk_select(torch.zeros(20), spec).tolist() == [0, 1, 2, 8, 9, 10, 16, 17, 18]
    t = torch.tensor([1.0, -2.0, 2.0, 0.0, -2.0, 2.0, 1.0, -0.0, 0.0, -0.0, 5.0])
    # chunk 0: |2| at 1, 2, 4, 5 -> lowest three; chunk 1 (short): 5.0 then the +-0 ties in order
    assert topk_select(t, spec).tolist() == [1, 2, 4, 8, 9, 10]
    many_ties = torch.ones(4096 * 4) * torch.tensor([1.0, -1.0]).repeat(4096 * 2)
    assert topk_select(many_ties, ChunkSpec()).tolist() == [c * 4096 + i for c in range(4) for i in range(64)]


def test_topk_select_non_finite_and_layout() -> None:
    t = torch.tensor([1.0, math.inf, 3.0, math.nan, -math.inf, 2.0, -5.0, 1e-45])
    assert topk_select(t, ChunkSpec(k=3, chunk=8)).tolist() == [1, 3, 4]  # NaN ranks above +-inf
    assert topk_select(t[::2], ChunkSpec(k=2, chunk=4)).tolist() == [2, 3]  # non-contiguous: [1, 3, -inf, -5]
    assert topk_select(torch.zeros(0), ChunkSpec()).tolist() == []
    with pytest.raises(TypeError):
        topk_select(torch.zeros(4, dtype=torch.float64), ChunkSpec(1, 4))
    with pytest.raises(ValueError):
        topk_select(torch.zeros(2, 2), ChunkSpec(1, 4))


def test_topk_select_is_deterministic() -> None:
    t = torch.randn(50_000, generator=torch.Generator().manual_seed(3)).round(decimals=1)  # many ties
    spec = ChunkSpec(k=50, chunk=1000)
    first = topk_select(t, spec)
    assert torch.equal(first, topk_select(t.clone(), spec))
    assert first.tolist() == reference_topk(t.numpy(), spec).tolist()


# --------------------------------------------------------------------------- randk_select


def test_randk_select_reproducible_and_seed_dependent() -> None:
    spec = ChunkSpec(k=64, chunk=4096)
    numel = 4096 * 10 + 100
    first = randk_select(numel, spec, seed=42)
    check_selection(first, numel, spec)
    assert torch.equal(first, randk_select(numel, spec, seed=42))
    assert not torch.equal(first, randk_select(numel, spec, seed=43))
    assert randk_select(0, spec, seed=1).tolist() == []
    assert randk_select(5, ChunkSpec(8, 8), seed=1).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        randk_select(10, spec, seed=-1)


def test_randk_select_golden() -> None:
    # Peers must draw identical indices from a shared seed. A failure here after a
    # torch upgrade means torch's CPU generator stream changed: peers on different
    # torch releases would disagree, which requires a PROTOCOL_VERSION bump.
    assert randk_select(20, ChunkSpec(3, 8), 12345).tolist() == [1, 2, 6, 9, 11, 15, 17, 18, 19]
    assert randk_select(4096 * 2 + 5, ChunkSpec(4, 4096), 2**64 - 1).tolist() == [
        1049, 1128, 1768, 2316, 4226, 5808, 5977, 6950, 8193, 8194, 8195, 8196]


@PROPERTY
@given(numel=st.integers(0, 20000), spec=specs, seed=st.integers(0, 2**64 - 1))
def test_randk_select_counts(numel: int, spec: ChunkSpec, seed: int) -> None:
    check_selection(randk_select(numel, spec, seed), numel, spec)


def test_randk_select_is_roughly_uniform() -> None:
    # 1024 chunks x 64 picks over 4096 positions: 16 expected hits per local position.
    # Chi-square with 4095 dof has mean 4095 and sd ~90.5; the bound is 6 sd either side.
    spec = ChunkSpec(64, 4096)
    local = randk_select(4096 * 1024, spec, seed=2024) % 4096
    observed = torch.bincount(local, minlength=4096).double()
    chi2 = float(((observed - 16.0) ** 2 / 16.0).sum())
    assert abs(chi2 - 4095) < 6 * math.sqrt(2 * 4095), chi2
    # Coarser: first vs second half of a chunk.
    assert abs(int((local < 2048).sum()) - 32768) < 6 * math.sqrt(32768 * 0.5)
    # A short last chunk (100 elements keeping 64) is uniform too: over 300 seeds each position
    # is kept Binomial(300, 0.64) times (mean 192, variance 69.12); the normalised squared
    # deviations sum to about 99 (the 64-per-draw constraint makes them slightly dependent).
    tail = torch.cat([randk_select(4096 + 100, spec, seed)[64:] - 4096 for seed in range(300)])
    observed = torch.bincount(tail, minlength=100).double()
    assert observed.numel() == 100
    chi2 = float(((observed - 192.0) ** 2 / 69.12).sum())
    assert chi2 < 99 + 6 * math.sqrt(2 * 99), chi2


# --------------------------------------------------------------------------- gather / scatter


def test_gather_scatter_dense_round_trip() -> None:
    t = torch.randn(10_000, generator=torch.Generator().manual_seed(5))
    spec = ChunkSpec(16, 512)
    indices = topk_select(t, spec)
    values = gather(t, indices)
    assert torch.equal(values, t[indices])
    dense = scatter_dense(values, indices, t.numel())
    mask = torch.zeros(t.numel(), dtype=torch.bool)
    mask[indices] = True
    assert torch.equal(dense, torch.where(mask, t, torch.zeros_like(t)))
    assert scatter_dense(torch.zeros(0), torch.zeros(0, dtype=torch.int64), 3).tolist() == [0.0] * 3
    with pytest.raises(ValueError):
        scatter_dense(values, indices, 100)  # indices beyond numel
    with pytest.raises(ValueError):
        scatter_dense(values[:-1], indices, t.numel())


# --------------------------------------------------------------------------- index codecs


def test_index_codec_registry() -> None:
    assert list(INDEX_CODECS) == ["idx12", "rice"]
    assert isinstance(INDEX_CODECS["idx12"], Packed12) and isinstance(INDEX_CODECS["rice"], RiceGaps)
    for name, codec in INDEX_CODECS.items():
        assert isinstance(codec, IndexCodec) and codec.name == name and get_index_codec(name) is codec
    with pytest.raises(ValueError, match=r"^unknown index codec 'x'; choose one of: idx12, rice$"):
        get_index_codec("x")
    with pytest.raises(PayloadRejected) as info:
        decode_indices("x", b"", 0, ChunkSpec())
    assert info.value.reason is Reason.BAD_DTYPE
    assert decode_indices("rice", b"", 0, ChunkSpec()).tolist() == []


@PROPERTY
@given(numel=st.integers(0, 20000), spec=specs, seed=st.integers(0, 2**32 - 1), use_topk=st.booleans())
def test_index_codecs_round_trip(numel: int, spec: ChunkSpec, seed: int, use_topk: bool) -> None:
    if use_topk:
        indices = topk_select(random_values(np.random.default_rng(seed), numel, "scales"), spec)
    else:
        indices = randk_select(numel, spec, seed)
    for name, codec in INDEX_CODECS.items():
        if name == "idx12" and spec.chunk > 4096:
            continue
        payload = codec.encode(indices, numel, spec)
        assert len(payload) <= codec.max_encoded_size(numel, spec)
        out = codec.decode(memoryview(bytearray(payload)), numel, spec)
        assert torch.equal(out, indices), name
        check_selection(out, numel, spec)


def test_rice_matches_bit_level_reference() -> None:
    rng = np.random.default_rng(11)
    for numel, spec in [(20, ChunkSpec(3, 8)), (4098, ChunkSpec(3, 4096)), (9000, ChunkSpec(64, 4096)),
                        (3000, ChunkSpec(1, 1000)), (700, ChunkSpec(100, 100)), (65536 + 3, ChunkSpec(2, 65536))]:
        indices = topk_select(torch.from_numpy(rng.standard_normal(numel).astype(np.float32)), spec)
        payload = RiceGaps().encode(indices, numel, spec)
        assert payload == reference_rice(chunk_local(indices, spec, numel)), (numel, spec)


def test_rice_finds_the_unary_ones_in_pieces_as_in_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU's nonzero takes at most 2**31 - 1 elements (torch < 2.6): a longer unary section is searched in pieces.
    spec = ChunkSpec(64, 4096)
    valid = (RiceGaps().encode(topk_select(torch.randn(9000, generator=torch.Generator().manual_seed(2)), spec),
                               9000, spec), 9000, spec)  # 192 indices: a unary section of 38 pieces or more
    cases = [valid] + [fuzz_case("rice", seed)[1:] for seed in range(60)]
    whole = [outcome(RiceGaps(), *case) for case in cases]
    monkeypatch.setattr(indexcode, "NONZERO_PIECE", 5)
    assert [outcome(RiceGaps(), *case) for case in cases] == whole
    assert len(whole[0]) == 192 and sum(isinstance(o, list) for o in whole) > 2


def outcome(codec: IndexCodec, payload: bytes, numel: int, spec: ChunkSpec,
            device: torch.device | None = None) -> list[int] | Reason:
    """What decoding gives: the indices, or the reason it was refused (tests/test_gpu.py: on a GPU too)."""
    try:
        return codec.decode(payload, numel, spec, device).tolist()
    except PayloadRejected as err:
        return err.reason


@pytest.mark.parametrize("kept_numel", [(1, 1), (2, 2), (3, 3), (5, 5), (64, 4096), (65, 4097)])
def test_packed12_exact_size(kept_numel: tuple[int, int]) -> None:
    kept, numel = kept_numel
    spec = ChunkSpec(64, 4096)
    assert spec.kept(numel) == kept
    payload = Packed12().encode(randk_select(numel, spec, 0), numel, spec)
    assert len(payload) == Packed12().encoded_size(numel, spec) == math.ceil(kept * 12 / 8)


def test_rice_bits_per_index() -> None:
    # Measured: 7.558 bits/index (7.496 + 4/64 for the per-chunk parameter) for
    # k=64 of C=4096, uniform random selections; idx12 spends 12; bound 7.36.
    spec = ChunkSpec(64, 4096)
    numel = 4096 * 256
    indices = randk_select(numel, spec, seed=9)
    bits = 8 * len(RiceGaps().encode(indices, numel, spec)) / indices.numel()
    assert 7.2 < bits < 7.8, bits


def test_index_codec_golden_bytes() -> None:
    # A change here means a PROTOCOL_VERSION bump: these are the exact wire bytes.
    # 4098 elements in chunks of 4096 keeping 3: local indices [7, 2048, 4095] and [0, 1].
    spec = ChunkSpec(3, 4096)
    indices = torch.tensor([7, 2048, 4095, 4096, 4097])
    # idx12: (7, 2048) -> 0x800007 -> 07 00 80; (4095, 0) -> ff 0f 00; odd last 1 -> 01 00
    assert Packed12().encode(indices, 4098, spec).hex() == "070080ff0f000100"
    assert RiceGaps().encode(indices, 4098, spec).hex() == "0a07e0ef7f1d"
    # Hand-checked: all r = 0 (12 zero bits), then unary 1|00001|01, 01|1|00001, 1|01|1.
    small = torch.tensor([0, 5, 7, 9, 10, 15, 16, 18, 19])
    assert RiceGaps().encode(small, 20, ChunkSpec(3, 8)).hex() == "00106ad8"
    for codec, payload, numel, s, expected in [
        (Packed12(), "070080ff0f000100", 4098, spec, indices),
        (RiceGaps(), "0a07e0ef7f1d", 4098, spec, indices),
        (RiceGaps(), "00106ad8", 20, ChunkSpec(3, 8), small),
    ]:
        assert torch.equal(codec.decode(bytes.fromhex(payload), numel, s), expected)


def test_encode_rejects_misuse() -> None:
    spec = ChunkSpec(2, 4)
    for codec in INDEX_CODECS.values():
        with pytest.raises(ValueError):
            codec.encode(torch.tensor([0, 1, 4]), 8, spec)  # wrong count
        with pytest.raises(ValueError):
            codec.encode(torch.tensor([1, 0, 4, 5]), 8, spec)  # unsorted
        with pytest.raises(ValueError):
            codec.encode(torch.tensor([0, 1, 2, 5]), 8, spec)  # 3 in chunk 0, 1 in chunk 1
        with pytest.raises(ValueError):
            codec.encode(torch.tensor([0, 1, 4, 8]), 8, spec)  # beyond numel
        with pytest.raises(TypeError):
            codec.encode(torch.tensor([0.0, 1.0, 4.0, 5.0]), 8, spec)
    with pytest.raises(ValueError, match="rice"):
        Packed12().encode(torch.tensor([0]), 8192, ChunkSpec(1, 8192))


# --------------------------------------------------------------------------- explicit rejections


SPEC = ChunkSpec(3, 8)  # 20 elements: chunks of 8, 8 and a short one of 4 -> 9 indices
GOOD = torch.tensor([0, 5, 7, 9, 10, 15, 16, 18, 19])


def packed12_raw(local: list[int]) -> bytes:
    """idx12 bytes for arbitrary local values, bypassing encode()'s validation."""
    padded = local + [0] * (len(local) % 2)
    out = b"".join((a | b << 12).to_bytes(3, "little") for a, b in zip(padded[0::2], padded[1::2]))
    return out[: (12 * len(local) + 7) // 8]


def test_packed12_rejections() -> None:
    codec = Packed12()
    good = codec.encode(GOOD, 20, SPEC)
    assert good == packed12_raw([0, 5, 7, 1, 2, 7, 0, 2, 3])
    assert rejected(codec, packed12_raw([0, 5, 5, 1, 2, 7, 0, 2, 3]), 20, SPEC) is Reason.DUPLICATE
    assert rejected(codec, packed12_raw([0, 7, 5, 1, 2, 7, 0, 2, 3]), 20, SPEC) is Reason.BAD_HEADER  # unsorted
    assert rejected(codec, packed12_raw([0, 5, 8, 1, 2, 7, 0, 2, 3]), 20, SPEC) is Reason.BAD_HEADER  # >= chunk
    assert rejected(codec, packed12_raw([0, 5, 7, 1, 2, 7, 0, 2, 4]), 20, SPEC) is Reason.BAD_HEADER  # >= numel
    assert rejected(codec, packed12_raw([0, 5, 7, 1, 2, 7, 0, 2]), 20, SPEC) is Reason.WRONG_SIZE  # wrong count
    assert rejected(codec, good[:-1], 20, SPEC) is Reason.WRONG_SIZE  # truncated
    assert rejected(codec, good + b"\x00", 20, SPEC) is Reason.WRONG_SIZE  # trailing garbage
    assert rejected(codec, good[:-1] + bytes([good[-1] | 0x80]), 20, SPEC) is Reason.WRONG_SIZE  # padding bits
    assert rejected(codec, good, 18, SPEC) is Reason.WRONG_SIZE  # 18 elements keep only 8 indices
    assert rejected(codec, b"", 4096, ChunkSpec(1, 8192)) is Reason.BAD_HEADER  # spec it cannot carry


def test_rice_rejections() -> None:
    codec = RiceGaps()
    good = codec.encode(GOOD, 20, SPEC)
    assert good.hex() == "00106ad8"  # 12 zero parameter bits, then unary codes from bit 12 on
    assert rejected(codec, good[:-1], 20, SPEC) is Reason.TRUNCATED
    assert rejected(codec, good + b"\x00", 20, SPEC) is Reason.WRONG_SIZE  # trailing zero byte
    assert rejected(codec, good + b"\x01", 20, SPEC) is Reason.WRONG_SIZE  # trailing index
    # wrong count: clear the final terminator (one index short) / an extra one-bit after it
    assert rejected(codec, good[:-1] + bytes([good[-1] & 0x7F]), 20, SPEC) is Reason.TRUNCATED
    longer = bytes.fromhex("00106ad801")
    assert rejected(codec, longer, 20, SPEC) is Reason.WRONG_SIZE
    # unary run longer than the chunk: one index, r = 0, quotient 20 in a chunk of 16
    one = ChunkSpec(1, 16)
    bits = [0] * 4 + [0] * 20 + [1]
    payload = bytes(sum(b << j for j, b in enumerate(bits[i:i + 8])) for i in range(0, 32, 8))
    assert rejected(codec, payload, 10, one) is Reason.BAD_HEADER
    # out of range: gaps that stay within the quotient bound but run past the chunk end
    assert rejected(codec, reference_rice([[0, 5, 7], [1, 2, 7], [0, 2, 4]]), 20, SPEC) is Reason.BAD_HEADER
    assert rejected(codec, reference_rice([[0, 5, 7], [1, 2, 9], [0, 2, 3]]), 20, SPEC) is Reason.BAD_HEADER
    # a large Rice parameter whose remainder alone lands past the chunk (r = 15, gap 16000 in 8)
    big_r = [1, 1, 1, 1] + [(16000 >> j) & 1 for j in range(15)] + [1]
    big_r += [0] * (-len(big_r) % 8)
    payload = bytes(sum(b << j for j, b in enumerate(big_r[i:i + 8])) for i in range(0, len(big_r), 8))
    assert rejected(codec, payload, 8, ChunkSpec(1, 8)) is Reason.BAD_HEADER
    # sizes are checked before allocating: absurd element counts are rejected at once
    assert rejected(codec, good, 10**18, SPEC) is Reason.TRUNCATED
    assert rejected(codec, bytes(10_000), 20, SPEC) is Reason.WRONG_SIZE  # beyond max_encoded_size
    assert rejected(codec, b"\x00", 0, SPEC) is Reason.WRONG_SIZE


@pytest.mark.parametrize("name", list(INDEX_CODECS))
def test_decode_rejects_bad_numel(name: str) -> None:
    codec = INDEX_CODECS[name]
    for numel in (-1, True, 2.0, None, 10**18):
        reason = rejected(codec, b"\x00\x00", numel, SPEC)  # type: ignore[arg-type]
        assert reason in {Reason.WRONG_SIZE, Reason.TRUNCATED}


# --------------------------------------------------------------------------- fuzzing


DECODE_REASONS = {Reason.WRONG_SIZE, Reason.TRUNCATED, Reason.BAD_HEADER, Reason.DUPLICATE}
FUZZ_SPECS = [ChunkSpec(1, 1), ChunkSpec(1, 8), ChunkSpec(3, 8), ChunkSpec(8, 8), ChunkSpec(5, 64),
              ChunkSpec(64, 4096), ChunkSpec(2, 65536)]


def check_decode_total(codec: IndexCodec, payload: bytes, numel: int, spec: ChunkSpec) -> None:
    """decode() returns a valid selection or raises PayloadRejected -- nothing else."""
    try:
        out = codec.decode(payload, numel, spec)
    except PayloadRejected as err:
        assert err.reason in DECODE_REASONS, err
        return
    check_selection(out, numel, spec)
    assert torch.equal(codec.decode(payload, numel, spec), out)  # deterministic
    assert torch.equal(codec.decode(codec.encode(out, numel, spec), numel, spec), out)
    if codec.name == "idx12":
        assert codec.encode(out, numel, spec) == payload  # idx12 has one encoding per selection


@functools.lru_cache(maxsize=None)
def valid_payload(name: str, numel: int, spec: ChunkSpec, seed: int) -> bytes:
    """A cached valid payload: a few hundred distinct starting points for the mutator."""
    return INDEX_CODECS[name].encode(randk_select(numel, spec, seed), numel, spec)


def fuzz_case(name: str, seed: int) -> tuple[IndexCodec, bytes, int, ChunkSpec]:
    rng = random.Random(seed)  # a failure report's seed reproduces the exact payload
    codec = INDEX_CODECS[name]
    spec = rng.choice([s for s in FUZZ_SPECS if name != "idx12" or s.chunk <= 4096])
    full = min(spec.chunk, 4097)  # 65536-element chunks are exercised through short last chunks
    numel = rng.choice([0, 1, 2, 777, 2999, full, full + 1, min(2 * spec.chunk + 3, 9001)])
    if rng.random() < 0.25:  # arbitrary bytes
        payload = bytearray(rng.randbytes(rng.choice([0, 1, 2, rng.randrange(64), rng.randrange(600)])))
        numel = rng.choice([numel, rng.randrange(200)])
    else:  # a valid payload, then mutated
        payload = bytearray(valid_payload(name, numel, spec, rng.randrange(3)))
        for _ in range(rng.randint(1, 4)):
            op = rng.choice(("flip", "byte", "truncate", "extend", "insert", "delete", "zero", "ones"))
            pos = rng.randrange(len(payload)) if payload else 0
            if op == "flip" and payload:
                payload[pos] ^= 1 << rng.randrange(8)
            elif op == "byte" and payload:
                payload[pos] = rng.randrange(256)
            elif op == "truncate":
                del payload[pos:]
            elif op == "extend":
                payload += rng.randbytes(rng.randint(1, 4))
            elif op == "insert":
                payload[pos:pos] = rng.randbytes(rng.randint(1, 4))
            elif op == "delete":
                del payload[pos : pos + rng.randint(1, 4)]
            elif op == "zero":
                payload[pos : pos + 4] = bytes(len(payload[pos : pos + 4]))
            elif op == "ones":
                payload[pos : pos + 4] = b"\xff" * len(payload[pos : pos + 4])
    return codec, bytes(payload), numel, spec


@FUZZ
@given(seed=st.integers(0, 2**64 - 1))
def test_fuzz_packed12_decode(seed: int) -> None:
    check_decode_total(*fuzz_case("idx12", seed))


@FUZZ
@given(seed=st.integers(0, 2**64 - 1))
def test_fuzz_rice_decode(seed: int) -> None:
    check_decode_total(*fuzz_case("rice", seed))


@settings(FUZZ, max_examples=500)
@given(name=st.sampled_from(list(INDEX_CODECS)), payload=st.binary(max_size=64),
       numel=st.integers(0, 200), spec=small_specs)
def test_fuzz_decode_arbitrary_bytes(name: str, payload: bytes, numel: int, spec: ChunkSpec) -> None:
    check_decode_total(INDEX_CODECS[name], payload, numel, spec)
