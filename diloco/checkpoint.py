"""Atomic, verified checkpoints: named tensors plus JSON metadata, in safetensors; nothing that can
execute code is ever deserialized (only JSON and raw bytes).

This module imports only the standard library (numpy is imported lazily by `to_numpy` /
`from_numpy`), so a process that only writes or reads checkpoints starts fast and never loads torch.
It uses no relative imports, so it can also be loaded straight from its file.

Format on disk
--------------
One directory per checkpoint, ``root/ckpt-<step:012d>/``, holding exactly three files:

``tensors.safetensors``
    The real safetensors format: an 8-byte little-endian u64 header length N, N bytes of UTF-8
    JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
    padded with spaces so the data starts 8-byte aligned, then the data buffer: every tensor's raw
    little-endian bytes, sorted by name, contiguous, no gaps, nothing after the last one.
``meta.json``
    The caller's metadata, one strict JSON object.
``MANIFEST.json``
    Written last: ``{"format": 1, "step": step, "files": {name: {"sha256": hex, "bytes": n}}}``.

Atomicity
---------
`save` writes everything into a private temporary directory ``root/.tmp-ckpt-<step>-<pid>-<hex>``,
fsyncs every file, writes and fsyncs the manifest, fsyncs the directory, and only then
``rename(2)``s it to ``ckpt-<step>``, and fsyncs ``root``. A reader only looks at ``ckpt-*`` names.
Whatever instant a crash (kill -9, power loss) hits:

* before the rename: the new checkpoint exists only under a ``.tmp-`` name that readers ignore,
  so readers see exactly the old set of checkpoints (the leftover is removed by a later `save`
  once its writer's pid is dead);
* at the rename: rename(2) is atomic, so the name appears with all its contents or not at all,
  and its contents were made durable before the name was;
* after the rename: the new checkpoint is complete; pruning moves each doomed checkpoint to a
  ``.tmp-del-`` name (atomic) before deleting it, so a half-deleted checkpoint is never visible.

Re-saving a step that already exists renames the old directory aside (``.tmp-old-``) and the new one
into place. A crash between those two renames leaves neither under that step's name, and the reader
falls back to the next older checkpoint (it never sees a mixture). Even so, nothing the bytes say is
trusted: the reader checks the manifest, every file's size and SHA-256, and every field of the
safetensors header before allocating a tensor.

Failure semantics
-----------------
* `save` raises `CheckpointError` for invalid input (before touching the disk) and for any
  ``OSError`` (disk full, permissions, I/O error), naming the path and the errno text; it removes its
  temporary directory, and the checkpoints that existed before are left intact. A failure while
  pruning old checkpoints after a successful save is only logged.
* `load_latest` returns the newest checkpoint that verifies, skipping (and logging as
  ``event=checkpoint_skipped``) every newer one that does not, with the reason in
  `Loaded.skipped`; it returns None when none verifies or ``root`` does not exist. It raises
  `CheckpointError` only when ``root`` exists but cannot be listed (it cannot tell whether a valid
  checkpoint exists, and silently starting from scratch would be worse).
* Several writers may share ``root`` only if they save different steps; a temporary directory
  whose pid is alive on this host is never removed (``root`` is assumed local to one host).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable, Mapping

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["CheckpointError", "DTYPE_SIZES", "Loaded", "TensorData", "decode_safetensors",
           "decode_safetensors_with_metadata", "encode_safetensors", "from_numpy", "list_checkpoints",
           "load_latest", "save", "to_numpy", "write_safetensors"]

log = logging.getLogger(__name__)

FORMAT = 1
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "MANIFEST.json"
DTYPE_SIZES: dict[str, int] = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                               "I8": 1, "U8": 1, "BOOL": 1}
MAX_HEADER_BYTES = 100_000_000
MAX_JSON_FILE_BYTES = 64 * 1024 * 1024   # meta.json and MANIFEST.json
_CHUNK = 1 << 20
_PROGRESS_CHUNK = 16 << 20   # a save reports its progress at least every this many bytes
_HUGE = 1 << 64   # byte counts beyond this are reported as too big, not computed
_CKPT_RE = re.compile(r"^ckpt-(\d{12,})$")
_TMP_RE = re.compile(r"^\.tmp-[a-z]+-\d+-(\d+)-[0-9a-f]+$")
_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
                 "I8": "i1", "U8": "u1", "BOOL": "?"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class TensorData:
    """One tensor as stored: safetensors dtype code, shape, raw little-endian bytes (C order)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise CheckpointError(f"unknown dtype {self.dtype!r}: use one of {sorted(DTYPE_SIZES)}")
        if not isinstance(self.shape, tuple) or not all(_is_int(d) and d >= 0 for d in self.shape):
            raise CheckpointError(f"shape must be a tuple of non-negative ints, got {self.shape!r}")
        if not isinstance(self.data, bytes):
            raise CheckpointError(f"data must be bytes, got {type(self.data).__name__}: convert with bytes(...)")
        if len(self.data) != self.nbytes:
            raise CheckpointError(f"{self.dtype} tensor of shape {self.shape} needs {self.nbytes} bytes, "
                                  f"got {len(self.data)}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class Loaded:
    """A verified checkpoint, and the newer ones that were passed over as (path, reason)."""

    path: Path
    step: int
    tensors: dict[str, TensorData]
    meta: dict[str, Any]
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---------------------------------------------------------------------------------------------
# safetensors encoding

def _header_bytes(tensors: Mapping[str, TensorData], metadata: Mapping[str, str]) -> bytes:
    """The 8-byte length prefix plus the JSON header, space-padded so the data starts 8-aligned."""
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CheckpointError("safetensors __metadata__ must map str to str: convert values with str()")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _check_tensors(tensors: Mapping[str, TensorData]) -> None:
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise CheckpointError(f"invalid tensor name {name!r}: use a non-empty str other than '__metadata__'")
        if not isinstance(t, TensorData):
            raise CheckpointError(f"tensor {name!r} is a {type(t).__name__}, not TensorData: "
                                  "convert it first (e.g. with from_numpy)")


def write_safetensors(f: IO[bytes], tensors: Mapping[str, TensorData],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Stream a safetensors file to `f` (header, then each tensor's bytes in name order, no big
    concatenation); returns the number of bytes written."""
    _check_tensors(tensors)
    head = _header_bytes(tensors, metadata or {})
    f.write(head)
    total = len(head)
    for name in sorted(tensors):
        f.write(tensors[name].data)
        total += len(tensors[name].data)
    return total


def encode_safetensors(tensors: Mapping[str, TensorData], metadata: Mapping[str, str] | None = None) -> bytes:
    """The whole safetensors file as bytes (for small tensors; use `write_safetensors` to stream)."""
    _check_tensors(tensors)
    parts = [_header_bytes(tensors, metadata or {})]
    parts.extend(tensors[name].data for name in sorted(tensors))
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------
# safetensors decoding: strict, validates everything before allocating

@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise CheckpointError(f"duplicate key in JSON object: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    return dict(pairs)


def _strict_json(raw: bytes, what: str) -> Any:
    """Parse UTF-8 JSON, rejecting duplicate keys, NaN/Infinity and absurdly long integers."""
    def no_constants(name: str) -> Any:
        raise CheckpointError(f"non-standard JSON constant {name}")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=no_constants)
    except CheckpointError as e:
        raise CheckpointError(f"{what}: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{what} is not valid UTF-8 JSON: {e}") from None


def _header_length(prefix: bytes, total_size: int) -> int:
    """Validate the u64 header length against the file size, before reading the header."""
    if total_size < 8 or len(prefix) < 8:
        raise CheckpointError(f"safetensors data too short ({total_size} bytes): no 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"safetensors header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if n > total_size - 8:
        raise CheckpointError(f"safetensors header length {n} runs past the end of the data ({total_size} bytes)")
    if n < 2:
        raise CheckpointError(f"safetensors header length {n} is too short for a JSON object")
    return int(n)


def _nbytes_capped(shape: list[int], itemsize: int, cap: int) -> int:
    """prod(shape) * itemsize, but stop multiplying once past `cap` (a hostile shape of huge dims
    would otherwise cost a product with millions of digits); any result > cap means "too big"."""
    if 0 in shape:
        return 0
    n = itemsize
    for d in shape:
        n *= d
        if n > cap:
            return cap + 1
    return n


def _parse_entry(name: str, spec: Any, data_len: int) -> _Entry:
    where = f"safetensors tensor {name!r}"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{where}: expected an object with exactly dtype, shape, data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if dtype not in DTYPE_SIZES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r} (known: {sorted(DTYPE_SIZES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative ints, got {shape!r:.200}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end] ints, got {offsets!r:.200}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] outside the {data_len}-byte data buffer")
    need = _nbytes_capped(shape, DTYPE_SIZES[dtype], _HUGE)
    if end - begin != need:
        size = "more than 2**64" if need > _HUGE else str(need)
        raise CheckpointError(f"{where}: {dtype} {shape!r:.200} needs {size} bytes, data_offsets span {end - begin}")
    return _Entry(name, dtype, tuple(shape), begin, end)


def _check_layout(entries: list[_Entry], data_len: int) -> None:
    """Tensors must tile the data buffer exactly: no gap, no overlap, no trailing bytes."""
    pos = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin != pos:
            kind = "overlaps the previous tensor" if e.begin < pos else f"leaves a gap at byte {pos}"
            raise CheckpointError(f"safetensors tensor {e.name!r} at [{e.begin}, {e.end}] {kind}")
        pos = e.end
    if pos != data_len:
        raise CheckpointError(f"safetensors data buffer has {data_len - pos} trailing bytes after the last tensor")


def _parse_header(raw: bytes, data_len: int) -> tuple[list[_Entry], dict[str, str]]:
    """Validate a header's JSON against a data buffer of `data_len` bytes; returns the entries
    (in data order) and the __metadata__."""
    header = _strict_json(raw, "safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError("safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError("safetensors __metadata__ must be an object of strings")
    entries = [_parse_entry(name, spec, data_len) for name, spec in header.items()]
    _check_layout(entries, data_len)
    return sorted(entries, key=lambda e: (e.begin, e.name)), meta


def decode_safetensors_with_metadata(
        buf: bytes | bytearray | memoryview) -> tuple[dict[str, TensorData], dict[str, str]]:
    """`decode_safetensors`, also returning the header's __metadata__."""
    view = memoryview(buf).cast("B")
    n = _header_length(bytes(view[:8]), len(view))
    data_len = len(view) - 8 - n
    entries, meta = _parse_header(bytes(view[8:8 + n]), data_len)
    base = 8 + n
    tensors = {e.name: TensorData(e.dtype, e.shape, bytes(view[base + e.begin:base + e.end])) for e in entries}
    return tensors, meta


def decode_safetensors(buf: bytes | bytearray | memoryview) -> dict[str, TensorData]:
    """Parse a safetensors buffer strictly; raises `CheckpointError` on anything malformed. The
    header is fully checked (length, JSON, dtypes, shapes, offsets, tiling) before any tensor is
    copied, so a lying header costs neither time nor memory."""
    return decode_safetensors_with_metadata(buf)[0]


# ---------------------------------------------------------------------------------------------
# numpy helpers (numpy imported lazily)

def to_numpy(t: TensorData) -> npt.NDArray[Any]:
    """A read-only numpy view of `t` (``.copy()`` it to write). BF16 has no numpy dtype: use `t.data`."""
    import numpy as np
    if t.dtype not in _NUMPY_DTYPES:
        raise CheckpointError(f"{t.dtype} has no numpy dtype: use the raw bytes (e.g. torch.frombuffer)")
    if t.dtype == "BOOL" and t.data.translate(None, b"\x00\x01"):
        raise CheckpointError("BOOL tensor holds bytes other than 0 and 1")
    return np.frombuffer(t.data, dtype=np.dtype(_NUMPY_DTYPES[t.dtype])).reshape(t.shape)


def from_numpy(array: npt.ArrayLike) -> TensorData:
    """A `TensorData` holding a C-ordered little-endian copy of `array`'s values."""
    import numpy as np
    arr = np.asarray(array)
    for code, np_name in _NUMPY_DTYPES.items():
        want = np.dtype(np_name)
        if arr.dtype == want or (arr.dtype.kind == want.kind and arr.dtype.itemsize == want.itemsize):
            le = np.asarray(arr, dtype=want, order="C")   # not ascontiguousarray: it makes 0-d 1-d
            return TensorData(code, tuple(int(d) for d in le.shape), le.tobytes())
    raise CheckpointError(f"numpy dtype {arr.dtype} is not storable: cast to one of "
                          f"{sorted(_NUMPY_DTYPES.values())} (BF16: build TensorData('BF16', shape, raw) by hand)")


# ---------------------------------------------------------------------------------------------
# writing a checkpoint

class _HashingFile:
    """Write-through wrapper that hashes and counts what is written."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha, self.count = f, hashlib.sha256(), 0

    def write(self, b: bytes | memoryview) -> int:
        self.sha.update(b)
        self.count += len(b)
        return self.f.write(b)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, chunks: Iterable[bytes | memoryview],
                progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Create `path` (must not exist), write, fsync; returns its manifest entry. `progress(n)` gets
    the bytes written so far after each chunk."""
    try:
        with open(path, "xb") as f:
            h = _HashingFile(f)
            for chunk in chunks:
                h.write(chunk)
                if progress is not None:
                    progress(h.count)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise
    return {"sha256": h.sha.hexdigest(), "bytes": h.count}


def _tensor_chunks(head: bytes, tensors: Mapping[str, TensorData]) -> Iterable[bytes | memoryview]:
    yield head
    for name in sorted(tensors):
        data = memoryview(tensors[name].data)
        for i in range(0, len(data), _PROGRESS_CHUNK):
            yield data[i:i + _PROGRESS_CHUNK]


def _json_bytes(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, sort_keys=True, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not strict JSON ({e}): store only dict/list/str/int/finite float/"
                              "bool/None") from None


def _write_tmp(tmp: Path, step: int, tensors: Mapping[str, TensorData], meta_raw: bytes,
               progress: Callable[[int, int], None] | None) -> None:
    head = _header_bytes(tensors, {"diloco_step": str(step)})
    total = len(head) + sum(t.nbytes for t in tensors.values())
    report = (lambda done: progress(done, total)) if progress is not None else None
    files = {TENSORS_FILE: _write_file(tmp / TENSORS_FILE, _tensor_chunks(head, tensors), report),
             META_FILE: _write_file(tmp / META_FILE, [meta_raw])}
    manifest = {"format": FORMAT, "step": step, "files": files}
    _write_file(tmp / MANIFEST_FILE, [_json_bytes(manifest, "manifest")])
    _fsync_dir(tmp)


def _tmp_name(kind: str, step: int) -> str:
    return f".tmp-{kind}-{step}-{os.getpid()}-{os.urandom(4).hex()}"


def _install(tmp: Path, final: Path, root: Path, step: int) -> None:
    """Rename `tmp` to `final`; an existing `final` is renamed aside first and removed after."""
    aside = None
    if final.exists():
        aside = root / _tmp_name("old", step)
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except OSError:
        if aside is not None:
            os.rename(aside, final)
        raise
    _fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _check_save_args(step: int, tensors: Mapping[str, TensorData], keep: int) -> None:
    if not _is_int(step) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if not _is_int(keep) or keep < 1:
        raise CheckpointError(f"keep must be an int >= 1, got {keep!r}")
    if not isinstance(tensors, Mapping):
        raise CheckpointError(f"tensors must be a dict of name -> TensorData, got {type(tensors).__name__}")
    _check_tensors(tensors)


def _save_error(e: OSError, step: int, fallback: Path, root: Path) -> CheckpointError:
    where = e.filename if e.filename is not None else fallback
    code = errno.errorcode.get(e.errno or 0, "?")
    return CheckpointError(f"cannot save checkpoint step {step} at {where}: {e.strerror or e} ({code}); the "
                           f"previous checkpoints in {root} are intact - free disk space or fix permissions, "
                           "then save again")


def save(root: Path, step: int, tensors: Mapping[str, TensorData], meta: Mapping[str, Any], *,
         keep: int = 3, progress: Callable[[int, int], None] | None = None) -> Path:
    """Atomically write checkpoint `step` under `root` and prune to the newest `keep` checkpoints
    (the new one is never pruned). Returns the checkpoint's directory. Raises `CheckpointError`
    (previous checkpoints intact, no temporary directory left) on invalid input or any OSError.
    `progress(done, total)`: bytes of the tensors file written so far, at least every 16 MiB."""
    root = Path(root)
    _check_save_args(step, tensors, keep)
    if not isinstance(meta, Mapping):
        raise CheckpointError(f"meta must be a dict, got {type(meta).__name__}")
    meta_raw = _json_bytes(dict(meta), "meta")
    final = root / f"ckpt-{step:012d}"
    tmp: Path | None = None
    try:
        if not root.is_dir():
            root.mkdir(parents=True, exist_ok=True)
            _fsync_dir(root.parent)          # make root's own directory entry durable too
        tmp = root / _tmp_name("ckpt", step)
        tmp.mkdir()
        _write_tmp(tmp, step, tensors, meta_raw, progress)
        _install(tmp, final, root, step)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise _save_error(e, step, tmp or root, root) from e
        raise
    _prune(root, keep, final)
    return final


# ---------------------------------------------------------------------------------------------
# listing and pruning

def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``ckpt-<step>`` directory under `root`, newest first (complete or not)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise CheckpointError(f"cannot list checkpoint directory {root}: {e.strerror or e}; "
                              "check that it is mounted and readable") from e
    found = []
    for name in names:
        m = _CKPT_RE.match(name)
        if m and (root / name).is_dir():
            found.append((int(m.group(1)), root / name))
    return sorted(found, reverse=True)


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories that look complete (have a manifest), newest first. Unverified."""
    return [p for _, p in _step_dirs(Path(root)) if (p / MANIFEST_FILE).is_file()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dir(path: Path, root: Path) -> None:
    """Rename to a ``.tmp-del-`` name first (atomic), so no half-deleted checkpoint is ever visible."""
    doomed = root / _tmp_name("del", 0)
    try:
        os.rename(path, doomed)
        shutil.rmtree(doomed)
    except OSError as e:
        log.warning("event=checkpoint_prune_failed path=%s error=%s", path, e)


def _prune(root: Path, keep: int, protect: Path) -> None:
    """Keep the newest `keep` complete checkpoints (and `protect`); remove stale temp dirs."""
    try:
        complete = list_checkpoints(root)
        names = os.listdir(root)
    except (OSError, CheckpointError) as e:
        log.warning("event=checkpoint_prune_failed path=%s error=%s", root, e)
        return
    for path in complete[keep:]:
        if path != protect:
            _remove_dir(path, root)
    for name in names:
        m = _TMP_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(root / name, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# reading a checkpoint: trust nothing

def _read_json_file(path: Path, entry: Mapping[str, Any], what: str) -> Any:
    if entry["bytes"] > MAX_JSON_FILE_BYTES:
        raise CheckpointError(f"{what} claims {entry['bytes']} bytes, over the {MAX_JSON_FILE_BYTES}-byte limit")
    with open(path, "rb") as f:
        raw = f.read(MAX_JSON_FILE_BYTES + 1)
    if len(raw) != entry["bytes"]:
        raise CheckpointError(f"{path.name} has {len(raw)} bytes, manifest says {entry['bytes']} (truncated?)")
    if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{path.name} SHA-256 mismatch (corrupt file)")
    return _strict_json(raw, what)


def _check_manifest(manifest: Any, step: int) -> dict[str, dict[str, Any]]:
    if not isinstance(manifest, dict):
        raise CheckpointError("MANIFEST.json is not a JSON object")
    if manifest.get("format") != FORMAT or not _is_int(manifest.get("format")):
        raise CheckpointError(f"MANIFEST.json format {manifest.get('format')!r} is not {FORMAT}: "
                              "written by an incompatible version")
    if manifest.get("step") != step or not _is_int(manifest.get("step")):
        raise CheckpointError(f"MANIFEST.json step {manifest.get('step')!r} does not match directory step {step}")
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != {TENSORS_FILE, META_FILE}:
        raise CheckpointError(f"MANIFEST.json files must be exactly {TENSORS_FILE} and {META_FILE}")
    for name, entry in files.items():
        ok = (isinstance(entry, dict) and set(entry) == {"sha256", "bytes"} and _is_int(entry["bytes"])
              and entry["bytes"] >= 0 and isinstance(entry["sha256"], str)
              and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) is not None)
        if not ok:
            raise CheckpointError(f"MANIFEST.json entry for {name} must be {{'sha256': 64 hex, 'bytes': int >= 0}}")
    return files


def _hash_fd(f: io.BufferedReader, size: int) -> str:
    h = hashlib.sha256()
    buf = bytearray(min(_CHUNK, max(size, 1)))
    view = memoryview(buf)
    while n := f.readinto(buf):
        h.update(view[:n])
    return h.hexdigest()


def _read_exact(f: IO[bytes], n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CheckpointError(f"short read: wanted {n} bytes, got {len(data)} (file changed while reading?)")
    return data


def _read_tensors(path: Path, entry: Mapping[str, Any]) -> dict[str, TensorData]:
    """Size check, SHA-256 over the whole file, then a strict header parse, then one read per
    tensor (all through one open file, so it is the same bytes that were hashed)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{path.name} has {size} bytes, manifest says {entry['bytes']} (truncated?)")
        if _hash_fd(f, size) != entry["sha256"]:
            raise CheckpointError(f"{path.name} SHA-256 mismatch (corrupt file)")
        f.seek(0)
        n = _header_length(_read_exact(f, 8), size)
        entries, _ = _parse_header(_read_exact(f, n), size - 8 - n)
        return {e.name: TensorData(e.dtype, e.shape, _read_exact(f, e.end - e.begin)) for e in entries}


def _load_dir(path: Path, step: int) -> tuple[dict[str, TensorData], dict[str, Any]]:
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError("missing MANIFEST.json (incomplete or hand-made directory)")
    with open(manifest_path, "rb") as f:
        raw = f.read(MAX_JSON_FILE_BYTES + 1)
    if len(raw) > MAX_JSON_FILE_BYTES:
        raise CheckpointError("MANIFEST.json is too large")
    files = _check_manifest(_strict_json(raw, "MANIFEST.json"), step)
    meta = _read_json_file(path / META_FILE, files[META_FILE], "meta.json")
    if not isinstance(meta, dict):
        raise CheckpointError("meta.json is not a JSON object")
    return _read_tensors(path / TENSORS_FILE, files[TENSORS_FILE]), meta


def load_latest(root: Path) -> Loaded | None:
    """The newest checkpoint under `root` that verifies completely, or None. Newer ones that fail
    are skipped, logged, and listed in `Loaded.skipped`."""
    skipped: list[tuple[Path, str]] = []
    for step, path in _step_dirs(Path(root)):
        try:
            tensors, meta = _load_dir(path, step)
        except (CheckpointError, OSError) as e:
            reason = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            log.warning("event=checkpoint_skipped path=%s reason=%s", path, reason)
            skipped.append((path, reason))
            continue
        return Loaded(path, step, tensors, meta, skipped)
    return None
