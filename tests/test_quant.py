"""Unit tests for diloco.compression.quant (dense value quantizers) and .bits.

The contract under test:

* every quantizer round-trips within its *stated* error bound (checked per element
  against the scales the payload itself carries), on inputs chosen to hurt: single
  elements, all zeros, constant tensors, one huge outlier per block, magnitudes from
  subnormal to FLT_MAX, and tensors spanning several processing chunks;
* stochastic rounding is unbiased (and the same test fails for deterministic rounding);
* the wire bytes are pinned (golden hex);
* decoding any bytes with any numel returns a finite fp32 tensor of length numel or
  raises PayloadRejected -- nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.compression import Codec, PayloadRejected, Reason, blockscale, codecs
from diloco.compression.bits import (
    SUPPORTED_BITS,
    pack_bits,
    pack_bits_tensor,
    packed_size,
    padding_bits_clear,
    unpack_bits,
    unpack_bits_tensor,
)
from diloco.compression.quant import (
    BF16_MAX,
    FLT_MAX,
    QUANTIZERS,
    BlockQuantCodec,
    E3M0Codec,
    Fp8Codec,
    StatCodec,
    make_quantizer,
)

pytestmark = pytest.mark.unit

SPECS = [
    "bf16", "q8:256", "q4:16", "q2:64", "q8:16:sr", "q4:256:sr", "q2:16:sr",
    "s4", "s2", "fp8:256", "fp8:16", "e3m0:0", "e3m0:16", "e3m0:0:sr", "e3m0:32:sr",
]
# One spec per distinct decoder layout (SR changes only the encoder).
FUZZ_SPECS = ["bf16", "q8:16", "q4:32", "q2:16", "s4", "s2", "fp8:16", "e3m0:0", "e3m0:16"]

PROPERTY = settings(max_examples=80, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ = settings(PROPERTY, max_examples=2000)

TINY = 2.0**-140  # absolute slack for fp32 rounding in the subnormal range


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    # These tests run thousands of tiny encodes; torch's intra-op thread pool only adds
    # wake-up latency to them (and stalls badly on a busy machine), so use one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def codec(spec: str) -> Codec:
    return make_quantizer(spec, seed=12345)


# --------------------------------------------------------------------------- inputs

KINDS = ("gauss", "zeros", "constant", "outlier", "wide", "extreme", "sparse", "ties")


def make_input(numel: int, kind: str, seed: int) -> torch.Tensor:
    """A float32 test tensor of a given character, from a seed."""
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        x = rng.standard_normal(numel) * 10.0 ** rng.uniform(-20, 20)
    elif kind == "zeros":
        x = np.where(rng.random(numel) < 0.5, 0.0, -0.0)
    elif kind == "constant":
        x = np.full(numel, rng.standard_normal() * 10.0 ** rng.uniform(-10, 10))
    elif kind == "outlier":  # a block with one value a million times its neighbours
        x = rng.standard_normal(numel) * 1e-3
        x[rng.integers(numel)] = rng.choice([-1.0, 1.0]) * 1e3
    elif kind == "wide":  # magnitudes from fp32's subnormals to near its maximum
        x = rng.choice([-1.0, 1.0], numel) * 10.0 ** rng.uniform(-44, 38, numel)
    elif kind == "extreme":
        pool = np.array([FLT_MAX, -FLT_MAX, 1e-45, -1e-45, 0.0, 1.0, -3e38, 1e30, 1e-38], dtype=np.float64)
        x = rng.choice(pool, numel)
    elif kind == "sparse":
        x = rng.standard_normal(numel) * (rng.random(numel) < 0.1)
    else:  # "ties": small half-integers, which land exactly on rounding ties
        x = rng.integers(-16, 17, numel) / 2.0
    return torch.from_numpy(np.clip(x, -FLT_MAX, FLT_MAX).astype(np.float32))


inputs = st.builds(
    make_input,
    numel=st.one_of(st.integers(1, 40), st.integers(1, 5000)),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**32 - 1),
)


# --------------------------------------------------------------------------- bound checks


def per_element(values: np.ndarray, block: int, numel: int) -> np.ndarray:
    return np.repeat(values.astype(np.float64), block)[:numel]


def block_absmax(x: np.ndarray, block: int) -> np.ndarray:
    pad = (-x.size) % block
    rows = np.abs(np.concatenate([x.astype(np.float64), np.zeros(pad)])).reshape(-1, block)
    return rows.max(axis=1)


def header(payload: bytes, count: int) -> np.ndarray:
    return np.frombuffer(payload, dtype="<f4", count=count).astype(np.float64)


def check_round_trip(spec: str, t: torch.Tensor) -> None:
    """Encode/decode ``t`` and assert the codec's documented per-element bound."""
    c = codec(spec)
    payload = c.encode(t)
    n = t.numel()
    assert len(payload) == c.encoded_size(n)
    out = c.decode(payload, n)
    assert out.dtype == torch.float32 and out.shape == (n,)
    assert torch.isfinite(out).all()
    x, y = t.double().numpy(), out.double().numpy()
    ax, err = np.abs(x), np.abs(x - y)
    if isinstance(c, BlockQuantCodec):
        check_block_quant(c, payload, x, y, err)
    elif isinstance(c, Fp8Codec):
        # s = absmax/448; e4m3 keeps 3 mantissa bits: relative error <= 2**-4 where
        # |x| >= 2**-6 s (normal range), absolute <= 2**-10 s (half a subnormal step) below.
        s = per_element(header(payload, -(-n // c.block)), c.block, n)
        amax = per_element(block_absmax(x, c.block), c.block, n)
        slack = 2.0**-22 * amax + TINY
        normal = ax >= 2.0**-6 * s
        assert (err[normal] <= 2.0**-4 * ax[normal] + slack[normal]).all()
        assert (err[~normal] <= 2.0**-10 * s[~normal] + slack[~normal]).all()
    elif isinstance(c, E3M0Codec):
        check_e3m0(c, payload, x, y, err)
    elif isinstance(c, StatCodec):
        # Every decoded value is a centroid from the table; centroids are means of
        # input values, so they lie within the input's range; and reconstructing each
        # bin by its mean is never worse than replacing every value by the global mean.
        table = header(payload, c.levels)
        assert np.isin(y, table).all()
        lo, hi = x.min(), x.max()
        assert (y >= lo - 2.0**-23 * abs(lo) - TINY).all() and (y <= hi + 2.0**-23 * abs(hi) + TINY).all()
        rounding = math.sqrt(n) * 2.0**-23 * ax.max()
        assert np.sqrt(((x - y) ** 2).sum()) <= np.sqrt(((x - x.mean()) ** 2).sum()) * (1 + 1e-9) + rounding + TINY
    else:  # bf16: round-to-nearest-even into an 8-bit significand
        normal = ax >= 2.0**-126
        assert (err[normal] <= 2.0**-8 * ax[normal]).all()
        assert (err[~normal] <= 2.0**-134).all()
        inside = ax <= BF16_MAX
        assert np.array_equal(y[inside], t[torch.from_numpy(inside)].to(torch.bfloat16).double().numpy())


def check_block_quant(c: BlockQuantCodec, payload: bytes, x: np.ndarray, y: np.ndarray, err: np.ndarray) -> None:
    # Bound: |x - x_hat| <= s/2 (s for stochastic rounding), s = absmax/qmax per block,
    # plus fp32 rounding of x/s and q*s (<= 2**-22 absmax), plus TINY for subnormal s.
    n = x.size
    scales = header(payload, -(-n // c.block))
    amax = block_absmax(x, c.block)
    expected = np.minimum(np.float32(amax) / np.float32(c.qmax), np.float32(c._max_scale))
    assert np.array_equal(scales, expected.astype(np.float64))  # the scale is what the docs say
    s, a = per_element(scales, c.block, n), per_element(amax, c.block, n)
    step = 1.0 if c.stochastic else 0.5
    assert (err <= step * s + 2.0**-22 * a + TINY).all()
    q = np.where(s > 0, y / np.where(s > 0, s, 1.0), 0.0)
    assert (np.abs(q) <= c.qmax * (1 + 1e-6)).all()
    if c.bits == 2:  # ternary
        assert np.isin(np.round(q), [-1.0, 0.0, 1.0]).all()


def check_e3m0(c: E3M0Codec, payload: bytes, x: np.ndarray, y: np.ndarray, err: np.ndarray) -> None:
    # Magnitudes {0, a*2**-6, ..., a/2, a}, a = absmax. Nearest rounding: relative error
    # <= 1/3 for |x| >= a*2**-6, absolute <= a*2**-7 below. Stochastic rounding picks one
    # of the two neighbours: error < |x| above a*2**-6, < a*2**-6 below.
    n = x.size
    block = c.block or n
    a = per_element(header(payload, -(-n // block)), block, n)
    assert np.array_equal(np.unique(a), np.unique(block_absmax(x, block)))
    ax, ay = np.abs(x), np.abs(y)
    slack = 2.0**-22 * a + TINY
    big = ax >= 2.0**-6 * a
    assert ((y == 0) | (np.sign(y) == np.sign(x))).all()
    levels = a[:, None] * np.concatenate([[0.0], 2.0 ** np.arange(-6, 1)])[None, :]
    if a.min() > 2.0**-100:  # away from fp32 subnormals, every value is exactly a level
        assert (np.abs(levels - ay[:, None]).min(axis=1) == 0).all()
    if c.stochastic:
        assert (err[big] <= ax[big] + slack[big]).all()
        assert (err[~big] <= 2.0**-6 * a[~big] + slack[~big]).all()
    else:
        assert (err[big] <= ax[big] / 3 + slack[big]).all()
        assert (err[~big] <= 2.0**-7 * a[~big] + slack[~big]).all()
        nearest = np.abs(levels - ax[:, None]).min(axis=1)
        assert (np.abs(ax - ay) <= nearest + slack).all()


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("spec", SPECS)
@PROPERTY
@given(t=inputs)
def test_round_trip_within_stated_bound(spec: str, t: torch.Tensor) -> None:
    check_round_trip(spec, t)


@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_across_chunks(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Codecs work through CHUNK values at a time; shrink CHUNK (still a multiple of every
    # block size) so that a small tensor spans 4 chunks, the last one short, with a
    # partial last block and an odd count.
    monkeypatch.setattr(blockscale, "CHUNK", 1 << 16)
    size = 3 * blockscale.CHUNK + 777
    g = torch.Generator().manual_seed(3)
    t = torch.randn(size, generator=g) * torch.rand(size, generator=g)
    t[blockscale.CHUNK - 1] = 50.0  # an outlier right at a chunk boundary
    check_round_trip(spec, t)
    c = codec(spec)
    if isinstance(c, BlockQuantCodec) and not c.stochastic:
        # ... and equals an unchunked reference: q = round_half_even(x / s), x_hat = q * s.
        x = t.numpy()
        s = np.repeat(header(c.encode(t), -(-x.size // c.block)).astype(np.float32), c.block)[: x.size]
        ref = (np.round(x / np.where(s > 0, s, np.float32(1))) * s).astype(np.float32)
        assert np.array_equal(c.decode(c.encode(t), x.size).numpy(), ref)


@pytest.mark.parametrize("spec", SPECS)
def test_the_device_path_writes_and_reads_the_bytes_of_the_host_path(spec: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU an encoder takes the whole tensor in one step and stages its codes beside it, and a decoder moves
    # the bytes there and looks them up there (codecs.whole); device_path() runs that path here. Deterministic
    # codecs must write the host path's bytes, also across several of the host's chunks with partial blocks and an
    # odd count; stochastic ones stay within their bound; decoding gives the host's values.
    monkeypatch.setattr(blockscale, "CHUNK", 1 << 16)
    g = torch.Generator().manual_seed(5)
    for size in (1, 7, 16, 1000, 3 * blockscale.CHUNK + 777):
        t = torch.randn(size, generator=g) * torch.rand(size, generator=g)
        host = codec(spec).encode(t)
        with device_path() as device:
            if ":sr" in spec:
                check_round_trip(spec, t)
            else:
                assert codec(spec).encode(t) == host, (spec, size)
            assert torch.equal(codec(spec).decode(host, size, device), codec(spec).decode(host, size))


@pytest.mark.parametrize("spec", SPECS)
def test_zeros_are_exact_and_constants_exact_where_the_table_holds_them(spec: str) -> None:
    c = codec(spec)
    zeros = torch.zeros(33)
    assert torch.equal(c.decode(c.encode(zeros), 33), zeros)
    if isinstance(c, (StatCodec, E3M0Codec)):  # the absmax / the centroid is sent as is
        for t in (torch.tensor([0.3]), torch.tensor([-7.0]), torch.full((100,), 0.1)):
            assert torch.equal(c.decode(c.encode(t), t.numel()), t)


@pytest.mark.parametrize("spec,bound", [("s4", 0.125), ("s2", 0.45)])
def test_stat_relative_l2_error_on_gaussian(spec: str, bound: float) -> None:
    # Measured 0.107-0.116 (s4) and 0.408-0.431 (s2) over seeds and sizes 1e3..1e5.
    c = codec(spec)
    for seed in range(3):
        t = torch.randn(100_000, generator=torch.Generator().manual_seed(seed)) * 0.01 + 0.001
        out = c.decode(c.encode(t), t.numel())
        assert ((out - t).norm() / t.norm()).item() <= bound


def test_e3m0_code_table() -> None:
    # Per-tensor scale a = 1: code = sign << 3 | e, |value| = 2**(e - 7) for e >= 1, 0 for e = 0.
    x = torch.tensor([1.0, -1.0, 0.5, 0.75, 0.74, -0.25, 2.0**-6, -(2.0**-7), 0.0077, -0.0, 0.3, 0.0])
    payload = codec("e3m0:0").encode(x)
    assert payload[:4] == np.float32(1.0).tobytes()
    nibbles = [b >> s & 15 for b in payload[4:] for s in (0, 4)]
    assert nibbles == [7, 15, 6, 7, 6, 13, 1, 9, 0, 0, 5, 0]
    # 0.75 ties up to 1; 0.74 goes down to 0.5; 2**-7 (between 0 and 2**-6) ties up; 0.0077 underflows.
    assert codec("e3m0:0").decode(payload, 12).tolist() == [
        1.0, -1.0, 0.5, 1.0, 0.5, -0.25, 2.0**-6, -(2.0**-6), 0.0, 0.0, 0.25, 0.0]


def test_fp8_is_ocp_e4m3fn() -> None:
    # Decoding uses torch's float8_e4m3fn: check it against the format's definition.
    codes = torch.arange(256, dtype=torch.uint8)
    got = codes.view(torch.float8_e4m3fn).float().tolist()
    for b, value in enumerate(got):
        sign, exp, man = -1.0 if b & 0x80 else 1.0, (b >> 3) & 15, b & 7
        if exp == 15 and man == 7:
            assert math.isnan(value)
        else:
            mag = man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
            assert value == sign * mag
    # A block's absmax maps exactly onto 448 (code 0x7e) and decodes back exactly.
    payload = codec("fp8:16").encode(torch.tensor([3.0, -3.0, 0.0]))
    assert payload[4:] == bytes([0x7E, 0xFE, 0x00]) and codec("fp8:16").decode(payload, 3).tolist() == [3.0, -3.0, 0.0]
    # With absmax 448 the scale is 1: ties round to an even mantissa, subnormals included.
    x = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 1.5 * 2.0**-9, 2.0**-10])
    payload = codec("fp8:16").encode(x)
    assert payload == np.float32(1.0).tobytes() + bytes([0x7E, 0x38, 0x3A, 0xB8, 0x02, 0x00])


# --------------------------------------------------------------------------- stochastic rounding


SR_DRAWS = 2000


def sr_mean(spec: str, x: torch.Tensor, seed: int) -> torch.Tensor:
    c = make_quantizer(spec, seed=seed)
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for _ in range(SR_DRAWS):
        total += c.decode(c.encode(x), x.numel()).double()
    return total / SR_DRAWS


def test_q4_stochastic_rounding_is_unbiased() -> None:
    s = float(np.float32(1.0) / np.float32(7))
    fractions = [-6.3, -5.7, -4.25, -3.6, -2.3, -1.75, -0.3, 0.3, 0.65, 1.4, 2.7, 3.25, 4.6, 5.35, 6.7]
    x = torch.tensor([1.0] + [f * s for f in fractions])  # absmax 1 -> scale s = 1/7
    # Each decode is s*floor(x/s) or s*ceil(x/s): variance <= s**2/4, so the mean of
    # 2000 draws has standard deviation <= s/(2*sqrt(2000)) ~ 0.0016; allow 5 of them.
    tol = 5 * s / (2 * math.sqrt(SR_DRAWS))
    mean = sr_mean("q4:16:sr", x, seed=11)
    assert (mean - x.double()).abs().max().item() <= tol
    # Deterministic rounding on the same input is off by >= 0.25 s > tol: the test can fail.
    det = codec("q4:16").decode(codec("q4:16").encode(x), x.numel())
    assert (det - x).abs()[1:].min().item() > tol


def test_e3m0_stochastic_rounding_is_unbiased() -> None:
    x = torch.tensor([1.0, -0.8, 0.6, -0.3, 0.2, 0.1, -0.09, 0.05, 0.04, -0.02, 0.012, 0.005, -0.002, 0.0])
    ax = x.double().abs()
    lo = torch.where(ax >= 2.0**-6, torch.exp2(torch.floor(torch.log2(ax.clamp(min=1e-30)))), 0.0)
    step = torch.where(ax >= 2.0**-6, lo, 2.0**-6)  # hi - lo of each value's bracket
    tol = 5 * step / (2 * math.sqrt(SR_DRAWS))
    mean = sr_mean("e3m0:0:sr", x, seed=5)
    assert ((mean - x.double()).abs() <= tol).all()
    det = codec("e3m0:0").decode(codec("e3m0:0").encode(x), x.numel()).double()
    assert ((det - x.double()).abs()[1:-1] > tol[1:-1]).all()  # nearest rounding is biased here


def test_stochastic_codecs_are_seeded_and_advance() -> None:
    x = torch.linspace(-1, 1, 200)
    a, b = make_quantizer("q4:16:sr", seed=1), make_quantizer("q4:16:sr", seed=1)
    first = a.encode(x)
    assert first == b.encode(x) and a.encode(x) != first  # same seed, same draws; state advances
    assert make_quantizer("q4:16:sr").encode(x) != make_quantizer("q4:16:sr").encode(x)  # os.urandom seeds
    with pytest.raises(ValueError, match="seed"):
        make_quantizer("e3m0:0:sr", seed=-1)


# --------------------------------------------------------------------------- golden bytes

GOLDEN = {  # spec: (hex of encode(linspace(-1, 1, 40)), sha256[:16] of the decoded fp32 bytes)
    "bf16": ("80bf73bf66bf59bf4bbf3ebf31bf24bf17bf0abff9bedfbec5beabbe90be6cbe38be03be9ebdd2bcd23c9e3d033e383e6c3e90"
             "3eab3ec53edf3ef93e0a3f173f243f313f3e3f4b3f593f663f733f803f", "481fb52bc6bd168e"),
    "q8:16": ("0402013cc429983b0402013c81888e959ba2a8afb5bcc2c9cfd6dce3d9e4effa06111c27323d4853"
              "5e69747f51585e656b72787f", "4f9644c126b961da"),
    "q4:16": ("2549123ec98aac3d2549123e99aabacbccddedeeee0f10223354657654656677", "c8b0c6234523cb25"),
    "q2:16": ("0000803f70f9163f0000803fffff0f00000050555555", "2d9506a31dc3a462"),
    "q4:16:sr": ("2549123ec98aac3d2549123e99aabbccccdcddeeeeff10223254657654556676", "e27849e5d793d8dc"),
    "q2:16:sr": ("0000803f70f9163f0000803fffcc330f000050545445", "45c339645837734c"),
    "s4": ("4436e6bf7c6fc9bfb3a8acbfebe18fbf5cbe65bfabaa2abfc44eecbec44e6cbe00000000c44e6c3ec44eec3eabaa2a3f5cbe653f"
           "ebe18f3fb3a8ac3f7c6fc93f44445455656676777788889999a9aababbcbcccc", "666309fd252eaf86"),
    "s2": ("4436e6bfe65b3ebf00000000e65b3e3f555595aaaaaaaafeffff", "27b15d66dea79a6b"),
    "fp8:16": ("2549123bc98aac3a2549123bfefdfdfcfbfafaf9f8f7f6f4f3f1f0edf1ece7da5a676c71737578797a"
               "7c7d7e797a7a7b7c7d7d7e", "ac625b1e8c2a73de"),
    "e3m0:0": ("0000803fffffefeeeeeededdccab32445565666666767777", "a8ac3f636bdf4ce1"),
    "e3m0:16": ("0000803f70f9163f0000803fffffefeeeeeededdddac42556666767766767777", "ad6c6d3aae19ca84"),
    "e3m0:0:sr": ("0000803fffffefefeeeeddddcd9b32445465656676667676", "197a439b53ec908c"),
}


@pytest.mark.parametrize("spec", list(GOLDEN))
def test_golden_bytes(spec: str) -> None:
    # A change here means a PROTOCOL_VERSION bump: these are the exact wire bytes, and
    # the digest pins what every receiver decodes from them. (The ":sr" encodings also
    # depend on torch's CPU generator stream for the given seed; a torch upgrade that
    # changes it changes only those hex strings, not the protocol -- their digests still
    # pin decoding.)
    payload_hex, digest = GOLDEN[spec]
    c = make_quantizer(spec, seed=1234)
    assert c.encode(torch.linspace(-1, 1, 40)).hex() == payload_hex
    out = c.decode(bytes.fromhex(payload_hex), 40)
    assert hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16] == digest


# --------------------------------------------------------------------------- registry and misuse


def test_registry_names_are_canonical() -> None:
    assert set(QUANTIZERS) == {"bf16", "q8", "q4", "q2", "s4", "s2", "fp8", "e3m0"}
    expected = {"bf16": "bf16", "q8": "q8:256", "q4": "q4:256", "q2": "q2:256", "q4:sr": "q4:256:sr",
                "q4:128:sr": "q4:128:sr", "q2:16": "q2:16", "s4": "s4", "s2": "s2", "fp8": "fp8:256",
                "fp8:1024": "fp8:1024", "e3m0": "e3m0:0", "e3m0:sr": "e3m0:0:sr", "e3m0:256": "e3m0:256"}
    for spec, name in expected.items():
        c = make_quantizer(spec)
        assert isinstance(c, Codec) and c.name == name
        assert make_quantizer(c.name).name == name  # the name is a spec that rebuilds it
    assert QUANTIZERS["q4"](["128", "sr"]).name == "q4:128:sr"
    assert codec("q4:16").bits_per_value == 6.0 and codec("s2").bits_per_value == 2.0
    assert codec("e3m0:0").bits_per_value == 4.0 and codec("fp8:256").bits_per_value == 8.125


@pytest.mark.parametrize("spec,message", [
    ("q4:100", "q4 block size must be a power of two between 16 and 65536, got 100"),
    ("q8:8", "power of two between 16 and 65536, got 8"),
    ("q2:131072", "got 131072"),
    ("q4:0", "got 0"),
    ("q4:0128", "got '0128'"),
    ("q4:+128", "got '\\+128'"),
    ("q4:abc", "got 'abc'"),
    ("q4:", "got ''"),
    ("q4:sr:128", "too many arguments"),
    ("q4:128:sr:1", "too many arguments"),
    ("fp8:256:sr", "no stochastic rounding"),
    ("e3m0:100", "or 0 for one scale per tensor"),
    ("s4:sr", "s4 takes no arguments"),
    ("s2:16", "s2 takes no arguments"),
    ("bf16:x", "bf16 takes no arguments"),
    ("q16", "unknown quantizer 'q16'"),
    ("", "non-empty"),
])
def test_bad_arguments_say_what_is_allowed(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_quantizer(spec)


@pytest.mark.parametrize("spec", SPECS)
def test_encode_rejects_non_finite_and_misuse(spec: str) -> None:
    c = codec(spec)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="non-finite"):
            c.encode(torch.tensor([1.0, bad, 2.0]))
        for at in (0, 700, 1000):  # as on a GPU (where an inf's clamped scale would be finite), in any block
            t = torch.ones(1001)
            t[at] = bad
            with device_path(), pytest.raises(ValueError, match="non-finite"):
                c.encode(t)
    with pytest.raises(TypeError):
        c.encode(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError):
        c.encode(torch.zeros(2, 2))
    assert c.encode(torch.zeros(0)) == b"" and c.encoded_size(0) == 0
    assert c.decode(b"", 0).shape == (0,)
    strided = torch.arange(40, dtype=torch.float32)[::2]
    assert make_quantizer(spec, seed=1).encode(strided) == make_quantizer(spec, seed=1).encode(strided.contiguous())


@pytest.mark.parametrize("spec", SPECS)
def test_decode_copies_and_checks_size(spec: str) -> None:
    c = codec(spec)
    t = torch.linspace(-3, 5, 37)
    buffer = bytearray(c.encode(t))
    out = c.decode(memoryview(buffer), 37)
    expected = out.clone()
    buffer[:] = bytes(len(buffer))  # scribbling on the receive buffer ...
    assert torch.equal(out, expected)  # ... must not reach the tensor
    out += 1.0  # writable
    wrong = [n for n in (29, 30, 35, 36, 38, 39, 44, 45) if c.encoded_size(n) != len(buffer)]
    assert len(wrong) >= 4
    for numel in (*wrong, -1, 10**18):
        with pytest.raises(PayloadRejected) as info:
            c.decode(bytes(buffer), numel)
        assert info.value.reason is Reason.WRONG_SIZE
    with pytest.raises(PayloadRejected):
        c.decode(bytes(buffer), True)  # type: ignore[arg-type]


def patched(payload: bytes, offset: int, new: bytes) -> bytes:
    return payload[:offset] + new + payload[offset + len(new):]


F32 = {name: np.float32(v).tobytes() for name, v in
       {"nan": math.nan, "inf": math.inf, "neg": -0.5, "negzero": -0.0, "huge": 3e38}.items()}


@pytest.mark.parametrize("spec,offset,new,reason", [
    ("q4:16", 0, F32["nan"], Reason.NON_FINITE),
    ("q4:16", 4, F32["inf"], Reason.NON_FINITE),
    ("q4:16", 8, F32["huge"], Reason.NON_FINITE),  # 7 * 3e38 would overflow
    ("q4:16", 0, F32["neg"], Reason.BAD_HEADER),
    ("q4:16", 4, F32["negzero"], Reason.BAD_HEADER),
    ("q4:16", 12, b"\x88", Reason.BAD_DTYPE),  # spare code -8
    ("q8:16", 12, b"\x80", Reason.BAD_DTYPE),  # spare code -128
    ("q2:16", 12, b"\x02", Reason.BAD_DTYPE),  # spare code -2
    ("q8:16", 0, F32["huge"], Reason.NON_FINITE),
    ("s4", 60, F32["nan"], Reason.NON_FINITE),
    ("s2", 0, F32["inf"], Reason.NON_FINITE),
    ("fp8:16", 12, b"\x7f", Reason.NON_FINITE),  # e4m3 NaN
    ("fp8:16", 40, b"\xff", Reason.NON_FINITE),
    ("fp8:16", 0, F32["neg"], Reason.BAD_HEADER),
    ("e3m0:0", 0, F32["nan"], Reason.NON_FINITE),
    ("e3m0:0", 0, F32["negzero"], Reason.BAD_HEADER),
    ("e3m0:0", 4, b"\x08", Reason.BAD_DTYPE),  # "negative zero" is reserved
    ("e3m0:16", 20, b"\x80", Reason.BAD_DTYPE),
    ("bf16", 0, b"\x80\x7f", Reason.NON_FINITE),  # +inf
    ("bf16", 10, b"\xc0\xff", Reason.NON_FINITE),  # NaN
])
def test_decode_rejects_bad_fields(spec: str, offset: int, new: bytes, reason: Reason) -> None:
    c = codec(spec)
    payload = c.encode(torch.linspace(-1, 1, 40))
    c.decode(payload, 40)  # the unpatched payload is fine
    with pytest.raises(PayloadRejected) as info:
        c.decode(patched(payload, offset, new), 40)
    assert info.value.reason is reason


@pytest.mark.parametrize("spec", ["q4:16", "q2:16", "s4", "s2", "e3m0:0", "e3m0:16"])
def test_decode_rejects_non_zero_padding(spec: str) -> None:
    c = codec(spec)
    payload = c.encode(torch.linspace(-1, 1, 39))  # 39 sub-byte codes leave padding bits
    assert padding_bits_clear(payload, c.bits if hasattr(c, "bits") else 4, 39)
    with pytest.raises(PayloadRejected) as info:
        c.decode(payload[:-1] + bytes([payload[-1] | 0x80]), 39)
    assert info.value.reason is Reason.BAD_DTYPE


# --------------------------------------------------------------------------- fuzzing


def mutate(rng: random.Random, payload: bytearray, *, keep_size: bool) -> None:
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(3 if keep_size else 6)
        pos = rng.randrange(len(payload)) if payload else 0
        if op == 0 and payload:
            payload[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and payload:
            payload[pos] = rng.randrange(256)
        elif op == 2 and len(payload) >= 4:  # a header word becomes a special float
            word = rng.choice([*F32.values(), np.float32(1e-45).tobytes(), bytes(4), b"\xff" * 4])
            at = 4 * rng.randrange(min(len(payload) // 4, 20))
            payload[at : at + 4] = word
        elif op == 3:
            del payload[pos:]
        elif op == 4:
            payload += rng.randbytes(rng.randint(1, 8))
        else:
            del payload[pos : pos + rng.randint(1, 4)]


@contextlib.contextmanager
def device_path() -> Iterator[torch.device]:
    """Codecs on the CPU take the path they take on a GPU (codecs.whole): yields the device to decode onto."""
    codecs.DEVICE_PATH_ON_CPU = True
    try:
        yield torch.device("cpu")
    finally:
        codecs.DEVICE_PATH_ON_CPU = False


def check_decode_total(c: Codec, payload: bytes, numel: int) -> None:
    """decode() returns a finite fp32 tensor of length numel, deterministically, or
    raises PayloadRejected -- nothing else; and decoding as on a GPU gives the same
    bits or the same rejection."""
    with device_path() as device:
        try:
            on_device: torch.Tensor | Reason = c.decode(payload, numel, device)
        except PayloadRejected as err:
            on_device = err.reason
    try:
        out = c.decode(payload, numel)
    except PayloadRejected as err:
        assert isinstance(err.reason, Reason)
        assert on_device == err.reason, (on_device, err.reason)
        return
    assert out.dtype == torch.float32 and out.shape == (numel,)
    assert torch.isfinite(out).all()
    assert torch.equal(c.decode(payload, numel), out)
    assert isinstance(on_device, torch.Tensor) and torch.equal(on_device, out), on_device


@functools.cache
def valid_payloads(spec: str) -> list[tuple[bytes, int]]:
    """Valid (payload, numel) pairs of every input kind and many sizes, encoded once:
    the fuzzer spends its time mutating and decoding, not encoding."""
    rng = random.Random(spec)
    sizes = [*range(1, 18), 31, 32, 33, 255, 256, 257, 1000, 1499]
    inputs = [make_input(size, kind, rng.randrange(2**32)) for size in sizes for kind in KINDS]
    return [(codec(spec).encode(t), t.numel()) for t in inputs]


def fuzz_one(spec: str, rng: random.Random) -> None:
    c = codec(spec)
    numel = rng.choice([rng.randint(0, 48), rng.randint(0, 10_000)])
    mode = rng.randrange(4)
    if mode == 0:  # arbitrary bytes, arbitrary numel (almost always the wrong size)
        numel = rng.choice([numel, -1, 2**70])
        payload = rng.randbytes(rng.choice([0, 1, 4, rng.randrange(4096)]))
    elif mode == 1:  # arbitrary bytes of exactly the right size
        payload = rng.randbytes(c.encoded_size(numel))
    else:  # a valid payload with bytes changed (mode 2), or also resized and decoded
        valid, size = rng.choice(valid_payloads(spec))  # with an arbitrary numel (mode 3)
        buffer = bytearray(valid)
        mutate(rng, buffer, keep_size=mode == 2)
        payload = bytes(buffer)
        numel = size if mode == 2 else numel
    check_decode_total(c, payload, numel)


@FUZZ
@given(seed=st.integers(0, 2**64 - 1))
def test_fuzz_decode(seed: int) -> None:
    # Each example fuzzes every decoder layout once, so each codec sees 2000 inputs
    # while hypothesis's per-example overhead is paid once for all of them.
    for spec in FUZZ_SPECS:
        rng = random.Random(f"{spec}/{seed}")  # a failure's (spec, seed) reproduces the exact input
        try:
            fuzz_one(spec, rng)
        except AssertionError as err:
            raise AssertionError(f"{spec}: {err}") from err


# --------------------------------------------------------------------------- bits


@settings(PROPERTY, max_examples=300)
@given(data=st.data(), bits=st.sampled_from(SUPPORTED_BITS))
def test_bits_round_trip(data: st.DataObject, bits: int) -> None:
    values = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=200))
    dtype = data.draw(st.sampled_from([torch.int64, torch.uint8] if bits <= 8 else [torch.int64]))
    packed = pack_bits(torch.tensor(values, dtype=dtype), bits)
    assert len(packed) == packed_size(len(values), bits) == (len(values) * bits + 7) // 8
    assert padding_bits_clear(packed, bits, len(values))
    out = unpack_bits(packed, bits, len(values))
    assert out.dtype == (torch.uint8 if bits <= 8 else torch.int64)
    assert out.tolist() == values
    # LSB-first bit stream: value i occupies bits [i*bits, (i+1)*bits).
    stream = int.from_bytes(packed, "little")
    assert [(stream >> (i * bits)) & ((1 << bits) - 1) for i in range(len(values))] == values


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_bits_round_trip_large(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (20_003,), generator=g)
    packed = pack_bits_tensor(values, bits)
    assert torch.equal(unpack_bits_tensor(packed, bits, values.numel()).long(), values)


def test_bits_golden_and_misuse() -> None:
    assert pack_bits(torch.tensor([1, 2, 3]), 4) == bytes([0x21, 0x03])
    assert pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1]), 1) == bytes([0x0D, 0x01])
    assert pack_bits(torch.tensor([3, 0, 1, 2]), 2) == bytes([0b10010011])
    assert pack_bits(torch.tensor([5, 7, 1]), 3) == bytes([0b01111101, 0b00000000])
    assert pack_bits(torch.tensor([0xABC, 0x123, 0xFFF]), 12) == bytes([0xBC, 0x3A, 0x12, 0xFF, 0x0F])
    data = bytearray(pack_bits(torch.tensor([200, 7]), 8))
    out = unpack_bits(data, 8, 2)
    data[0] = 0
    assert out.tolist() == [200, 7]  # never a view of the input
    with pytest.raises(ValueError, match="range"):
        pack_bits(torch.tensor([16]), 4)
    with pytest.raises(ValueError, match="range"):
        pack_bits(torch.tensor([-1]), 4)
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.tensor([1]), 9)
    with pytest.raises(TypeError):
        pack_bits(torch.tensor([1.0]), 4)
    with pytest.raises(ValueError, match="need 2 bytes"):
        unpack_bits(b"\x00", 4, 3)
    assert not padding_bits_clear(b"\x21\x13", 4, 3) and padding_bits_clear(b"\x21\x13", 4, 4)
