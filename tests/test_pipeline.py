"""Compression pipelines: spec parsing, round trips, hostile payloads."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.compression import PayloadRejected, Pipeline, Reason, parse

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text, canonical", [
    ("none", "fp32"),
    ("fp16", "fp16"),
    ("q8+zstd", "q8:256+zstd:3"),
    ("zstd:9+e3m0", "e3m0:0+zstd:9"),
    ("topk:64/4096+s2+ef:0.95", "topk:64/4096+s2+rice+ef:0.95"),
    ("ef:1+idx12+topk:32/4096+q2:64:sr", "topk:32/4096+q2:64:sr+idx12+ef:1"),
    ("randk:8/64+fp16", "randk:8/64+fp16"),
])
def test_spec_canonical_form(text, canonical):
    assert parse(text).text == canonical
    assert parse(canonical).text == canonical  # canonical specs are fixed points


@pytest.mark.parametrize("text, message", [
    ("", "empty compression spec"),
    ("int3", "unknown stage 'int3'"),
    ("fp16+bf16", "two value stages"),
    ("topk:64", "topk needs K/C"),
    ("topk:0/4096", "topk K must be an integer in [1, 4096]"),
    ("topk:64/70000", "topk chunk C must be an integer in [1, 65536]"),
    ("randk:8/64+rice", "only applies to topk"),
    ("topk:64/8192+idx12", "chunk must be <= 4096"),
    ("ef", "ef takes one argument"),
    ("ef:1.5", "ef decay must be in (0, 1]"),
    ("ef:abc", "ef decay must be a number"),
    ("zstd:99", "zstd level must be an integer in [1, 19]"),
    ("q4:100", "power of two"),
    ("fp16:3", "fp16 takes no arguments"),
])
def test_bad_specs_say_what_is_allowed(text, message):
    with pytest.raises(ValueError) as info:
        parse(text)
    assert message in str(info.value)


@pytest.mark.parametrize("spec, bound", [
    ("fp32", 0.0), ("fp16", 1e-3), ("bf16+zstd", 5e-3), ("q8+zstd", 0.02), ("e3m0", 0.3), ("s4", 0.15),
])
def test_dense_round_trip_error(spec, bound):
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(1))
    p = Pipeline(spec)
    d = p.decode(p.encode(x), x.numel())
    assert d.indices is None
    assert float((x - d.values).norm() / x.norm()) <= bound


def test_topk_keeps_the_largest_and_randk_sends_no_indices():
    x = torch.randn(3 * 4096 + 100, generator=torch.Generator().manual_seed(2))
    topk = Pipeline("topk:64/4096+fp32")
    d = topk.decode(topk.encode(x), x.numel())
    assert d.indices is not None and d.indices.numel() == 64 * 3 + 64
    assert torch.equal(d.values, x[d.indices])  # fp32 values are exact
    chunk = x[:4096].abs()
    assert set(d.indices[:64].tolist()) == set(chunk.topk(64).indices.tolist())
    randk = Pipeline("randk:64/4096+fp16")
    payload = randk.encode(x)
    assert len(payload) == 8 + 2 * (64 * 3 + 64)  # a seed and the values; no indices
    r = randk.decode(payload, x.numel())
    assert torch.allclose(r.values, x[r.indices], rtol=1e-3)


@pytest.mark.parametrize("spec", ["fp16", "e3m0", "q8+zstd", "topk:64/4096+s2", "randk:64/4096+fp16+zstd"])
def test_any_float_dtype_and_layout_encodes_to_the_bytes_of_its_fp32_values(monkeypatch, spec):
    """bf16 parameters, a strided view: the bytes are those of the same values as a contiguous fp32 vector
    (a GPU tensor too, where sparse pipelines select before copying to the host: tests/test_gpu.py)."""
    import diloco.compression.pipeline as module

    monkeypatch.setattr(module.os, "urandom", lambda n: bytes(range(7, 7 + n)))  # rand-k's seed, fixed
    x = torch.randn(2, 3 * 4096 + 100, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    pipe = Pipeline(spec)
    as_fp32 = x[1].float().contiguous()
    assert pipe.encode(x[1]) == pipe.encode(as_fp32)  # bf16
    assert pipe.encode(x.float().t().contiguous().t()[1]) == pipe.encode(as_fp32)  # a strided fp32 view


def test_zstd_bomb_is_rejected_without_inflating():
    """The decoder stops at the payload's size cap: the memory it took (traced, so the process's earlier peak
    cannot hide it) stays far below the 512 MiB the bomb would inflate to."""
    p = Pipeline("q8+zstd")
    numel = 1000
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (512 << 20))  # 512 MiB of zeros, ~16 KiB
    tracemalloc.start()
    try:
        with pytest.raises(PayloadRejected) as info:
            p.decode(bomb, numel)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.reason is Reason.OVERSIZED
    assert peak < 16 << 20, peak


def test_topk_section_lengths_are_checked():
    p = Pipeline("topk:8/64+fp16")
    payload = bytearray(p.encode(torch.randn(256)))
    payload[0:4] = (10**6).to_bytes(4, "little")  # index section longer than the payload
    with pytest.raises(PayloadRejected) as info:
        p.decode(bytes(payload), 256)
    assert info.value.reason is Reason.TRUNCATED


_FUZZ_SPECS = ["q8+zstd", "topk:8/64+s2", "topk:8/64+q4+idx12+zstd", "randk:8/64+e3m0", "s2"]


@pytest.mark.parametrize("spec", _FUZZ_SPECS)
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_decode_fuzz_rejects_or_returns_valid(spec, data):
    p = Pipeline(spec)
    numel = data.draw(st.integers(0, 600))
    if data.draw(st.booleans()):
        raw = bytearray(p.encode(torch.randn(numel, generator=torch.Generator().manual_seed(numel))))
        for _ in range(data.draw(st.integers(1, 4))):
            if raw:
                raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        cut = data.draw(st.integers(0, len(raw)))
        raw = raw[:cut] if data.draw(st.booleans()) else raw
    else:
        raw = bytearray(data.draw(st.binary(max_size=512)))
    try:
        d = p.decode(bytes(raw), numel)
    except PayloadRejected:
        return
    dense = d.dense(numel)
    assert dense.dtype == torch.float32 and dense.numel() == numel and bool(torch.isfinite(dense).all())
    if d.indices is not None:
        assert d.indices.numel() == d.values.numel()
        assert bool((d.indices[1:] > d.indices[:-1]).all()) and (d.indices.numel() == 0 or int(d.indices.max()) < numel)


def test_encode_view_is_the_encoding_in_the_tensors_own_memory_where_that_is_the_encoding():
    t = torch.randn(1000)
    fp32 = Pipeline("fp32")
    view = fp32.encode_view(t)
    assert fp32.exact and isinstance(view, memoryview) and bytes(view) == fp32.encode(t)
    t[0] = 7.0  # the view is the tensor's memory: valid only while the tensor is unchanged
    assert bytes(view[:4]) == torch.tensor([7.0]).numpy().tobytes()
    assert torch.equal(fp32.decode(fp32.encode_view(t), 1000).values, t)  # exact: the very values back
    for spec in ("q8", "fp32+zstd:3", "topk:8/64+fp32"):  # another encoding: never a view of the tensor
        p = Pipeline(spec)
        view, parts = p.encode_view(t), p.encode_parts([t])
        expected = bytes(view)
        assert bytes(parts) == expected == p.encode(t)
        t[0] += 1.0
        assert bytes(view) == bytes(parts) == expected  # the payload outlives a change of the tensor
        assert p.exact == (spec == "fp32+zstd:3")
    # q8's payload is the buffer its encoder wrote (no copy into a new bytes), read-only
    assert isinstance(Pipeline("q8").encode_view(t), memoryview) and Pipeline("q8").encode_view(t).readonly
    assert isinstance(Pipeline("q8").encode(t), bytes)
    assert isinstance(fp32.encode_view(t[::2]), bytes)  # not contiguous: encoded as usual


@pytest.mark.parametrize("spec", ["fp32", "q8", "fp32+zstd:3", "topk:8/64+fp32"])
def test_decode_into_writes_what_decode_gives(spec):
    t = torch.randn(640)
    p = Pipeline(spec)
    payload = p.encode(t)
    out = torch.full((640,), 5.0)
    assert p.decode_into(payload, 640, out) is out
    assert torch.equal(out, p.decode(payload, 640).dense(640))
    with pytest.raises(PayloadRejected):
        p.decode_into(payload[:-4] if spec == "fp32" else b"\x00" * 7, 640, out)  # a payload that does not fit


@pytest.mark.parametrize("spec", ["fp32", "q8", "fp32+zstd:3"])
def test_encode_parts_is_the_encoding_of_their_concatenation(spec):
    p = Pipeline(spec)
    t = torch.randn(1000)
    parts = [t[:300], t[300:301], t[301:]]
    assert p.encode_parts(parts) == p.encode(t)  # joined bytes (fp32), or the concatenation encoded
    assert p.encode_parts([t]) == p.encode(t)
