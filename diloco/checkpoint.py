"""Atomic, verified checkpoints: named numpy arrays plus JSON metadata. The tensors are written and
read by the `safetensors` package (`pip install "diloco[checkpoint]"`); this module adds what that
package does not do: a directory per checkpoint that appears atomically, a manifest with the SHA-256
of every file, fallback past damaged checkpoints, and pruning. Nothing that can execute code is ever
deserialized (only JSON, and safetensors' raw bytes).

This module imports only the standard library at load time (numpy and safetensors when a checkpoint is
written or read), never torch, and uses no relative imports: a process that only writes or reads
checkpoints starts fast, and the module can be loaded straight from its file.

Format on disk
--------------
One directory per checkpoint, ``root/ckpt-<step:012d>/``, holding exactly three files:

``tensors.safetensors``
    Written by ``safetensors.numpy.save_file``, with ``{"diloco_step": "<step>"}`` as its metadata.
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
trusted: the reader checks the manifest and every file's size and SHA-256 before safetensors parses
the tensors file (which validates its header, offsets, dtypes and shapes before it reads a tensor).

Failure semantics
-----------------
* `save` raises `CheckpointError` for invalid input (before touching the disk), when safetensors is
  not installed, and for any I/O error (disk full, permissions), naming the path and the errno text;
  it removes its temporary directory, and the checkpoints that existed before are left intact. A
  failure while pruning old checkpoints after a successful save is only logged.
* `load_latest` returns the newest checkpoint that verifies, skipping (and logging as
  ``event=checkpoint_skipped``) every newer one that does not, with the reason in
  `Loaded.skipped`; it returns None when none verifies or ``root`` does not exist. It raises
  `CheckpointError` when ``root`` exists but cannot be listed (it cannot tell whether a valid
  checkpoint exists, and silently starting from scratch would be worse), and when safetensors is
  not installed.
* Several writers may share ``root`` only if they save different steps; a temporary directory
  whose pid is alive on this host is never removed (``root`` is assumed local to one host).
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any, Callable, Mapping

if __name__ == "diloco.checkpoint":  # beneath diloco.DiLoCoError, as every error of the package
    from diloco.compression.errors import DiLoCoError
else:  # loaded from its file alone (the tests' writer process), it imports nothing of the package
    class DiLoCoError(Exception):  # type: ignore[no-redef]
        """The package's root exception, stood in for."""

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["CheckpointError", "INSTALL_HINT", "Loaded", "list_checkpoints", "load_latest", "require_safetensors",
           "save"]

log = logging.getLogger(__name__)

FORMAT = 1
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "MANIFEST.json"
INSTALL_HINT = 'pip install "diloco[checkpoint]"'
DTYPES = ("F64", "F32", "F16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL")
"""safetensors dtype codes a checkpoint may hold: those numpy has (no BF16, no float8)."""
MAX_JSON_FILE_BYTES = 64 * 1024 * 1024   # meta.json and MANIFEST.json
_CHUNK = 1 << 20
_PROGRESS_SECONDS = 0.25   # a save reports its progress this often while safetensors writes
_CKPT_RE = re.compile(r"^ckpt-(\d{12,})$")
_TMP_RE = re.compile(r"^\.tmp-[a-z]+-\d+-(\d+)-[0-9a-f]+$")
_OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")


class CheckpointError(DiLoCoError, RuntimeError):
    """A checkpoint cannot be written or read; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class Loaded:
    """A verified checkpoint, and the newer ones that were passed over as (path, reason)."""

    path: Path
    step: int
    tensors: dict[str, npt.NDArray[Any]]
    meta: dict[str, Any]
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def require_safetensors() -> ModuleType:
    """The `safetensors` package, or a `CheckpointError` saying how to install it."""
    try:
        import safetensors
    except ImportError:
        raise CheckpointError(f"checkpoints are written with the safetensors package, which is not installed: "
                              f"{INSTALL_HINT}") from None
    return safetensors


# ---------------------------------------------------------------------------------------------
# input checks

_CODES = {("f", 8): "F64", ("f", 4): "F32", ("f", 2): "F16", ("i", 8): "I64", ("i", 4): "I32", ("i", 2): "I16",
          ("i", 1): "I8", ("u", 8): "U64", ("u", 4): "U32", ("u", 2): "U16", ("u", 1): "U8", ("b", 1): "BOOL"}


def _arrays(tensors: Mapping[str, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """The tensors as C-ordered little-endian numpy arrays (no copy when they already are)."""
    import numpy as np

    if not isinstance(tensors, Mapping):
        raise CheckpointError(f"tensors must be a dict of name -> numpy array, got {type(tensors).__name__}")
    out = {}
    for name, arr in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise CheckpointError(f"invalid tensor name {name!r}: use a non-empty str other than '__metadata__'")
        if not isinstance(arr, np.ndarray):
            raise CheckpointError(f"tensor {name!r} is a {type(arr).__name__}, not a numpy array: convert it first "
                                  "(a torch tensor: t.detach().cpu().numpy())")
        if (arr.dtype.kind, arr.dtype.itemsize) not in _CODES:
            raise CheckpointError(f"tensor {name!r} has numpy dtype {arr.dtype}, which is not storable: cast it to "
                                  "float64/32/16, int64/32/16/8, uint64/32/16/8 or bool")
        out[name] = np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C")  # keeps 0-d arrays 0-d
    return out


def _check_save_args(step: int, keep: int, meta: Mapping[str, Any]) -> bytes:
    if not _is_int(step) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if not _is_int(keep) or keep < 1:
        raise CheckpointError(f"keep must be an int >= 1, got {keep!r}")
    if not isinstance(meta, Mapping):
        raise CheckpointError(f"meta must be a dict, got {type(meta).__name__}")
    return _json_bytes(dict(meta), "meta")


def _json_bytes(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, sort_keys=True, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not strict JSON ({e}): store only dict/list/str/int/finite float/"
                              "bool/None") from None


# ---------------------------------------------------------------------------------------------
# writing a checkpoint

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_fd(f: IO[bytes]) -> tuple[str, int]:
    """SHA-256 and length of what is left to read in `f`."""
    h, n = hashlib.sha256(), 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while k := f.readinto(buf):  # type: ignore[attr-defined]
        h.update(view[:k])
        n += k
    return h.hexdigest(), n


def _write_file(path: Path, data: bytes) -> dict[str, Any]:
    """Create `path` (must not exist), write `data`, fsync; returns its manifest entry."""
    try:
        with open(path, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _written(path: Path) -> int:
    """Bytes written so far to the files in `path`, whatever safetensors names its file. Counted as disk
    blocks in use, not sizes: safetensors may size its file first and fill it in after."""
    total = 0
    for entry in os.scandir(path):
        try:
            st = entry.stat()
        except OSError:  # renamed meanwhile
            continue
        total += min(st.st_size, 512 * st.st_blocks)
    return total


def _write_error(e: Exception, path: Path) -> Exception:
    """safetensors reports an I/O error as text ending in "(os error N)": make it the OSError it was, so
    that it is reported like any other (errno name, path); anything else stays a write error."""
    m = _OS_ERROR_RE.search(str(e))
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code), str(path))
    return CheckpointError(f"safetensors could not write {path}: {e}")


def _write_tensors(tmp: Path, arrays: Mapping[str, Any], step: int,
                   progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    """safetensors writes the file (on a thread, so that `progress` can be reported from this one); then
    it is fsynced and hashed. Returns its manifest entry."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    path = tmp / TENSORS_FILE
    total = sum(a.nbytes for a in arrays.values())
    done = 0
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="diloco-checkpoint") as pool:
        job = pool.submit(save_file, dict(arrays), str(path), {"diloco_step": str(step)})
        while not concurrent.futures.wait([job], timeout=_PROGRESS_SECONDS).done:
            if progress is not None:
                done = max(done, min(_written(tmp), total))
                progress(done, total)
        try:
            job.result()
        except SafetensorError as e:
            raise _write_error(e, path) from e
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        digest, size = _hash_fd(f)
    if progress is not None:
        progress(total, total)
    return {"sha256": digest, "bytes": size}


def _write_tmp(tmp: Path, step: int, arrays: Mapping[str, Any], meta_raw: bytes,
               progress: Callable[[int, int], None] | None) -> None:
    files = {TENSORS_FILE: _write_tensors(tmp, arrays, step, progress),
             META_FILE: _write_file(tmp / META_FILE, meta_raw)}
    manifest = {"format": FORMAT, "step": step, "files": files}
    _write_file(tmp / MANIFEST_FILE, _json_bytes(manifest, "manifest"))
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


def _save_error(e: OSError, step: int, fallback: Path, root: Path) -> CheckpointError:
    where = e.filename if e.filename is not None else fallback
    code = errno.errorcode.get(e.errno or 0, "?")
    return CheckpointError(f"cannot save checkpoint step {step} at {where}: {e.strerror or e} ({code}); the "
                           f"previous checkpoints in {root} are intact - free disk space or fix permissions, "
                           "then save again")


def save(root: Path, step: int, tensors: Mapping[str, npt.NDArray[Any]], meta: Mapping[str, Any], *,
         keep: int = 3, progress: Callable[[int, int], None] | None = None) -> Path:
    """Atomically write checkpoint `step` under `root` and prune to the newest `keep` checkpoints
    (the new one is never pruned). Returns the checkpoint's directory. Raises `CheckpointError`
    (previous checkpoints intact, no temporary directory left) on invalid input, without safetensors,
    or on any I/O error. `progress(done, total)`: tensor bytes written so far, every 0.25 s while
    they are written, and once when they all are."""
    root = Path(root)
    meta_raw = _check_save_args(step, keep, meta)
    arrays = _arrays(tensors)
    require_safetensors()
    final = root / f"ckpt-{step:012d}"
    tmp: Path | None = None
    try:
        if not root.is_dir():
            root.mkdir(parents=True, exist_ok=True)
            _fsync_dir(root.parent)          # make root's own directory entry durable too
        tmp = root / _tmp_name("ckpt", step)
        tmp.mkdir()
        _write_tmp(tmp, step, arrays, meta_raw, progress)
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
    """`diloco.peers.reaper.pid_alive`, repeated: this module imports nothing of the package, so that a
    process can load it from its file alone (tests/checkpoint_writer.py, the kill -9 test)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie owner is dead too
    except (OSError, IndexError):
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

def _strict_json(raw: bytes, what: str) -> Any:
    """Parse UTF-8 JSON, rejecting duplicate keys and NaN/Infinity."""
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise CheckpointError(f"duplicate key in JSON object: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
        return dict(pairs)

    def no_constants(name: str) -> Any:
        raise CheckpointError(f"non-standard JSON constant {name}")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except CheckpointError as e:
        raise CheckpointError(f"{what}: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{what} is not valid UTF-8 JSON: {e}") from None


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


def _parse_tensors(path: Path) -> dict[str, npt.NDArray[Any]]:
    """The tensors of a safetensors file, through the package: it validates the whole header (length,
    JSON, dtypes, shapes, offsets that tile the data exactly) when the file is opened, before any tensor
    is read. Each dtype is checked before its tensor is copied out."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
            for name in names:
                code = f.get_slice(name).get_dtype()
                if code not in DTYPES:
                    raise CheckpointError(f"{path.name}: tensor {name!r} has dtype {code}, not one a checkpoint "
                                          f"holds ({', '.join(DTYPES)})")
            return {name: f.get_tensor(name) for name in names}
    except SafetensorError as e:
        raise CheckpointError(f"{path.name} is not a valid safetensors file: {e}") from None


def _read_tensors(path: Path, entry: Mapping[str, Any]) -> dict[str, npt.NDArray[Any]]:
    """Size check and SHA-256 over the whole file, then safetensors parses it. (safetensors opens the
    file again by name: a checkpoint's files never change once its directory has its name, and what the
    wrapper restores is checked once more against the state digest in meta.json.)"""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{path.name} has {size} bytes, manifest says {entry['bytes']} (truncated?)")
        if _hash_fd(f)[0] != entry["sha256"]:
            raise CheckpointError(f"{path.name} SHA-256 mismatch (corrupt file)")
    return _parse_tensors(path)


def _load_dir(path: Path, step: int) -> tuple[dict[str, npt.NDArray[Any]], dict[str, Any]]:
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
    candidates = _step_dirs(Path(root))
    if candidates:
        require_safetensors()
    skipped: list[tuple[Path, str]] = []
    for step, path in candidates:
        try:
            tensors, meta = _load_dir(path, step)
        except (CheckpointError, OSError) as e:
            reason = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            log.warning("event=checkpoint_skipped path=%s reason=%s", path, reason)
            skipped.append((path, reason))
            continue
        return Loaded(path, step, tensors, meta, skipped)
    return None
