"""Unit tests for diloco.compression: codecs, the wire frame, and typed rejection.

The contract under test: well-formed input round-trips exactly (or within the
codec's documented bound); every malformed input raises PayloadRejected with the
specific Reason for its first defect -- and no other exception type, ever.
"""

from __future__ import annotations

import ast
import math
import random
import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.compression import (
    CODECS,
    PROTOCOL_VERSION,
    Codec,
    Header,
    PayloadRejected,
    Reason,
    decode_body,
    get_codec,
    pack,
    unpack,
)
from diloco.compression.frame import DEFAULT_MAX_HEADER, MAGIC

pytestmark = pytest.mark.unit

FUZZ = settings(
    max_examples=3000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Secondary fuzzers (beyond the 3000-example ones the contract asks for) run fewer
# examples to keep this file well under 15 s.
FUZZ_LIGHT = settings(FUZZ, max_examples=400)
MAX_BODY = 1 << 20

# --------------------------------------------------------------------------- helpers


def valid_fields(**overrides: Any) -> dict[str, Any]:
    """A complete, valid header map for a 4-byte body b'\\x01\\x02\\x03\\x04'."""
    body = b"\x01\x02\x03\x04"
    fields: dict[str, Any] = {
        "kind": "grad",
        "run": "run-0",
        "schema": "abc123",
        "round": 3,
        "fragment": 0,
        "view": "v1",
        "span": 0,
        "sender": "peer-a",
        "codec": "fp32",
        "numel": 1,
        "body_len": len(body),
        "crc32": zlib.crc32(body),
        "meta": {},
    }
    fields.update(overrides)
    return fields


def raw_frame(
    header: Any,
    body: bytes = b"\x01\x02\x03\x04",
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    header_len: int | None = None,
) -> bytes:
    """Assemble a frame by hand, bypassing pack()'s validation."""
    header_bytes = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    length = len(header_bytes) if header_len is None else header_len
    return magic + struct.pack("<BI", version, length) + header_bytes + body


def good_frame() -> bytes:
    return pack(kind="grad", run="run-0", round=3, view="v1", span=0, sender="peer-a",
                codec="fp32", numel=1, body=b"\x01\x02\x03\x04")


def rejected(data: bytes, **kwargs: Any) -> Reason:
    kwargs.setdefault("max_body", MAX_BODY)
    with pytest.raises(PayloadRejected) as info:
        unpack(data, **kwargs)
    assert isinstance(info.value.reason, Reason)
    return info.value.reason


def bits(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


# --------------------------------------------------------------------------- errors


def test_reasons_are_lower_snake_strings() -> None:
    assert len(Reason) == 19
    for reason in Reason:
        assert reason.value == reason.name.lower()
        assert reason == reason.value


def test_payload_rejected_str_and_attributes() -> None:
    err = PayloadRejected(Reason.BAD_CHECKSUM, "crc32 mismatch")
    assert err.reason is Reason.BAD_CHECKSUM
    assert err.detail == "crc32 mismatch"
    assert str(err) == "payload rejected (bad_checksum): crc32 mismatch"


def test_package_is_self_contained_and_pickle_free() -> None:
    package = Path(__file__).resolve().parents[1] / "compression"
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, f"{source.name} imports from outside the package"
                modules = [node.module or ""] if node.level == 0 else []
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                root = module.split(".")[0]
                assert root not in {"diloco", "pickle", "cPickle", "dill", "cloudpickle"}, (source.name, module)


# --------------------------------------------------------------------------- codecs


def test_codec_registry() -> None:
    assert CODECS == ("fp32", "fp16")
    for name in CODECS:
        codec = get_codec(name)
        assert isinstance(codec, Codec) and codec.name == name
    assert get_codec("fp32").bits_per_value == 32.0
    assert get_codec("fp16").bits_per_value == 16.0
    assert get_codec("fp16").encoded_size(10) == 20
    with pytest.raises(ValueError, match=r"^unknown wire codec 'x'; choose one of: fp32, fp16$"):
        get_codec("x")


def test_fp32_round_trip_is_exact() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(1000, generator=g) * torch.logspace(-30, 30, 1000)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, 3.4028235e38])
    t = torch.cat([t, specials])
    codec = get_codec("fp32")
    payload = codec.encode(t)
    assert len(payload) == codec.encoded_size(t.numel()) == 4 * t.numel()
    out = codec.decode(payload, t.numel())
    assert out.dtype == torch.float32 and out.shape == t.shape
    assert bits(out) == bits(t)


def test_fp16_round_trip_relative_error_bound() -> None:
    # Bound: round-to-nearest into an 11-bit significand => |x' - x| <= 2**-11 * |x|
    # for |x| in fp16's normal range [2**-14, 65504].
    g = torch.Generator().manual_seed(1)
    exponents = torch.empty(20000).uniform_(-14.0, math.log2(65504.0), generator=g)
    signs = torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0)
    t = (signs * torch.exp2(exponents)).clamp(-65504.0, 65504.0)
    codec = get_codec("fp16")
    out = codec.decode(codec.encode(t), t.numel())
    rel = ((out.double() - t.double()).abs() / t.double().abs()).max().item()
    assert rel <= 2.0**-11


def test_fp16_subnormal_absolute_error_bound() -> None:
    t = torch.linspace(-(2.0**-14), 2.0**-14, 4097)
    codec = get_codec("fp16")
    out = codec.decode(codec.encode(t), t.numel())
    assert (out.double() - t.double()).abs().max().item() <= 2.0**-25


def test_fp16_clamps_finite_and_keeps_non_finite() -> None:
    t = torch.tensor([1e6, -1e6, 65519.0, 3.4e38, math.inf, -math.inf, math.nan, 0.5])
    codec = get_codec("fp16")
    out = codec.decode(codec.encode(t), t.numel())
    assert out[:4].tolist() == [65504.0, -65504.0, 65504.0, 65504.0]
    assert out[4].item() == math.inf and out[5].item() == -math.inf
    assert math.isnan(out[6].item()) and out[7].item() == 0.5


def test_codec_golden_bytes_little_endian() -> None:
    t = torch.tensor([1.0, -2.5, 3.25])
    assert get_codec("fp32").encode(t).hex() == "0000803f000020c000005040"
    assert get_codec("fp16").encode(t).hex() == "003c00c18042"


def test_fp16_nan_payloads_decode_to_one_canonical_nan() -> None:
    payload = bytes.fromhex("017c" "00fe" "ffff" "007e" "ff7f")
    out = get_codec("fp16").decode(payload, 5)
    assert out.numpy().view("<u4").tolist() == [0x7FC00000] * 5


def test_fp32_nan_payload_bits_preserved() -> None:
    payload = bytes.fromhex("0100807f" "ffffffff" "0000c07f")
    out = get_codec("fp32").decode(payload, 3)
    assert out.numpy().astype("<f4").tobytes() == payload


@pytest.mark.parametrize("name", CODECS)
def test_decode_copies_and_checks_size(name: str) -> None:
    codec = get_codec(name)
    buffer = bytearray(codec.encode(torch.arange(8, dtype=torch.float32)))
    out = codec.decode(memoryview(buffer), 8)
    buffer[:] = bytes(len(buffer))  # scribbling on the receive buffer ...
    assert out.tolist() == [float(i) for i in range(8)]  # ... must not reach the tensor
    out += 1.0  # the tensor is writable, not a read-only view
    for numel in (7, 9, -1, 10**18):
        with pytest.raises(PayloadRejected) as info:
            codec.decode(bytes(buffer), numel)
        assert info.value.reason is Reason.WRONG_SIZE
    assert codec.decode(b"", 0).shape == (0,)


def test_encode_rejects_misuse() -> None:
    codec = get_codec("fp32")
    with pytest.raises(TypeError):
        codec.encode(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError):
        codec.encode(torch.zeros(2, 2))
    assert codec.encode(torch.zeros(6)[::2]) == bytes(12)  # non-contiguous is fine


def test_decode_body_unknown_codec_is_rejected() -> None:
    with pytest.raises(PayloadRejected) as info:
        decode_body("bf13", b"", 0)
    assert info.value.reason is Reason.BAD_DTYPE
    assert decode_body("fp16", b"\x00\x3c", 1).tolist() == [1.0]


@FUZZ
@given(name=st.sampled_from(CODECS), payload=st.binary(max_size=1024),
       numel=st.one_of(st.integers(-5, 3000), st.just(-(2**70)), st.just(2**70), st.none()))
def test_fuzz_codec_decode(name: str, payload: bytes, numel: int | None) -> None:
    codec = get_codec(name)
    width = codec.encoded_size(1)
    if numel is None:  # aim at the success path too
        payload = payload[: len(payload) - len(payload) % width]
        numel = len(payload) // width
    try:
        out = codec.decode(payload, numel)
    except PayloadRejected as err:
        assert err.reason is Reason.WRONG_SIZE
        return
    assert out.dtype == torch.float32 and out.shape == (numel,)
    assert bits(codec.decode(payload, numel)) == bits(out)  # deterministic
    if name == "fp32":
        assert codec.encode(out) == payload


@FUZZ_LIGHT
@given(name=st.text(max_size=8), payload=st.binary(max_size=64), numel=st.integers(-4, 40))
def test_fuzz_decode_body(name: str, payload: bytes, numel: int) -> None:
    try:
        decode_body(name, payload, numel)
    except PayloadRejected:
        pass


# --------------------------------------------------------------------------- frame


def test_frame_golden_bytes() -> None:
    # A change here means a PROTOCOL_VERSION bump: these are the exact wire bytes.
    frame = pack(kind="result", run="run-0", schema="5e1f", round=7, fragment=2, view="view-3", span=1,
                 sender="peer-a", codec="fp32", numel=3, body=bytes.fromhex("0000803f000020c000005040"),
                 meta={"final": True, "contributors": [0, 1, 4]})
    assert frame.hex() == (
        "444c433106990000008da46b696e64a6726573756c74a372756ea572756e2d30a6736368656d61"
        "a435653166a5726f756e6407a8667261676d656e7402a476696577a6766965772d33a47370616e"
        "01a673656e646572a6706565722d61a5636f646563a466703332a56e756d656c03a8626f64795f"
        "6c656e0ca56372633332ce4e863144a46d65746182ac636f6e7472696275746f727393000104a5"
        "66696e616cc30000803f000020c000005040"
    )


def test_frame_round_trip() -> None:
    body = get_codec("fp16").encode(torch.tensor([0.5, -1.0]))
    frame = pack(kind="grad", run="r", round=0, sender="s", codec="fp16", numel=2, body=body,
                 meta={"n": -3, "x": 0.25, "s": "é", "b": False, "ids": [1, 2**64 - 1, -(2**63)]})
    header, payload = unpack(frame, max_body=64, expect_run="r", expect_kind="grad")
    assert header == Header(kind="grad", run="r", schema="", round=0, fragment=0, view="", span=-1, sender="s", codec="fp16",
                            numel=2, body_len=4, crc32=zlib.crc32(body),
                            meta={"b": False, "ids": [1, 2**64 - 1, -(2**63)], "n": -3, "s": "é", "x": 0.25})
    assert isinstance(payload, memoryview) and bytes(payload) == body
    assert decode_body(header.codec, payload, header.numel).tolist() == [0.5, -1.0]
    empty_header, empty = unpack(pack(kind="k", run="r", round=1, sender="s"), max_body=0)
    assert empty_header.body_len == 0 and empty.nbytes == 0


@pytest.mark.parametrize(
    "overrides",
    [{"round": -1}, {"round": True}, {"span": -2}, {"kind": 3}, {"meta": {"x": {"nested": 1}}},
     {"meta": {"x": [1.5]}}, {"meta": {"x": 2**64}}],
)
def test_pack_rejects_invalid_fields_with_value_error(overrides: dict[str, Any]) -> None:
    args: dict[str, Any] = {"kind": "k", "run": "r", "round": 0, "sender": "s"}
    args.update(overrides)
    with pytest.raises(ValueError):
        pack(**args)


def test_pack_rejects_oversized_header() -> None:
    with pytest.raises(ValueError, match="header"):
        pack(kind="k", run="r", round=0, sender="s", meta={"ids": list(range(DEFAULT_MAX_HEADER))})


# One test per check of unpack(), in the order unpack() performs them.


def test_unpack_truncated_prefix() -> None:
    assert rejected(good_frame()[:8]) is Reason.TRUNCATED
    assert rejected(b"") is Reason.TRUNCATED


def test_unpack_bad_magic() -> None:
    assert rejected(b"DLC2" + good_frame()[4:]) is Reason.BAD_MAGIC


def test_unpack_bad_version() -> None:
    assert rejected(raw_frame(valid_fields(), version=PROTOCOL_VERSION + 1)) is Reason.BAD_VERSION


def test_unpack_oversized_header() -> None:
    assert rejected(raw_frame(valid_fields(), header_len=DEFAULT_MAX_HEADER + 1)) is Reason.OVERSIZED
    assert rejected(good_frame(), max_header=16) is Reason.OVERSIZED


def test_unpack_truncated_header() -> None:
    assert rejected(raw_frame(valid_fields(), body=b"", header_len=60000)) is Reason.TRUNCATED


@pytest.mark.parametrize(
    "header",
    [
        b"\xc1" * 10,  # 0xc1 is never valid msgpack
        msgpack.packb(valid_fields()) + b"\x00",  # extra data after the map
        msgpack.packb([1, 2, 3]),  # not a map
        b"\x91" * 60000,  # nesting deeper than msgpack's stack
        b"\xdc\xff\xff",  # claims a 65535-element array (over max_array_len)
        b"\xdb\xff\xff\xff\xff",  # claims a 4 GiB string
        b"\xc6\x00\x00\x00\x01a",  # bin type: never used in headers
        b"\xd6\xff\x00\x00\x00\x00",  # ext type (timestamp)
        b"\x81\x01\x02",  # non-string map key
        b"\xa2\xff\xfe",  # invalid UTF-8
    ],
    ids=["invalid", "extra-data", "not-a-map", "deep", "huge-array", "huge-str", "bin", "ext", "int-key", "utf8"],
)
def test_unpack_header_not_msgpack(header: bytes) -> None:
    assert rejected(raw_frame(header)) is Reason.BAD_HEADER


def test_unpack_missing_field() -> None:
    fields = valid_fields()
    del fields["crc32"]
    with pytest.raises(PayloadRejected, match="missing field 'crc32'") as info:
        unpack(raw_frame(fields), max_body=MAX_BODY)
    assert info.value.reason is Reason.BAD_HEADER


def test_unpack_unexpected_field() -> None:
    assert rejected(raw_frame(valid_fields(extra=1))) is Reason.BAD_HEADER


@pytest.mark.parametrize(
    "overrides",
    [{"round": "3"}, {"round": True}, {"run": b"run-0"}, {"numel": 1.0}, {"meta": []}, {"schema": 5},
     {"fragment": -1}, {"fragment": False},
     {"meta": {"x": None}}, {"meta": {"x": [True]}}, {"crc32": -1}],
)
def test_unpack_wrong_type(overrides: dict[str, Any]) -> None:
    assert rejected(raw_frame(valid_fields(**overrides))) is Reason.BAD_HEADER


def test_unpack_negative_round() -> None:
    with pytest.raises(PayloadRejected, match="round") as info:
        unpack(raw_frame(valid_fields(round=-1)), max_body=MAX_BODY)
    assert info.value.reason is Reason.BAD_HEADER
    assert rejected(raw_frame(valid_fields(span=-2))) is Reason.BAD_HEADER


def test_unpack_wrong_schema() -> None:
    frame = pack(kind="k", run="r", schema="aaaa", round=0, sender="s")
    with pytest.raises(PayloadRejected) as info:
        unpack(frame, max_body=0, expect_schema="bbbb")
    assert info.value.reason is Reason.WRONG_SCHEMA
    assert unpack(frame, max_body=0, expect_schema="aaaa")[0].schema == "aaaa"


def test_unpack_oversized_body_checked_before_allocation() -> None:
    frame = raw_frame(valid_fields(body_len=10**12))
    assert rejected(frame, max_body=MAX_BODY) is Reason.OVERSIZED
    # Even with a limit that admits it, the claim is compared to the bytes present,
    # never allocated: a short body is TRUNCATED, not a MemoryError.
    assert rejected(frame, max_body=10**13) is Reason.TRUNCATED


def test_unpack_truncated_body() -> None:
    assert rejected(good_frame()[:-1]) is Reason.TRUNCATED


def test_unpack_trailing_bytes() -> None:
    assert rejected(good_frame() + b"\x00") is Reason.WRONG_SIZE


def test_unpack_bad_checksum() -> None:
    frame = bytearray(good_frame())
    frame[-1] ^= 0x01
    assert rejected(bytes(frame)) is Reason.BAD_CHECKSUM


def test_unpack_wrong_run() -> None:
    assert rejected(good_frame(), expect_run="run-1") is Reason.WRONG_RUN


def test_unpack_wrong_kind() -> None:
    assert rejected(good_frame(), expect_kind="result") is Reason.WRONG_KIND


# --------------------------------------------------------------------------- frame fuzzing


def check_unpack_total(data: bytes) -> None:
    """unpack() returns a consistent (Header, body) or raises PayloadRejected."""
    try:
        header, body = unpack(data, max_body=MAX_BODY)
    except PayloadRejected as err:
        assert isinstance(err.reason, Reason)
        return
    assert isinstance(header, Header)
    assert body.nbytes == header.body_len and zlib.crc32(body) == header.crc32


@FUZZ
@given(data=st.binary(max_size=4096))
def test_fuzz_unpack_arbitrary_bytes(data: bytes) -> None:
    check_unpack_total(data)


@FUZZ_LIGHT
@given(header_len=st.integers(0, 300), rest=st.binary(max_size=512))
def test_fuzz_unpack_arbitrary_bytes_after_valid_prefix(header_len: int, rest: bytes) -> None:
    check_unpack_total(MAGIC + struct.pack("<BI", PROTOCOL_VERSION, header_len) + rest)


msgpack_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
    st.binary(max_size=4),
)
msgpack_value = st.recursive(
    msgpack_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)


@FUZZ_LIGHT
@given(base=st.just(valid_fields()), changes=st.dictionaries(
    st.sampled_from([*valid_fields(), "extra"]), msgpack_value, max_size=3),
    dropped=st.sets(st.sampled_from(list(valid_fields())), max_size=2))
def test_fuzz_unpack_structured_headers(base: dict[str, Any], changes: dict[str, Any], dropped: set[str]) -> None:
    fields = {**base, **changes}
    for key in dropped:
        fields.pop(key, None)
    check_unpack_total(raw_frame(fields))


def random_frame_fields(rng: random.Random) -> dict[str, Any]:
    """Valid pack() arguments from a seeded Random: far cheaper per example than
    composite hypothesis strategies, which lets the fuzzer afford 3000 runs."""
    words = ["", "grad", "run-0", "é", "x" * 40, "peer-QmYwAPJzv5CZsnA"]
    meta_values: list[Any] = [0, -1, 2**64 - 1, -(2**63), 0.5, math.nan, math.inf, "s", True, [], [1, 2, 2**32]]
    return {
        "kind": rng.choice(words), "run": rng.choice(words), "view": rng.choice(words),
        "sender": rng.choice(words), "codec": rng.choice(["", *CODECS]),
        "round": rng.choice([0, 1, rng.randrange(2**63)]), "span": rng.randrange(-1, 2**40),
        "numel": rng.randrange(10**6),
        "meta": {rng.choice(words): rng.choice(meta_values) for _ in range(rng.randrange(4))},
        "body": rng.randbytes(rng.choice([0, 1, 4, rng.randrange(256)])),
    }


MUTATIONS = ("flip", "byte", "truncate", "extend", "insert", "delete")


@FUZZ
@given(seed=st.integers(0, 2**64 - 1))
def test_fuzz_unpack_mutated_frames(seed: int) -> None:
    rng = random.Random(seed)  # a failure report's seed reproduces the exact frame
    fields = random_frame_fields(rng)
    frame = bytearray(pack(**fields))
    header, body = unpack(bytes(frame), max_body=MAX_BODY)  # the unmutated frame is valid
    assert bytes(body) == fields["body"] and header.round == fields["round"]
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(MUTATIONS)
        pos = rng.randrange(len(frame)) if frame else 0
        if op == "flip" and frame:
            frame[pos] ^= 1 << rng.randrange(8)
        elif op == "byte" and frame:
            frame[pos] = rng.randrange(256)
        elif op == "truncate":
            del frame[pos:]
        elif op == "extend":
            frame += rng.randbytes(rng.randint(1, 16))
        elif op == "insert":
            frame[pos:pos] = rng.randbytes(rng.randint(1, 4))
        elif op == "delete":
            del frame[pos : pos + rng.randint(1, 4)]
    check_unpack_total(bytes(frame))


def test_unpack_accepts_bytearray_and_memoryview_without_copy() -> None:
    frame = bytearray(good_frame())
    _, body = unpack(memoryview(frame), max_body=MAX_BODY)
    frame[-1] ^= 0xFF
    assert body[-1] == frame[-1]  # the body is a zero-copy view of the input
    with pytest.raises(PayloadRejected):
        unpack(np.frombuffer(bytes(frame), dtype=np.uint8).data, max_body=MAX_BODY)
