"""Checkpoints (diloco/checkpoint.py): safetensors round trips, strict decoding of lying headers,
fallback past corrupt checkpoints, pruning, disk full, kill -9 during a write, and
no pickle."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import checkpoint_writer
from diloco import checkpoint as ck
from diloco.checkpoint import CheckpointError, TensorData

MODULE = Path(ck.__file__)
WRITER = Path(checkpoint_writer.__file__)


def sample_tensors() -> dict[str, TensorData]:
    return {
        "f32": ck.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3)),
        "f64_scalar": ck.from_numpy(np.float64(3.25)),                       # 0-d
        "i64_empty": ck.from_numpy(np.zeros((0, 4), dtype=np.int64)),         # no elements
        "bf16": TensorData("BF16", (3,), bytes.fromhex("803f0040c0bf")),     # 1, 2, -1.5 raw
        "f16": ck.from_numpy(np.array([0.5, -2.0], dtype=np.float16)),
        "i32": ck.from_numpy(np.array([[1, -2], [3, 2**31 - 1]], dtype=np.int32)),
        "i16": ck.from_numpy(np.array([-7], dtype=np.int16)),
        "i8": ck.from_numpy(np.array([-128, 127], dtype=np.int8)),
        "u8": ck.from_numpy(np.array([0, 255, 1], dtype=np.uint8)),
        "bool": ck.from_numpy(np.array([True, False, True])),
    }


def tmp_dirs(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(".tmp-"))


def small(step: int, nbytes: int = 64) -> dict[str, TensorData]:
    return {"x": TensorData("U8", (nbytes,), bytes([step % 256]) * nbytes)}


# -------------------------------------------------------------------------------------------------
# round trip and format

@pytest.mark.unit
def test_round_trip_all_dtypes_and_meta(tmp_path: Path) -> None:
    tensors = sample_tensors()
    meta = {"round": 7, "loss": 2.5, "peers": ["a", "b"], "nested": {"ok": True, "none": None}, "ü": "✓"}
    path = ck.save(tmp_path, 42, tensors, meta)
    assert path == tmp_path / "ckpt-000000000042"
    assert sorted(os.listdir(path)) == ["MANIFEST.json", "meta.json", "tensors.safetensors"]
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None
    assert (loaded.path, loaded.step, loaded.skipped) == (path, 42, [])
    assert loaded.tensors == tensors
    assert loaded.meta == meta
    assert ck.to_numpy(loaded.tensors["f64_scalar"]).shape == ()
    assert ck.to_numpy(loaded.tensors["f64_scalar"]) == 3.25
    assert ck.to_numpy(loaded.tensors["i64_empty"]).shape == (0, 4)
    np.testing.assert_array_equal(ck.to_numpy(loaded.tensors["i32"]), [[1, -2], [3, 2**31 - 1]])
    np.testing.assert_array_equal(ck.to_numpy(loaded.tensors["bool"]), [True, False, True])
    assert loaded.tensors["bf16"].data == bytes.fromhex("803f0040c0bf")
    manifest = json.loads((path / "MANIFEST.json").read_bytes())
    assert manifest["format"] == 1 and manifest["step"] == 42
    for name in ("tensors.safetensors", "meta.json"):
        raw = (path / name).read_bytes()
        assert manifest["files"][name] == {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}


@pytest.mark.unit
def test_file_is_valid_safetensors_by_hand(tmp_path: Path) -> None:
    tensors = sample_tensors()
    raw = (ck.save(tmp_path, 1, tensors, {}) / "tensors.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0, "data must start 8-byte aligned"
    header_raw = raw[8:8 + n]
    body = header_raw.rstrip(b" ")
    assert header_raw == body + b" " * (n - len(body)) and len(header_raw) - len(body) < 8
    header = json.loads(body.decode("utf-8"))
    assert header.pop("__metadata__") == {"diloco_step": "1"}
    data = raw[8 + n:]
    offset = 0
    for name in sorted(tensors):                       # sorted by name, contiguous, no gaps
        t = tensors[name]
        assert header[name] == {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(t.data)]}
        assert data[offset:offset + len(t.data)] == t.data
        offset += len(t.data)
    assert set(header) == set(tensors)
    assert offset == len(data), "no trailing bytes"


@pytest.mark.unit
def test_encode_decode_and_streaming_writer_agree() -> None:
    import io
    tensors = sample_tensors()
    buf = ck.encode_safetensors(tensors, {"k": "v"})
    out = io.BytesIO()
    assert ck.write_safetensors(out, tensors, {"k": "v"}) == len(buf)
    assert out.getvalue() == buf
    decoded, metadata = ck.decode_safetensors_with_metadata(buf)
    assert decoded == tensors and metadata == {"k": "v"}
    assert ck.decode_safetensors(memoryview(buf)) == tensors
    assert ck.decode_safetensors(ck.encode_safetensors({})) == {}


@pytest.mark.unit
def test_decode_accepts_other_writers_data_order() -> None:
    """Real safetensors writers order the data by alignment, not by name: any exact tiling is valid."""
    header = {"a": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]},
              "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    buf = encode_raw(header, b"\x00\x00\x80\x3f" + b"\x01\x02")
    out = ck.decode_safetensors(buf)
    assert out["a"].data == b"\x01\x02" and ck.to_numpy(out["b"]).tolist() == [1.0]


@pytest.mark.unit
def test_numpy_helpers() -> None:
    big_endian = np.array([1.5, -2.0], dtype=">f4")
    t = ck.from_numpy(big_endian)
    assert t.dtype == "F32" and t.data == np.array([1.5, -2.0], dtype="<f4").tobytes()
    fortran = np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3))
    np.testing.assert_array_equal(ck.to_numpy(ck.from_numpy(fortran)), fortran)
    for bad in (np.zeros(2, dtype=np.complex64), np.zeros(2, dtype=np.uint16)):
        with pytest.raises(CheckpointError, match="not storable"):
            ck.from_numpy(bad)
    with pytest.raises(CheckpointError, match="BF16 has no numpy dtype"):
        ck.to_numpy(TensorData("BF16", (1,), b"\x80\x3f"))
    with pytest.raises(CheckpointError, match="other than 0 and 1"):
        ck.to_numpy(TensorData("BOOL", (2,), b"\x01\x07"))


@pytest.mark.unit
def test_invalid_input_is_rejected_before_touching_disk(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="needs 12 bytes, got 8"):
        TensorData("F32", (3,), b"\x00" * 8)
    with pytest.raises(CheckpointError, match="unknown dtype"):
        TensorData("F8_E4M3", (1,), b"\x00")
    root = tmp_path / "r"
    with pytest.raises(CheckpointError, match="meta is not strict JSON"):
        ck.save(root, 1, small(1), {"loss": float("nan")})
    with pytest.raises(CheckpointError, match="meta is not strict JSON"):
        ck.save(root, 1, small(1), {"obj": object()})
    with pytest.raises(CheckpointError, match="not TensorData"):
        ck.save(root, 1, {"x": np.zeros(3)}, {})  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match="step must be"):
        ck.save(root, -1, small(1), {})
    with pytest.raises(CheckpointError, match="keep must be"):
        ck.save(root, 1, small(1), {}, keep=0)
    assert not root.exists()


@pytest.mark.unit
def test_resave_same_step_replaces_it(tmp_path: Path) -> None:
    ck.save(tmp_path, 5, small(1), {"v": 1})
    ck.save(tmp_path, 5, small(2), {"v": 2})
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None and loaded.step == 5 and loaded.meta == {"v": 2} and loaded.tensors == small(2)
    assert os.listdir(tmp_path) == ["ckpt-000000000005"]


# -------------------------------------------------------------------------------------------------
# strict decoding: headers that lie

def encode_raw(header: Any, data: bytes, n: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if n is None else n) + raw + data


def t(dtype: str, shape: list[Any], begin: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


LIES: dict[str, tuple[bytes, str]] = {
    "offsets beyond the file": (encode_raw({"a": t("F32", [10**12], 0, 4 * 10**12)}, b"\x00" * 16), "outside"),
    "end before begin": (encode_raw({"a": t("U8", [0], 8, 4)}, b"\x00" * 16), "outside"),
    "overlapping": (encode_raw({"a": t("F32", [2], 0, 8), "b": t("F32", [2], 4, 12)}, b"\x00" * 12), "overlaps"),
    "gap": (encode_raw({"a": t("F32", [1], 0, 4), "b": t("F32", [1], 8, 12)}, b"\x00" * 12), "gap"),
    "wrong length": (encode_raw({"a": t("F32", [3], 0, 8)}, b"\x00" * 8), "needs 12 bytes"),
    "huge shape, capped product": (encode_raw({"a": t("F32", [10**300] * 3000, 0, 8)}, b"\x00" * 8),
                                   "needs more than 2\\*\\*64 bytes"),
    "unknown dtype": (encode_raw({"a": t("F8_E4M3", [1], 0, 1)}, b"\x00"), "unknown dtype"),
    "negative dim": (encode_raw({"a": t("U8", [-1], 0, 0)}, b""), "non-negative ints"),
    "bool dim": (encode_raw({"a": t("U8", [True], 0, 1)}, b"\x00"), "non-negative ints"),
    "float offset": (encode_raw({"a": t("U8", [1], 0.0, 1)}, b"\x00"), "data_offsets must be"),
    "extra field": (encode_raw({"a": {**t("U8", [1], 0, 1), "x": 1}}, b"\x00"), "exactly dtype, shape"),
    "trailing data": (encode_raw({"a": t("U8", [1], 0, 1)}, b"\x00" * 9), "trailing bytes"),
    "huge header length": (encode_raw({"a": t("U8", [1], 0, 1)}, b"\x00", n=2**63), "exceeds"),
    "header past the end": (encode_raw({"a": t("U8", [1], 0, 1)}, b"\x00", n=10_000), "runs past the end"),
    "too short": (b"\x05\x00\x00", "too short"),
    "not json": (encode_raw(b"{not json}", b""), "not valid UTF-8 JSON"),
    "not utf-8": (encode_raw(b'{"\xff": 1}', b""), "not valid UTF-8 JSON"),
    "not an object": (encode_raw([1, 2], b""), "not a JSON object"),
    "duplicate names": (encode_raw(b'{"a":' + json.dumps(t("U8", [1], 0, 1)).encode() + b',"a":'
                                   + json.dumps(t("U8", [1], 1, 2)).encode() + b"}", b"\x00\x00"), "duplicate key"),
    "NaN constant": (encode_raw(b'{"__metadata__": {"x": NaN}}', b""), "non-standard JSON constant"),
    "bad metadata": (encode_raw({"__metadata__": {"x": 1}}, b""), "__metadata__ must be"),
    "deep nesting": (encode_raw(b"[" * 100_000 + b"]" * 100_000, b""), "not valid UTF-8 JSON"),
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(LIES))
def test_decode_rejects_lying_headers_fast_and_small(case: str) -> None:
    buf, message = LIES[case]
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(CheckpointError, match=message):
            ck.decode_safetensors(buf)
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 2.0, f"{case}: took {elapsed:.2f} s"
    assert peak < 20 * len(buf) + (4 << 20), f"{case}: peak {peak} bytes for a {len(buf)}-byte buffer"


# -------------------------------------------------------------------------------------------------
# fallback past bad checkpoints

def two_checkpoints(root: Path) -> tuple[Path, Path]:
    old = ck.save(root, 1, {"x": ck.from_numpy(np.arange(1000, dtype=np.float32))}, {"n": 1})
    new = ck.save(root, 2, {"x": ck.from_numpy(np.arange(1000, dtype=np.float32) * 2)}, {"n": 2})
    return old, new


def assert_falls_back(root: Path, bad: Path, reason: str) -> None:
    loaded = ck.load_latest(root)
    assert loaded is not None and loaded.step == 1 and loaded.meta == {"n": 1}
    np.testing.assert_array_equal(ck.to_numpy(loaded.tensors["x"]), np.arange(1000, dtype=np.float32))
    assert [p for p, _ in loaded.skipped] == [bad]
    assert reason in loaded.skipped[0][1], loaded.skipped


def flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def rewrite_manifest(ckpt: Path) -> None:
    """Make the manifest agree with whatever the files hold now (a writer that lies consistently)."""
    files = {n: {"sha256": hashlib.sha256((ckpt / n).read_bytes()).hexdigest(), "bytes": (ckpt / n).stat().st_size}
             for n in ("tensors.safetensors", "meta.json")}
    step = int(ckpt.name.split("-")[1])
    (ckpt / "MANIFEST.json").write_text(json.dumps({"format": 1, "step": step, "files": files}))


@pytest.mark.unit
@pytest.mark.parametrize("where", ["data", "header", "length prefix"])
def test_flipped_byte_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str) -> None:
    _, new = two_checkpoints(tmp_path)
    size = (new / "tensors.safetensors").stat().st_size
    flip(new / "tensors.safetensors", {"data": size - 100, "header": 20, "length prefix": 0}[where])
    with caplog.at_level("WARNING", logger="diloco.checkpoint"):
        assert_falls_back(tmp_path, new, "tensors.safetensors SHA-256 mismatch")
    assert f"event=checkpoint_skipped path={new} reason=tensors.safetensors SHA-256 mismatch" in caplog.text


@pytest.mark.unit
def test_missing_manifest_falls_back(tmp_path: Path) -> None:
    _, new = two_checkpoints(tmp_path)
    (new / "MANIFEST.json").unlink()
    assert_falls_back(tmp_path, new, "missing MANIFEST.json")
    assert ck.list_checkpoints(tmp_path) == [tmp_path / "ckpt-000000000001"]


@pytest.mark.unit
def test_truncated_file_falls_back(tmp_path: Path) -> None:
    _, new = two_checkpoints(tmp_path)
    path = new / "tensors.safetensors"
    os.truncate(path, path.stat().st_size - 1)
    assert_falls_back(tmp_path, new, "(truncated?)")


@pytest.mark.unit
@pytest.mark.parametrize("damage, reason", [
    ("meta not object", "meta.json is not a JSON object"),
    ("meta missing", "No such file or directory"),
    ("manifest garbage", "MANIFEST.json is not valid UTF-8 JSON"),
    ("manifest wrong step", "does not match directory step 2"),
    ("manifest wrong format", "format 2 is not 1"),
    ("header lies, hashes agree", "overlaps"),
])
def test_other_damage_falls_back(tmp_path: Path, damage: str, reason: str) -> None:
    _, new = two_checkpoints(tmp_path)
    manifest = json.loads((new / "MANIFEST.json").read_bytes())
    if damage == "meta not object":
        (new / "meta.json").write_text("[1, 2]")
        rewrite_manifest(new)
    elif damage == "meta missing":
        (new / "meta.json").unlink()
    elif damage == "manifest garbage":
        (new / "MANIFEST.json").write_bytes(b"\x00garbage")
    elif damage == "manifest wrong step":
        (new / "MANIFEST.json").write_text(json.dumps({**manifest, "step": 3}))
    elif damage == "manifest wrong format":
        (new / "MANIFEST.json").write_text(json.dumps({**manifest, "format": 2}))
    else:
        buf = encode_raw({"a": t("F32", [2], 0, 8), "b": t("F32", [2], 4, 12)}, b"\x00" * 12)
        (new / "tensors.safetensors").write_bytes(buf)
        rewrite_manifest(new)
    assert_falls_back(tmp_path, new, reason)


@pytest.mark.unit
def test_nothing_valid_returns_none(tmp_path: Path) -> None:
    assert ck.load_latest(tmp_path / "does-not-exist") is None
    assert ck.load_latest(tmp_path) is None
    path = ck.save(tmp_path, 1, small(1), {})
    (path / "MANIFEST.json").write_text("{}")
    (tmp_path / "ckpt-000000000002").mkdir()
    (tmp_path / "ckpt-000000000003").write_text("a file, not a directory")
    (tmp_path / "not-a-ckpt").mkdir()
    assert ck.load_latest(tmp_path) is None


# -------------------------------------------------------------------------------------------------
# keep / prune

@pytest.mark.unit
def test_keep_prunes_old_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        ck.save(tmp_path, step, small(step), {"step": step}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000000003", "ckpt-000000000004"]
    assert ck.list_checkpoints(tmp_path) == [tmp_path / "ckpt-000000000004", tmp_path / "ckpt-000000000003"]
    ck.save(tmp_path, 1, small(1), {"step": 1}, keep=2)   # an older step is kept: never prune what we just wrote
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["ckpt-000000000004", "ckpt-000000000003",
                                                              "ckpt-000000000001"]


@pytest.mark.unit
def test_prune_removes_dead_writers_temp_dirs_only(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        for kind, pid in (("ckpt", dead.pid), ("old", dead.pid), ("del", dead.pid), ("ckpt", live.pid)):
            d = tmp_path / f".tmp-{kind}-7-{pid}-0badcafe"
            d.mkdir()
            (d / "tensors.safetensors").write_bytes(b"partial")
        ck.save(tmp_path, 8, small(8), {})
        assert tmp_dirs(tmp_path) == [f".tmp-ckpt-7-{live.pid}-0badcafe"]
    finally:
        live.kill()
        live.wait()


# -------------------------------------------------------------------------------------------------
# disk full

@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Any:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_disk_full_keeps_previous_checkpoint(small_tmpfs: Path) -> None:
    root = small_tmpfs / "ckpts"
    ck.save(root, 1, small(1, 16 << 10), {"step": 1})
    with pytest.raises(CheckpointError) as err:
        ck.save(root, 2, small(2, 1 << 20), {"step": 2})
    assert "No space left on device (ENOSPC)" in str(err.value)
    assert str(root) in str(err.value) and "intact" in str(err.value)
    assert tmp_dirs(root) == []
    loaded = ck.load_latest(root)
    assert loaded is not None and loaded.step == 1 and loaded.tensors == small(1, 16 << 10) and loaded.skipped == []


def test_disk_full_at_every_point_of_a_save(small_tmpfs: Path) -> None:
    """Sizes swept across the free space so it runs out in the tensors, in meta.json and in the
    manifest: whichever write fails, the previous checkpoint loads and nothing temporary is left."""
    root = small_tmpfs / "ckpts"
    ck.save(root, 1, small(1, 8 << 10), {"step": 1})
    failed_in: set[str] = set()
    for i, size in enumerate(range(200 << 10, 250 << 10, 512)):
        meta = {"pad": "m" * (i * 1237 % (12 << 10))}
        try:
            path = ck.save(root, 2, small(2, size), meta)
        except CheckpointError as e:
            assert isinstance(e.__cause__, OSError) and "ENOSPC" in str(e)
            failed_in.add(Path(e.__cause__.filename).name)
        else:
            loaded = ck.load_latest(root)
            assert loaded is not None and loaded.step == 2 and loaded.meta == meta
            shutil.rmtree(path)
        assert tmp_dirs(root) == []
        loaded = ck.load_latest(root)
        assert loaded is not None and loaded.skipped == []
        assert (loaded.step, loaded.tensors, loaded.meta) == (1, small(1, 8 << 10), {"step": 1})
    assert failed_in == {"tensors.safetensors", "meta.json", "MANIFEST.json"}


# -------------------------------------------------------------------------------------------------
# kill -9 during a write

def spawn_writer(root: Path, start: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-I", "-S", str(WRITER), str(MODULE), str(root), str(start)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)


def verify(loaded: ck.Loaded) -> None:
    want = checkpoint_writer.tensors(ck, loaded.step)
    assert loaded.tensors == want, f"step {loaded.step}: tensor contents do not match their step"
    assert loaded.meta == checkpoint_writer.meta(loaded.step)
    assert hashlib.sha256(loaded.tensors["w"].data).hexdigest() == loaded.meta["sha256"]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_kill_9_during_writes_always_leaves_a_verified_checkpoint(tmp_path: Path) -> None:
    iterations, rng = 200, random.Random(1234)
    root = tmp_path / "ckpts"
    ck.save(root, 0, checkpoint_writer.tensors(ck, 0), checkpoint_writer.meta(0))
    newest_durable, mid_write, unreported, errors, t0 = 0, 0, 0, [], time.monotonic()
    for i in range(iterations):
        proc = spawn_writer(root, (i + 1) * 1000)
        try:
            assert proc.stdout is not None and proc.stderr is not None
            ready = proc.stdout.readline().split()
            assert ready == [b"ready", b"False", b"False"], (ready, proc.stderr.read())
            time.sleep(rng.uniform(0.0, 0.05))
            assert proc.poll() is None, f"writer died on its own: {proc.stderr.read().decode()}"
            proc.kill()
        finally:
            proc.kill()
            out, _ = proc.communicate()
        saved = [int(line.split()[1]) for line in out.splitlines() if line.startswith(b"saved")]
        newest_durable = max([newest_durable, *saved])
        if any(n.startswith(".tmp-ckpt-") and n.split("-")[-2] == str(proc.pid) for n in os.listdir(root)):
            mid_write += 1          # the kill landed while files were being written: a partial write lies there
        try:
            loaded = ck.load_latest(root)
        except Exception as e:  # noqa: BLE001 - the point is that nothing escapes
            errors.append(f"iteration {i}: {type(e).__name__}: {e}")
            continue
        assert loaded is not None, f"iteration {i}: no checkpoint"
        assert loaded.skipped == [], f"iteration {i}: a visible checkpoint was incomplete: {loaded.skipped}"
        assert loaded.step >= newest_durable, f"iteration {i}: lost step {newest_durable}, got {loaded.step}"
        unreported += loaded.step > newest_durable   # renamed into place, killed before save() returned
        newest_durable = loaded.step
        verify(loaded)
    assert errors == []
    ck.save(root, 10**9, checkpoint_writer.tensors(ck, 0), checkpoint_writer.meta(0), keep=1)
    assert tmp_dirs(root) == [] and len(ck.list_checkpoints(root)) == 1
    print(f"\nkill -9: {iterations}/{iterations} verified; {mid_write} kills landed mid-write and load_latest "
          f"fell back past the partial write; {unreported} loaded a checkpoint whose save() never returned; "
          f"{time.monotonic() - t0:.1f} s")
    assert mid_write > 0, "no kill landed inside a save: the test did not exercise partial writes"


# -------------------------------------------------------------------------------------------------
# hygiene

@pytest.mark.unit
def test_no_pickle_and_no_torch_import() -> None:
    source = MODULE.read_text()
    assert "pickle" not in source and "torch.load" not in source
    assert "import torch" not in source and "from ." not in source


def test_module_loads_standalone_without_torch_or_numpy() -> None:
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('c', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); sys.modules['c'] = m; s.loader.exec_module(m); "
            "print(sorted(k for k in ('torch', 'numpy') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(MODULE)], capture_output=True, check=True)
    assert out.stdout.strip() == b"[]"

