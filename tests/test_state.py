"""GlobalState (diloco/state.py): the digest, and the state download format.

A downloaded state is untrusted input: `load_bytes` must either load it or raise `StateError`,
never any other exception, and must leave our state unchanged when it raises.
"""

from __future__ import annotations

import copy
import hashlib

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.outer import nesterov, outer_step
from diloco.state import CHUNK_BYTES, GlobalState, Manifest, StateError

pytestmark = pytest.mark.unit

SHAPES = [(4, 3), (5,), (2, 1, 2)]
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _stepped(seed: int = 0, rnd: int = 3) -> GlobalState:
    """A state with momentum buffers: two Nesterov outer steps, round `rnd`."""
    state = GlobalState(_params(seed), nesterov())
    g = torch.Generator().manual_seed(100 + seed)
    for _ in range(2):
        outer_step(state.outer, state.params, torch.randn(NUMEL, generator=g))
    state.round = rnd
    return state


def _fresh() -> GlobalState:
    return GlobalState(_params(seed=7), nesterov())


def _snapshot(state: GlobalState):
    return (state.digest(), state.round, [p.clone() for p in state.params], copy.deepcopy(state.outer.state_dict()))


def _assert_unchanged(state: GlobalState, snap) -> None:
    digest, rnd, params, outer_sd = snap
    assert state.digest() == digest
    assert state.round == rnd
    for p, q in zip(state.params, params):
        assert torch.equal(p, q)
    assert state.outer.state_dict()["state"].keys() == outer_sd["state"].keys()


# ---------------------------------------------------------------------- round trip


def test_round_trip_preserves_digest_params_round_and_momentum():
    src = _stepped()
    assert set(src.outer.state_dict()["state"]) == {0, 1, 2}  # there is momentum to carry
    dst = _fresh()
    assert dst.digest() != src.digest()
    dst.load_bytes(src.to_bytes())
    assert dst.digest() == src.digest()
    assert dst.round == 3
    for p, q in zip(dst.params, src.params):
        assert torch.equal(p, q)
    for i in range(len(SHAPES)):
        a = dst.outer.state[dst.params[i]]["momentum_buffer"]
        b = src.outer.state[src.params[i]]["momentum_buffer"]
        assert a.shape == b.shape and torch.equal(a, b)
        assert a.data_ptr() != b.data_ptr()
    # the loaded state keeps evolving exactly like the source
    agg = torch.linspace(-1, 1, NUMEL)
    outer_step(src.outer, src.params, agg.clone())  # the step may write its gradient
    outer_step(dst.outer, dst.params, agg.clone())
    assert dst.digest() == src.digest()
    # and serializes to the same bytes
    assert dst.to_bytes() == src.to_bytes()


def test_round_trip_of_a_state_without_momentum():
    src = GlobalState(_params(1), nesterov())
    dst = _fresh()
    dst.load_bytes(src.to_bytes())
    assert dst.digest() == src.digest()
    assert dst.outer.state_dict()["state"] == {}


def test_state_copies_and_converts_params_to_fp32():
    model_params = [torch.ones(3, dtype=torch.float64, requires_grad=True)]
    state = GlobalState(model_params, nesterov())
    assert state.params[0].dtype == torch.float32 and not state.params[0].requires_grad
    state.params[0].add_(1)
    assert model_params[0].tolist() == [1.0, 1.0, 1.0]
    assert state.numel == 3


# ---------------------------------------------------------------------- digest


def test_digest_is_deterministic_and_equal_for_equal_states():
    assert _stepped().digest() == _stepped().digest()
    assert len(_stepped().digest()) == 16


def test_digest_changes_when_a_param_changes():
    s = _stepped()
    before = s.digest()
    with torch.no_grad():
        s.params[2].view(-1)[1] += 1e-6
    assert s.digest() != before


def test_digest_changes_when_round_changes():
    s = _stepped()
    before = s.digest()
    s.round += 1
    assert s.digest() != before
    s.round -= 1
    assert s.digest() == before


def test_digest_changes_when_momentum_changes():
    s = _stepped()
    before = s.digest()
    s.outer.state[s.params[1]]["momentum_buffer"][0] += 1e-3
    assert s.digest() != before


def test_digest_changes_when_outer_step_taken_even_if_params_restored():
    s = _stepped()
    before = s.digest()
    saved = [p.clone() for p in s.params]
    outer_step(s.outer, s.params, torch.ones(NUMEL))
    with torch.no_grad():
        for p, q in zip(s.params, saved):
            p.copy_(q)
    assert s.digest() != before  # only the momentum differs now


# ---------------------------------------------------------------------- malformed state -> StateError


def _obj() -> dict:
    return msgpack.unpackb(_stepped().to_bytes(), raw=False)


def _mutated(fn) -> bytes:
    obj = _obj()
    fn(obj)
    return msgpack.packb(obj, use_bin_type=True)


def _set(path, value):
    def fn(obj):
        target = obj
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = value
    return fn


def _tensor(shape, dtype="float32", data=None):
    itemsize = {"float32": 4, "float64": 8, "float16": 2}[dtype]
    n = torch.Size(shape).numel()
    return {"dtype": dtype, "shape": list(shape), "data": data if data is not None else b"\0" * (n * itemsize)}


BAD_STATES = {
    "empty": b"",
    "garbage": b"\x00\x01 this is not a state",
    "invalid msgpack byte": b"\xc1",
    "truncated msgpack": _stepped().to_bytes()[:-7],
    "trailing bytes": _stepped().to_bytes() + b"\x00",
    "not a map": msgpack.packb([1, 2, 3]),
    "no round": _mutated(lambda o: o.pop("round")),
    "round is a string": _mutated(_set(["round"], "3")),
    "no params": _mutated(lambda o: o.pop("params")),
    "params not a list": _mutated(_set(["params"], {"0": 1})),
    "one tensor too few": _mutated(lambda o: o["params"].pop()),
    "one tensor too many": _mutated(lambda o: o["params"].append(o["params"][0])),
    "no tensors": _mutated(_set(["params"], [])),
    "tensor not a map": _mutated(_set(["params", 0], [1, 2])),
    "wrong shape": _mutated(_set(["params", 0, "shape"], [3, 4])),
    "wrong rank": _mutated(_set(["params", 1, "shape"], [5, 1])),
    "negative dim": _mutated(_set(["params", 1, "shape"], [-5])),
    "shape not a list": _mutated(_set(["params", 1, "shape"], 5)),
    "shape of floats": _mutated(_set(["params", 1, "shape"], [5.0])),
    "wrong dtype": _mutated(_set(["params", 0], _tensor((4, 3), "float64"))),
    "half dtype": _mutated(_set(["params", 0], _tensor((4, 3), "float16"))),
    "unknown dtype": _mutated(_set(["params", 0, "dtype"], "complex64")),
    "dtype missing": _mutated(lambda o: o["params"][0].pop("dtype")),
    "data missing": _mutated(lambda o: o["params"][0].pop("data")),
    "data is a string": _mutated(_set(["params", 0, "data"], "abc")),
    "truncated data": _mutated(lambda o: o["params"][0].update(data=o["params"][0]["data"][:-1])),
    "data one element short": _mutated(lambda o: o["params"][2].update(data=o["params"][2]["data"][:-4])),
    "data too long": _mutated(lambda o: o["params"][1].update(data=o["params"][1]["data"] + b"\0\0\0\0")),
    "outer not a map": _mutated(_set(["outer"], [1])),
    "outer index out of range": _mutated(_set(["outer", "3"], {"momentum_buffer": {"tensor": _tensor((5,))}})),
    "outer index not a number": _mutated(_set(["outer", "x"], {"momentum_buffer": {"tensor": _tensor((5,))}})),
    "outer negative index": _mutated(_set(["outer", "-1"], {"momentum_buffer": {"tensor": _tensor((5,))}})),
    "outer entry not a map": _mutated(_set(["outer", "0"], 7)),
    "outer value not a map": _mutated(_set(["outer", "0", "momentum_buffer"], 1.5)),
    "outer value unknown kind": _mutated(_set(["outer", "0", "momentum_buffer"], {"pickle": b"x"})),
    "outer scalar of bad type": _mutated(_set(["outer", "0", "step"], {"scalar": "one"})),
    "outer scalar a list": _mutated(_set(["outer", "0", "step"], {"scalar": [1]})),
    "outer tensor wrong size": _mutated(_set(["outer", "1", "momentum_buffer"], {"tensor": _tensor((7,))})),
    "outer tensor bad data": _mutated(_set(["outer", "1", "momentum_buffer"], {"tensor": _tensor((5,), data=b"\0" * 3)})),
    "outer tensor bad dtype": _mutated(_set(["outer", "1", "momentum_buffer", "tensor", "dtype"], "object")),
}


@pytest.mark.parametrize("name", sorted(BAD_STATES))
def test_malformed_state_raises_state_error_and_changes_nothing(name):
    dst = _fresh()
    snap = _snapshot(dst)
    with pytest.raises(StateError):
        dst.load_bytes(BAD_STATES[name])
    _assert_unchanged(dst, snap)


def test_state_error_is_a_value_error_with_a_message():
    with pytest.raises(ValueError, match="tensors"):
        _fresh().load_bytes(BAD_STATES["one tensor too few"])
    with pytest.raises(StateError, match=r"\(3, 4\)"):
        _fresh().load_bytes(BAD_STATES["wrong shape"])


def test_valid_mutation_baseline_loads():
    """The mutation helpers themselves produce loadable bytes when nothing is changed."""
    src = _stepped()
    dst = _fresh()
    dst.load_bytes(_mutated(lambda o: None))
    assert dst.digest() == src.digest()


# ---------------------------------------------------------------------- fuzz


VALID = _stepped().to_bytes()


def _load_or_state_error(data: bytes) -> None:
    """Either `data` loads (and then re-serializes to a state with the same digest), or it raises
    StateError and leaves our state as it was. Any other exception fails the test."""
    dst = _fresh()
    snap = _snapshot(dst)
    try:
        dst.load_bytes(data)
    except StateError:
        _assert_unchanged(dst, snap)
        return
    again = _fresh()
    again.load_bytes(dst.to_bytes())
    assert again.digest() == dst.digest()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_fuzz_random_bytes_load_or_raise_state_error(data):
    _load_or_state_error(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_valid_state_loads_or_raises_state_error(data):
    buf = bytearray(VALID)
    n = data.draw(st.integers(1, 8), label="mutations")
    for _ in range(n):
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]), label="op")
        if not buf:
            break
        i = data.draw(st.integers(0, len(buf) - 1), label="at")
        if op == "flip":
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            buf[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del buf[i : i + data.draw(st.integers(1, 16))]
    _load_or_state_error(bytes(buf))


# ---------------------------------------------------------------------- manifest and chunked download


def _download(src: GlobalState, dst: GlobalState, chunk: int, order=None) -> GlobalState:
    manifest = Manifest.unpack(src.manifest(chunk).pack())
    receiver = dst.receiver(manifest)
    tensors, _ = src.layout()
    stream = b"".join(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for _, t in tensors)
    for i in order if order is not None else range(receiver.chunks):
        lo, hi = manifest.span(i)
        receiver.write(i, stream[lo:hi])
    return receiver.assemble(nesterov())


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_a_state_downloaded_in_chunks_in_any_order_is_the_same_state(chunk):
    """Chunks of 7 bytes cut through tensors and through the float values themselves."""
    src = _stepped()
    manifest = src.manifest(chunk)
    order = list(range(len(manifest.hashes)))[::-1]
    got = _download(src, _fresh(), chunk, order)
    assert got.digest() == src.digest()
    assert (manifest.digest == src.digest()) == (chunk == CHUNK_BYTES)  # the digest names the default chunking
    assert got.round == 3 and all(torch.equal(a, b) for a, b in zip(got.params, src.params))
    agg = torch.linspace(-1, 1, NUMEL)  # and it evolves exactly like the source
    outer_step(src.outer, src.params, agg.clone())  # the step may write its gradient
    outer_step(got.outer, got.params, agg.clone())
    assert got.digest() == src.digest()


def test_the_digest_is_the_hash_of_the_manifest_and_a_chunk_size_change_changes_nothing_else():
    s = _stepped()
    assert s.digest() == s.manifest().digest == hashlib.sha256(s.manifest().pack()).hexdigest()[:16]
    assert Manifest.unpack(s.manifest(64).pack()) == s.manifest(64)


@pytest.mark.parametrize("chunk", [7, 16])
def test_a_state_staged_window_by_window_hashes_to_the_same_chunks(chunk, monkeypatch):
    """A state on a GPU crosses to the host in windows of whole chunks, one copying while the other is hashed
    (`_hash_staged`); on the host it takes the same path with plain buffers: every chunk, or only some, hash as the
    state hashed in place does."""
    import diloco.state as state_module

    monkeypatch.setattr(state_module, "STAGING_BYTES", 3 * chunk)
    src = _stepped()
    manifest = src.manifest(chunk)
    tensors = [t for _, t in src.layout()[0]]
    count = len(manifest.hashes)
    assert count >= 4
    for todo in (range(count), sorted({0, 2, 3, count - 1}), [count - 1]):
        staged = state_module._hash_staged(tensors, manifest.total, chunk, todo, map)
        assert staged == {i: manifest.hashes[i] for i in todo}


def test_a_tampered_chunk_is_refused_and_not_written():
    src = _stepped()
    manifest = src.manifest(64)
    receiver = _fresh().receiver(manifest)
    lo, hi = manifest.span(1)
    tensors, _ = src.layout()
    stream = b"".join(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for _, t in tensors)
    bad = bytearray(stream[lo:hi])
    bad[3] ^= 1
    with pytest.raises(StateError, match="does not match its hash"):
        receiver.write(1, bytes(bad))
    with pytest.raises(StateError, match="does not match its hash"):
        receiver.write(1, stream[lo:hi - 1])
    assert receiver.done == set()
    with pytest.raises(StateError, match="missing"):
        receiver.assemble(nesterov())
    receiver.write(1, stream[lo:hi])
    assert receiver.done == {1}


def test_a_manifest_for_another_model_is_refused_before_anything_is_downloaded():
    other = GlobalState([torch.zeros(4, 3), torch.zeros(6)], nesterov())
    with pytest.raises(StateError, match="does not match expected|this model"):
        _fresh().receiver(other.manifest())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_random_manifests_parse_or_raise_state_error(data):
    try:
        manifest = Manifest.unpack(data)
    except StateError:
        return
    try:
        _fresh().receiver(manifest)
    except StateError:
        pass
