"""Checkpoints (diloco/checkpoint.py): round trips through the safetensors package, files any
safetensors reader loads, lying headers caught, fallback past corrupt checkpoints, pruning, disk full,
kill -9 during a write, a clear error without safetensors, and no pickle."""

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
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import checkpoint_writer
from fresh import fresh_python
from diloco import checkpoint as ck
from diloco.checkpoint import CheckpointError

MODULE = Path(ck.__file__)
WRITER = Path(checkpoint_writer.__file__)


def sample_tensors() -> dict[str, np.ndarray]:
    return {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "f64_scalar": np.array(3.25),                                          # 0-d
        "i64_empty": np.zeros((0, 4), dtype=np.int64),                         # no elements
        "f16": np.array([0.5, -2.0], dtype=np.float16),
        "i32": np.array([[1, -2], [3, 2**31 - 1]], dtype=np.int32),
        "i16": np.array([-7], dtype=np.int16),
        "i8": np.array([-128, 127], dtype=np.int8),
        "u8": np.array([0, 255, 1], dtype=np.uint8),
        "u16": np.array([65535], dtype=np.uint16),
        "u32": np.array([2**32 - 1], dtype=np.uint32),
        "u64": np.array([2**64 - 1], dtype=np.uint64),
        "bool": np.array([True, False, True]),
    }


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == np.ascontiguousarray(want[name]).astype(want[name].dtype.newbyteorder("<")
                                                                             ).tobytes(), name


def tmp_dirs(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(".tmp-"))


def small(step: int, nbytes: int = 64) -> dict[str, np.ndarray]:
    return {"x": np.full(nbytes, step % 256, dtype=np.uint8)}


def read_by_hand(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """The safetensors layout, checked independently of the package: 8-byte little-endian header length,
    a JSON header, then a data buffer the tensors tile exactly."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    spans = sorted(tuple(spec["data_offsets"]) for name, spec in header.items() if name != "__metadata__")
    assert [b for b, _ in spans] == [0] + [e for _, e in spans[:-1]] and (spans[-1][1] if spans else 0) == len(data)
    return header, data


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
    assert_same(loaded.tensors, tensors)
    assert loaded.meta == meta
    assert loaded.tensors["f64_scalar"].shape == () and loaded.tensors["f64_scalar"] == 3.25
    manifest = json.loads((path / "MANIFEST.json").read_bytes())
    assert manifest["format"] == 1 and manifest["step"] == 42
    for name in ("tensors.safetensors", "meta.json"):
        raw = (path / name).read_bytes()
        assert manifest["files"][name] == {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}


@pytest.mark.unit
def test_the_file_is_standard_safetensors_that_other_readers_load(tmp_path: Path) -> None:
    """By hand (the layout the format specifies) and through safetensors' torch reader, which is what a
    user loading θ into a model calls."""
    import torch
    from safetensors.torch import load_file

    tensors = sample_tensors()
    file = ck.save(tmp_path, 1, tensors, {}) / "tensors.safetensors"
    header, data = read_by_hand(file.read_bytes())
    assert header.pop("__metadata__") == {"diloco_step": "1"}
    assert set(header) == set(tensors)
    for name, arr in tensors.items():
        begin, end = header[name]["data_offsets"]
        assert header[name]["shape"] == list(arr.shape) and data[begin:end] == arr.astype(arr.dtype.newbyteorder("<")
                                                                                          ).tobytes()
    by_torch = load_file(file)
    assert torch.equal(by_torch["f32"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert by_torch["u8"].tolist() == [0, 255, 1] and by_torch["f64_scalar"].shape == ()


@pytest.mark.unit
def test_any_layout_of_input_is_stored_as_its_values(tmp_path: Path) -> None:
    big_endian = np.array([1.5, -2.0], dtype=">f4")
    fortran = np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3))
    strided = np.arange(20, dtype=np.float32)[::3]
    ck.save(tmp_path, 1, {"be": big_endian, "fortran": fortran, "strided": strided}, {})
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None
    assert loaded.tensors["be"].dtype == np.dtype("<f4") and loaded.tensors["be"].tolist() == [1.5, -2.0]
    np.testing.assert_array_equal(loaded.tensors["fortran"], fortran)
    np.testing.assert_array_equal(loaded.tensors["strided"], strided)


@pytest.mark.unit
def test_invalid_input_is_rejected_before_touching_disk(tmp_path: Path) -> None:
    import torch

    root = tmp_path / "r"
    with pytest.raises(CheckpointError, match="meta is not strict JSON"):
        ck.save(root, 1, small(1), {"loss": float("nan")})
    with pytest.raises(CheckpointError, match="meta is not strict JSON"):
        ck.save(root, 1, small(1), {"obj": object()})
    with pytest.raises(CheckpointError, match=r"is a Tensor, not a numpy array.*\.numpy\(\)"):
        ck.save(root, 1, {"x": torch.zeros(3)}, {})  # type: ignore[dict-item]
    for bad in (np.zeros(2, dtype=np.complex64), np.array(["a"], dtype=object)):
        with pytest.raises(CheckpointError, match="not storable: cast it to"):
            ck.save(root, 1, {"x": bad}, {})
    with pytest.raises(CheckpointError, match="invalid tensor name"):
        ck.save(root, 1, {"__metadata__": np.zeros(1)}, {})
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
    assert loaded is not None and loaded.step == 5 and loaded.meta == {"v": 2}
    assert_same(loaded.tensors, small(2))
    assert os.listdir(tmp_path) == ["ckpt-000000000005"]


@pytest.mark.unit
def test_progress_is_reported_while_safetensors_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ck, "_PROGRESS_SECONDS", 0.001)
    big = np.zeros(64 << 20, dtype=np.uint8)
    seen: list[tuple[int, int]] = []
    ck.save(tmp_path, 7, {"big": big, "small": np.zeros(2, dtype=np.float32)}, {"round": 7},
            progress=lambda done, total: seen.append((done, total)))
    total = big.nbytes + 8
    assert len(seen) >= 2 and seen[-1] == (total, total) and {t for _, t in seen} == {total}
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert any(0 < d < total for d, _ in seen), seen  # reported while the file grew, not only at the end


# -------------------------------------------------------------------------------------------------
# headers that lie: safetensors refuses them when the file is opened, and the reader falls back

def encode_raw(header: Any, data: bytes, n: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if n is None else n) + raw + data


def t(dtype: str, shape: list[Any], begin: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


LIES: dict[str, tuple[bytes, str]] = {
    "offsets beyond the file": (encode_raw({"a": t("F32", [10**12], 0, 4 * 10**12)}, b"\x00" * 16),
                                "incomplete metadata"),
    "end before begin": (encode_raw({"a": t("U8", [0], 8, 4)}, b"\x00" * 16), "invalid offset"),
    "overlapping": (encode_raw({"a": t("F32", [2], 0, 8), "b": t("F32", [2], 4, 12)}, b"\x00" * 12), "invalid offset"),
    "gap": (encode_raw({"a": t("F32", [1], 0, 4), "b": t("F32", [1], 8, 12)}, b"\x00" * 12), "invalid offset"),
    "wrong length": (encode_raw({"a": t("F32", [3], 0, 8)}, b"\x00" * 8), "invalid shape"),
    "huge shape": (encode_raw({"a": t("F32", [2**40, 2**40, 2**40], 0, 8)}, b"\x00" * 8), "overflow"),
    "huge dims": (encode_raw({"a": t("F32", [10**300] * 3000, 0, 8)}, b"\x00" * 8), "invalid JSON"),
    "float8 dtype": (encode_raw({"a": t("F8_E4M3", [1], 0, 1)}, b"\x00"), "has dtype F8_E4M3"),
    "unknown dtype": (encode_raw({"a": t("F7", [1], 0, 1)}, b"\x00"), "invalid JSON"),
    "negative dim": (encode_raw({"a": t("U8", [-1], 0, 0)}, b""), "invalid JSON"),
    "bool dim": (encode_raw({"a": t("U8", [True], 0, 1)}, b"\x00"), "invalid JSON"),
    "float offset": (encode_raw({"a": t("U8", [1], 0.0, 1)}, b"\x00"), "invalid JSON"),
    "trailing data": (encode_raw({"a": t("U8", [1], 0, 1)}, b"\x00" * 9), "incomplete metadata"),
    "huge header length": (encode_raw({"a": t("U8", [1], 0, 1)}, b"\x00", n=2**63), "header too large"),
    "header past the end": (encode_raw({"a": t("U8", [1], 0, 1)}, b"\x00", n=10_000), "invalid header length"),
    "too short": (b"\x05\x00\x00", "header too small"),
    "not json": (encode_raw(b"{not json}", b""), "invalid JSON"),
    "not utf-8": (encode_raw(b'{"\xff": 1}', b""), "invalid UTF-8"),
    "not an object": (encode_raw([1, 2], b""), "invalid JSON"),
    "duplicate names": (encode_raw(b'{"a":' + json.dumps(t("U8", [1], 0, 1)).encode() + b',"a":'
                                   + json.dumps(t("U8", [1], 1, 2)).encode() + b"}", b"\x00\x00"), "invalid offset"),
    "NaN constant": (encode_raw(b'{"__metadata__": {"x": NaN}}', b""), "invalid JSON"),
    "bad metadata": (encode_raw({"__metadata__": {"x": 1}}, b""), "invalid JSON"),
    "deep nesting": (encode_raw(b"[" * 100_000 + b"]" * 100_000, b""), "invalid JSON"),
}


def two_checkpoints(root: Path) -> tuple[Path, Path]:
    old = ck.save(root, 1, {"x": np.arange(1000, dtype=np.float32)}, {"n": 1})
    new = ck.save(root, 2, {"x": np.arange(1000, dtype=np.float32) * 2}, {"n": 2})
    return old, new


def assert_falls_back(root: Path, bad: Path, reason: str) -> None:
    loaded = ck.load_latest(root)
    assert loaded is not None and loaded.step == 1 and loaded.meta == {"n": 1}
    np.testing.assert_array_equal(loaded.tensors["x"], np.arange(1000, dtype=np.float32))
    assert [p for p, _ in loaded.skipped] == [bad]
    assert reason in loaded.skipped[0][1], loaded.skipped


def rewrite_manifest(ckpt: Path) -> None:
    """Make the manifest agree with whatever the files hold now (a writer that lies consistently)."""
    files = {n: {"sha256": hashlib.sha256((ckpt / n).read_bytes()).hexdigest(), "bytes": (ckpt / n).stat().st_size}
             for n in ("tensors.safetensors", "meta.json")}
    step = int(ckpt.name.split("-")[1])
    (ckpt / "MANIFEST.json").write_text(json.dumps({"format": 1, "step": step, "files": files}))


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(LIES))
def test_a_lying_header_with_a_matching_manifest_is_refused_fast(tmp_path: Path, case: str) -> None:
    buf, message = LIES[case]
    _, new = two_checkpoints(tmp_path)
    (new / "tensors.safetensors").write_bytes(buf)
    rewrite_manifest(new)
    t0 = time.perf_counter()
    assert_falls_back(tmp_path, new, "tensors.safetensors")
    assert time.perf_counter() - t0 < 2.0
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None and message in loaded.skipped[0][1], loaded.skipped


# -------------------------------------------------------------------------------------------------
# fallback past bad checkpoints

def flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


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
    ("manifest duplicate key", "duplicate key"),
    ("manifest wrong step", "does not match directory step 2"),
    ("manifest wrong format", "format 2 is not 1"),
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
    elif damage == "manifest duplicate key":
        (new / "MANIFEST.json").write_text('{"step": 2, "step": 2}')
    elif damage == "manifest wrong step":
        (new / "MANIFEST.json").write_text(json.dumps({**manifest, "step": 3}))
    else:
        (new / "MANIFEST.json").write_text(json.dumps({**manifest, "format": 2}))
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
    assert loaded is not None and loaded.step == 1 and loaded.skipped == []
    assert_same(loaded.tensors, small(1, 16 << 10))


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
        assert (loaded.step, loaded.meta) == (1, {"step": 1})
        assert_same(loaded.tensors, small(1, 8 << 10))
    assert failed_in == {"tensors.safetensors", "meta.json", "MANIFEST.json"}


# -------------------------------------------------------------------------------------------------
# kill -9 during a write

def spawn_writer(root: Path, start: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-I", str(WRITER), str(MODULE), str(root), str(start)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)


def verify(loaded: ck.Loaded) -> None:
    assert_same(loaded.tensors, checkpoint_writer.tensors(loaded.step))
    assert loaded.meta == checkpoint_writer.meta(loaded.step)
    assert hashlib.sha256(loaded.tensors["w"].tobytes()).hexdigest() == loaded.meta["sha256"]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_kill_9_during_writes_always_leaves_a_verified_checkpoint(tmp_path: Path) -> None:
    iterations, rng = 80, random.Random(1234)  # ~45% of kills land mid-write: dozens of partial writes
    root = tmp_path / "ckpts"
    ck.save(root, 0, checkpoint_writer.tensors(0), checkpoint_writer.meta(0))
    newest_durable, mid_write, unreported, errors, t0 = 0, 0, 0, [], time.monotonic()
    for i in range(iterations):
        proc = spawn_writer(root, (i + 1) * 1000)
        try:
            assert proc.stdout is not None and proc.stderr is not None
            ready = proc.stdout.readline().split()
            assert ready == [b"ready", b"False"], (ready, proc.stderr.read())
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
    ck.save(root, 10**9, checkpoint_writer.tensors(0), checkpoint_writer.meta(0), keep=1)
    assert tmp_dirs(root) == [] and len(ck.list_checkpoints(root)) == 1
    print(f"\nkill -9: {iterations}/{iterations} verified; {mid_write} kills landed mid-write and load_latest "
          f"fell back past the partial write; {unreported} loaded a checkpoint whose save() never returned; "
          f"{time.monotonic() - t0:.1f} s")
    assert mid_write > 0, "no kill landed inside a save: the test did not exercise partial writes"


# -------------------------------------------------------------------------------------------------
# without safetensors; hygiene

def run_without_safetensors(code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter where `import safetensors` fails, as it does when it is not installed."""
    return fresh_python(code, without=["safetensors"])


def test_without_safetensors_saving_and_loading_say_how_to_install_it(tmp_path: Path) -> None:
    ck.save(tmp_path / "full", 1, small(1), {})
    out = run_without_safetensors(f"""
import numpy as np
from pathlib import Path
from diloco.checkpoint import CheckpointError, load_latest, save
assert load_latest(Path({str(tmp_path / 'empty')!r})) is None  # nothing to load needs no package
for attempt in (lambda: save(Path({str(tmp_path / 'new')!r}), 1, {{"x": np.zeros(2)}}, {{}}),
                lambda: load_latest(Path({str(tmp_path / 'full')!r}))):
    try:
        attempt()
    except CheckpointError as e:
        print(e)
""")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all('safetensors package, which is not installed: pip install "diloco[checkpoint]"'
                                   in line for line in lines), lines
    assert not (tmp_path / "new").exists()


def test_without_safetensors_a_run_with_checkpoints_stops_before_it_starts(tmp_path: Path) -> None:
    out = run_without_safetensors(f"""
from diloco.config import ConfigError
from diloco.job.train import JobConfig
JobConfig()  # no checkpoints: nothing needed
try:
    JobConfig(checkpoint_dir={str(tmp_path)!r})
except ConfigError as e:
    print(e)
""")
    assert out.returncode == 0, out.stderr
    assert 'pip install "diloco[checkpoint]"' in out.stdout and "--checkpoint-dir" in out.stdout


@pytest.mark.unit
def test_no_pickle_and_no_torch_import() -> None:
    source = MODULE.read_text()
    assert "pickle" not in source and "torch.load" not in source
    assert "import torch" not in source and "from ." not in source


def test_module_loads_standalone_without_torch_or_numpy() -> None:
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('c', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); sys.modules['c'] = m; s.loader.exec_module(m); "
            "print(sorted(k for k in ('torch', 'numpy', 'safetensors') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(MODULE)], capture_output=True, check=True)
    assert out.stdout.strip() == b"[]"
