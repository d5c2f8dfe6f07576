"""The global state every peer must hold identically: θ, the outer optimizer's state, the round.

The state is laid out as a header (round, every tensor's name, dtype and shape, the outer
optimizer's non-tensor values) and one stream of raw little-endian tensor bytes (θ, then every
outer-state tensor), cut into chunks of `CHUNK_BYTES`. Its `Manifest` is the header plus the SHA-256
of every chunk, and `digest()` is the SHA-256 of the manifest: two peers with equal digests hold
bit-identical state, and a peer catching up can check every chunk it downloads, from any peer,
against the digest the swarm advertises before it has the rest (`Receiver`). Hashing reads the
tensors in place: no copy of the state is made to compute the digest.

`to_bytes()` / `load_bytes()` move the whole state in one message (inside a site, in checkpoints) as
msgpack of raw little-endian tensors: no pickle, and every name, shape and dtype is checked against
what we expect before anything is loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Iterator, Sequence, TypeVar

import msgpack
import torch

from .compression.errors import DiLoCoError
from .outer import OuterFactory, is_pinned

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32}


def _host_copy(p: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """An fp32 copy of `p` on `device`: in pinned host memory when that is the CPU and `p` is on a GPU (or pinned
    itself), so copies between them need not stage. A model on the CPU leaves CUDA alone, even where there is one."""
    copy = p.detach().to(device=device if device is not None else p.device, dtype=torch.float32, copy=True)
    if copy.device.type == "cpu" and (p.is_cuda or is_pinned(p)):
        copy = copy.pin_memory()
    return copy


def pinned(state: GlobalState, outer_factory: OuterFactory) -> GlobalState:
    """`state` with θ in pinned host memory (the same values and digest), as a model on a GPU wants it; `state`
    itself when θ is pinned already or not in host memory. A downloaded, resumed or handed-out state arrives in
    ordinary host memory."""
    if all(is_pinned(p) or p.device.type != "cpu" for p in state.params):
        return state
    tensors, scalars = state.layout()
    return GlobalState.from_layout([(n, t.pin_memory() if n.startswith("p") else t) for n, t in tensors], scalars,
                                   state.round, outer_factory)


def schema_digest(named_params: Sequence[tuple[str, torch.Tensor]], compression: str) -> str:
    """SHA-256 over parameter names, shapes and dtypes and the compression spec: peers whose
    digests differ cannot exchange pseudo-gradients (their frames are rejected as wrong_schema)."""
    h = hashlib.sha256(f"compression={compression}".encode())
    for name, p in named_params:
        h.update(f"|{name}:{tuple(p.shape)}:{p.dtype}".encode())
    return h.hexdigest()[:16]


class StateError(DiLoCoError, ValueError):
    """Downloaded state does not fit this model (shape, dtype, count) or is malformed."""


CHUNK_BYTES = 4 << 20
"""Bytes of state per chunk: what a catching-up peer downloads, checks and resumes by."""
_MANIFEST = struct.Struct("<4sIQI")  # magic, header length, total tensor bytes, chunk bytes
_MAGIC = b"DLS1"
_MAX_HEADER = 16 << 20
_TENSOR_NAME = re.compile(r"^(p\d+|o\d+\.[A-Za-z_][A-Za-z0-9_]{0,63})$")
assert sys.byteorder == "little", "the state's wire format is little-endian; this host is not"


@dataclass(frozen=True)
class Manifest:
    """What the state is made of, and the SHA-256 of every chunk of its tensor bytes (see the module
    docstring); `digest` names it."""

    header: bytes
    total: int
    chunk: int
    hashes: tuple[bytes, ...]

    def pack(self) -> bytes:
        return _MANIFEST.pack(_MAGIC, len(self.header), self.total, self.chunk) + self.header + b"".join(self.hashes)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.pack()).hexdigest()[:16]

    def span(self, index: int) -> tuple[int, int]:
        """Byte range [lo, hi) of chunk `index` in the tensor stream."""
        return index * self.chunk, min(self.total, (index + 1) * self.chunk)

    @classmethod
    def unpack(cls, data: bytes) -> Manifest:
        """Parse a manifest from the network; raises StateError for anything malformed."""
        if len(data) < _MANIFEST.size:
            raise StateError(f"manifest of {len(data)} bytes is shorter than its {_MANIFEST.size}-byte head")
        magic, hlen, total, chunk = _MANIFEST.unpack_from(data)
        if magic != _MAGIC:
            raise StateError(f"manifest magic {magic!r} is not {_MAGIC!r} (another diloco version?)")
        if not 0 < chunk <= 1 << 30 or hlen > _MAX_HEADER:
            raise StateError(f"manifest chunk size {chunk} or header size {hlen} out of range")
        count = -(-total // chunk)
        if len(data) != _MANIFEST.size + hlen + 32 * count:
            raise StateError(f"manifest of {len(data)} bytes does not hold a {hlen}-byte header and {count} hashes")
        body = data[_MANIFEST.size + hlen:]
        return cls(bytes(data[_MANIFEST.size:_MANIFEST.size + hlen]), total, chunk,
                   tuple(bytes(body[32 * i:32 * i + 32]) for i in range(count)))


def manifest_header(round_: int, tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                    scalars: Sequence[tuple[str, Any]]) -> bytes:
    """The state header a manifest starts with: the round, every tensor's (name, dtype, shape) in stream order,
    and the outer optimizer's non-tensor values."""
    return bytes(msgpack.packb({"round": round_,
                                "tensors": [[n, str(d).removeprefix("torch."), list(s)] for n, d, s in tensors],
                                "scalars": [[n, v] for n, v in scalars]}, use_bin_type=True))


class GlobalState:
    """θ (fp32 copies of the model's parameters), the outer optimizer over θ, and the round."""

    def __init__(self, params: Sequence[torch.Tensor], outer_factory: OuterFactory,
                 device: torch.device | str | None = None) -> None:
        """`device`: where θ and the outer state live (default: where `params` are). The wrapper keeps them
        in host memory, θ pinned when the model is on a GPU, so the model pays no GPU memory for them."""
        self.params = [_host_copy(p, device) for p in params]
        self.outer = outer_factory(self.params)
        self.round = 0

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def digest(self) -> str:
        return self.manifest().digest

    def layout(self) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, Any]]]:
        """(tensors, non-tensor values) in the state's canonical order: θ as p0, p1, …, then the outer
        optimizer's state of parameter i as oi.<name>, by index and name."""
        tensors: list[tuple[str, torch.Tensor]] = [(f"p{i}", p) for i, p in enumerate(self.params)]
        scalars: list[tuple[str, Any]] = []
        for idx, entry in sorted(self.outer.state_dict()["state"].items()):
            for name, value in sorted(entry.items()):
                (tensors if torch.is_tensor(value) else scalars).append((f"o{idx}.{name}", value))
        return tensors, scalars

    def manifest(self, chunk: int = CHUNK_BYTES, *, previous: Manifest | None = None,
                 touched: Collection[int] | None = None, workers: int | None = None) -> Manifest:
        """The header and the SHA-256 of every chunk, hashing the tensors in place. With `previous` (the manifest of
        this state before a change) and `touched` (the parameters that change changed: their θ and outer state),
        only the chunks that hold a touched tensor's bytes are hashed again (a fragment's outer step costs that
        fragment), provided the tensors are laid out as before; otherwise, all of them. `workers`: threads that hash
        chunks at once (default: up to 4, one a core)."""
        tensors, scalars = self.layout()
        listed = [(n, t.dtype, tuple(t.shape)) for n, t in tensors]
        header = manifest_header(self.round, listed, scalars)
        sizes = [t.numel() * t.element_size() for _, t in tensors]
        total = sum(sizes)
        count = -(-total // chunk)
        hashes: list[bytes] = [b""] * count
        todo: Sequence[int] = range(count)
        if previous is not None and touched is not None and previous.total == total and previous.chunk == chunk \
                and _tensors_of(previous.header) == _tensors_of(header):
            hashes, chosen = list(previous.hashes), set(touched)
            todo = _chunks_of(sizes, [_param_of(n) in chosen for n, _, _ in listed], chunk)
        workers = workers or min(4, os.cpu_count() or 1)
        with contextlib.ExitStack() as stack:
            mapper: Mapper = map
            if len(todo) > 2 and workers > 1:
                mapper = stack.enter_context(ThreadPoolExecutor(max_workers=workers)).map
            if any(t.is_cuda for _, t in tensors):
                fresh = _hash_staged([t for _, t in tensors], total, chunk, todo, mapper)
            else:
                views = [byte_view(t) for _, t in tensors]
                fresh = dict(zip(todo, mapper(lambda i: _hash_range(views, i * chunk, min(total, (i + 1) * chunk)),
                                              todo)))
        for i, h in fresh.items():
            hashes[i] = h
        return Manifest(header, total, chunk, tuple(hashes))

    def receiver(self, manifest: Manifest) -> Receiver:
        """Somewhere to download the state `manifest` describes, checked against this model first."""
        return Receiver(self, manifest)

    @classmethod
    def assemble(cls, params: list[torch.Tensor], outer_factory: OuterFactory, outer_state: dict[int, dict[str, Any]],
                 round_: int) -> GlobalState:
        """A state made of `params` themselves (no copy) and `outer_state`; raises StateError if it does not fit."""
        state = cls.__new__(cls)
        state.params, state.round = params, round_
        state.outer = outer_factory(params)
        sd = state.outer.state_dict()
        sd["state"] = outer_state
        try:
            state.outer.load_state_dict(sd)
        except Exception as e:  # noqa: BLE001 - a state from the network that does not fit
            raise StateError(f"outer optimizer state does not fit: {e}") from e
        return state

    @classmethod
    def from_layout(cls, tensors: Sequence[tuple[str, torch.Tensor]], scalars: Sequence[tuple[str, Any]], round_: int,
                    outer_factory: OuterFactory, device: torch.device | None = None) -> GlobalState:
        """The state whose `layout()` is (`tensors`, `scalars`): θ as p0, p1, … and the outer optimizer's state as
        oI.NAME, each moved to `device` (no copy when it is already there); raises StateError if it does not fit."""
        params = [t.to(device) if device is not None else t for n, t in tensors if n.startswith("p")]
        outer: dict[int, dict[str, Any]] = {}
        for name, value in [*((n, t) for n, t in tensors if n.startswith("o")), *scalars]:
            idx, key = name[1:].split(".", 1)
            outer.setdefault(int(idx), {})[key] = value.to(device) if device is not None and torch.is_tensor(value) \
                else value
        return cls.assemble(params, outer_factory, outer, round_)

    def to_bytes(self) -> bytes:
        outer_state = {
            str(idx): {name: _pack_value(v) for name, v in entry.items()}
            for idx, entry in self.outer.state_dict()["state"].items()
        }
        return bytes(msgpack.packb({
            "round": self.round,
            "params": [_pack_tensor(p) for p in self.params],
            "outer": outer_state,
        }, use_bin_type=True))

    def load_bytes(self, data: bytes) -> None:
        """Replace our state with `data` (from `to_bytes` on a peer); raises StateError if it does not fit.
        Nothing else escapes: the bytes come from the network."""
        try:
            self._load(data)
        except StateError:
            raise
        except Exception as e:  # noqa: BLE001 - any other failure on peer bytes is a bad state, not a crash
            raise StateError(f"state does not load: {type(e).__name__}: {e}") from e

    def _load(self, data: bytes) -> None:
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=len(data))
        except Exception as e:  # msgpack raises many types on malformed input
            raise StateError(f"state is not valid msgpack: {e}") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("params"), list):
            raise StateError("state lacks params")
        rnd = obj.get("round")
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            raise StateError(f"state round must be a non-negative int, got {rnd!r}")
        if len(obj["params"]) != len(self.params):
            raise StateError(f"state has {len(obj['params'])} tensors, this model has {len(self.params)}")
        params = [_unpack_tensor(t, expect=p) for t, p in zip(obj["params"], self.params)]
        outer = obj.get("outer", {})
        if not isinstance(outer, dict):
            raise StateError("outer optimizer state must be a map")
        state: dict[int, dict[str, Any]] = {}
        for idx, entry in outer.items():
            if not (isinstance(idx, str) and idx.isdigit() and int(idx) < len(self.params) and isinstance(entry, dict)):
                raise StateError(f"bad outer state entry {idx!r}")
            state[int(idx)] = {str(k): _unpack_value(v, like=self.params[int(idx)]) for k, v in entry.items()}
        with torch.no_grad():
            for dst, src in zip(self.params, params):
                dst.copy_(src)
        sd = self.outer.state_dict()
        sd["state"] = state
        try:
            self.outer.load_state_dict(sd)
        except Exception as e:
            raise StateError(f"outer optimizer state does not fit: {e}") from e
        self.round = rnd


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes()


def _pack_tensor(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": _tensor_bytes(t)}


def _unpack_tensor(obj: Any, expect: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(obj, dict) or obj.get("dtype") not in _DTYPES:
        raise StateError(f"bad tensor entry (dtype {obj.get('dtype') if isinstance(obj, dict) else None!r})")
    shape, data, dtype = obj.get("shape"), obj.get("data"), _DTYPES[obj["dtype"]]
    if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape) and isinstance(data, bytes)):
        raise StateError("bad tensor shape or data")
    if expect is not None and (tuple(shape) != tuple(expect.shape) or dtype != expect.dtype):
        raise StateError(f"tensor {tuple(shape)} {dtype} does not match expected {tuple(expect.shape)} {expect.dtype}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)  # Python ints: no overflow however large the claimed shape
    if len(shape) > 8 or len(data) != numel * itemsize:
        raise StateError(f"tensor data has {len(data)} bytes, shape {shape} needs {numel * itemsize}")
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
    return (raw.view(torch.bfloat16) if dtype == torch.bfloat16 else raw).reshape(shape).clone()


def _pack_value(v: Any) -> Any:
    if torch.is_tensor(v):
        return {"tensor": _pack_tensor(v)}
    if isinstance(v, (int, float, bool)) or v is None:
        return {"scalar": v}
    raise TypeError(f"cannot serialize outer optimizer state value of type {type(v).__name__}")


def _unpack_value(v: Any, like: torch.Tensor) -> Any:
    if isinstance(v, dict) and "tensor" in v:
        t = _unpack_tensor(v["tensor"])
        if tuple(t.shape) != tuple(like.shape) and t.dim() != 0:  # buffers match the parameter; scalars (step) are 0-d
            raise StateError(f"outer state tensor of shape {tuple(t.shape)} for a parameter of {tuple(like.shape)}")
        return t
    if isinstance(v, dict) and "scalar" in v and (v["scalar"] is None or isinstance(v["scalar"], (int, float, bool))):
        return v["scalar"]
    raise StateError("bad outer state value")


class Receiver:
    """A state being downloaded chunk by chunk: every chunk is checked against the manifest's hash
    before it is written into fresh tensors, so a tampered chunk never lands, and chunks may come
    from any peer in any order. `assemble()` makes the state once every chunk is in."""

    def __init__(self, like: GlobalState, manifest: Manifest) -> None:
        try:
            head = msgpack.unpackb(manifest.header, raw=False, strict_map_key=True, max_bin_len=0,
                                   max_array_len=1 << 20, max_map_len=16)
        except Exception as e:  # msgpack raises many types on malformed input
            raise StateError(f"state header is not valid msgpack: {e}") from e
        if not isinstance(head, dict) or not {"round", "tensors", "scalars"} <= set(head):
            raise StateError("state header needs round, tensors and scalars")
        rnd, described, scalars = head["round"], head["tensors"], head["scalars"]
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
            raise StateError(f"state round must be a non-negative int, got {rnd!r}")
        if not isinstance(described, list) or not isinstance(scalars, list):
            raise StateError("state header's tensors and scalars must be lists")
        self.manifest, self.round = manifest, rnd
        self._device = like.params[0].device if like.params else torch.device("cpu")
        self.tensors = [_fresh_tensor(entry, like.params) for entry in described]  # in host memory
        names = [n for n, _ in self.tensors]
        if names[:len(like.params)] != [f"p{i}" for i in range(len(like.params))] or len(set(names)) != len(names) or \
                any(not n.startswith("o") for n in names[len(like.params):]):
            raise StateError(f"state holds tensors {names[:6]}…, this model needs p0…p{len(like.params) - 1} first")
        self.scalars = [_scalar(entry, len(like.params)) for entry in scalars]
        self._views = [byte_view(t) for _, t in self.tensors]
        if sum(v.nbytes for v in self._views) != manifest.total:
            raise StateError(f"state header describes {sum(v.nbytes for v in self._views)} bytes, its manifest "
                             f"{manifest.total}")
        self.done: set[int] = set()

    @property
    def chunks(self) -> int:
        return len(self.manifest.hashes)

    @property
    def received(self) -> int:
        return sum(hi - lo for lo, hi in map(self.manifest.span, self.done))

    def write(self, index: int, data: bytes) -> None:
        """Check chunk `index` against the manifest and write it; raises StateError if it does not match."""
        if not 0 <= index < self.chunks:
            raise StateError(f"chunk {index} of a state of {self.chunks} chunks")
        lo, hi = self.manifest.span(index)
        if len(data) != hi - lo or hashlib.sha256(data).digest() != self.manifest.hashes[index]:
            raise StateError(f"chunk {index} ({len(data)} bytes) does not match its hash in the manifest")
        src = memoryview(data)
        for offset, piece in pieces_of(self._views, lo, hi):
            piece[:] = src[offset - lo: offset - lo + piece.nbytes]
        self.done.add(index)

    def assemble(self, outer_factory: OuterFactory) -> GlobalState:
        """The downloaded state (its tensors are the ones written: no copy)."""
        if len(self.done) != self.chunks:
            raise StateError(f"{self.chunks - len(self.done)} of {self.chunks} chunks are missing")
        return GlobalState.from_layout(self.tensors, self.scalars, self.round, outer_factory, self._device)


def _fresh_tensor(entry: Any, params: Sequence[torch.Tensor]) -> tuple[str, torch.Tensor]:
    """An empty tensor for one (name, dtype, shape) of a state header, checked against our parameters."""
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and _TENSOR_NAME.match(entry[0])
            and entry[1] in _DTYPES and isinstance(entry[2], list) and len(entry[2]) <= 8
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[2])):
        raise StateError(f"bad tensor entry in the state header: {str(entry)[:80]}")
    name, dtype, shape = entry[0], _DTYPES[entry[1]], tuple(entry[2])
    index = int(name[1:].split(".")[0])
    if index >= len(params):
        raise StateError(f"state tensor {name} names parameter {index}; this model has {len(params)}")
    like = params[index]
    if name.startswith("p") and (shape != tuple(like.shape) or dtype != like.dtype):
        raise StateError(f"tensor {name} {shape} {dtype} does not match expected {tuple(like.shape)} {like.dtype}")
    if name.startswith("o") and shape not in (tuple(like.shape), ()):
        raise StateError(f"outer state tensor {name} of shape {shape} for a parameter of {tuple(like.shape)}")
    return name, torch.empty(shape, dtype=dtype)


def _scalar(entry: Any, params: int) -> tuple[str, Any]:
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and _TENSOR_NAME.match(entry[0])
            and entry[0].startswith("o") and int(entry[0][1:].split(".")[0]) < params
            and (entry[1] is None or isinstance(entry[1], (int, float, bool)))):
        raise StateError(f"bad outer state value in the state header: {str(entry)[:80]}")
    return entry[0], entry[1]


class ChunkHasher:
    """The manifest's chunk hashes of a tensor stream fed piece by piece, in stream order (`GlobalState.manifest`
    hashes tensors it holds whole; an FSDP2 site's leader feeds its ranks' pieces as they arrive)."""

    def __init__(self, chunk: int = CHUNK_BYTES) -> None:
        self.chunk, self.total, self._filled = chunk, 0, 0
        self._h = hashlib.sha256()
        self.hashes: list[bytes] = []

    def feed(self, t: torch.Tensor) -> None:
        data = byte_view(t.reshape(-1))
        self.total += data.nbytes
        while data.nbytes:
            take = min(data.nbytes, self.chunk - self._filled)
            self._h.update(data[:take])
            data, self._filled = data[take:], self._filled + take
            if self._filled == self.chunk:
                self.hashes.append(self._h.digest())
                self._h, self._filled = hashlib.sha256(), 0

    def manifest(self, header: bytes) -> Manifest:
        """The manifest of everything fed, under `header`."""
        if self._filled:
            self.hashes.append(self._h.digest())
            self._h, self._filled = hashlib.sha256(), 0
        return Manifest(header, self.total, self.chunk, tuple(self.hashes))


def params_digest(params: Sequence[torch.Tensor]) -> str:
    """Short SHA-256 of parameters alone (dtype, shape and bytes of each, in order): the same model, whatever
    outer optimizer state or round goes with it (a gossip run's final average)."""
    h = hashlib.sha256()
    for p in params:
        h.update(f"{p.dtype}{tuple(p.shape)};".encode())
        h.update(byte_view(p))
    return h.hexdigest()[:16]


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of `t` as a writable memoryview of its own storage (host tensors; a GPU tensor is copied)."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    if not t.numel():
        return memoryview(bytearray())
    array: Any = t.reshape(-1).view(torch.uint8).numpy()  # shares the tensor's storage
    return memoryview(array)


def _tensors_of(header: bytes) -> Any:
    """The tensor list (names, dtypes, shapes) of a manifest header: its layout, the round and scalars aside."""
    return msgpack.unpackb(header, raw=False).get("tensors")


def _param_of(name: str) -> int:
    """The parameter a state tensor belongs to: pI is θ of parameter I, oI.NAME its outer state."""
    return int(name[1:].split(".", 1)[0])


def _hash_range(views: Sequence[memoryview], lo: int, hi: int) -> bytes:
    """SHA-256 of the stream's bytes [lo, hi)."""
    h = hashlib.sha256()
    for _, piece in pieces_of(views, lo, hi):
        h.update(piece)  # hashlib lets go of the GIL while it hashes a large piece
    return h.digest()


STAGING_BYTES = 64 << 20
"""The window of a GPU state's byte stream that crosses to pinned host memory at once to be hashed (`_hash_staged`)."""


Mapper = Callable[[Callable[[int], bytes], Iterable[int]], Iterator[bytes]]
"""`map`, or a thread pool's: how chunks are hashed, one after the other or several at once."""


def _hash_staged(tensors: Sequence[torch.Tensor], total: int, chunk: int, todo: Sequence[int],
                 mapper: Mapper) -> dict[int, bytes]:
    """The hashes of chunks `todo` of a state on a GPU: its byte stream crosses to the host window by window into
    two pinned buffers, one window copying in (asynchronously, on the current stream: a DMA, where a copy into
    pageable memory would hold the driver's lock and stall the training thread's kernel launches) while the other's
    chunks are hashed. Only windows holding a chunk of `todo` cross."""
    device = next((t.device for t in tensors if t.is_cuda), torch.device("cpu"))  # a host state: for the tests
    flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    per = max(1, STAGING_BYTES // chunk)
    window = per * chunk
    wanted: dict[int, list[int]] = {}
    for i in todo:
        wanted.setdefault(i // per, []).append(i)
    cuda = device.type == "cuda"
    buffers = [torch.empty(min(window, total), dtype=torch.uint8, pin_memory=cuda)
               for _ in range(min(2, len(wanted)))]
    out: dict[int, bytes] = {}

    def drain(job: tuple[int, torch.Tensor, torch.cuda.Event | None]) -> None:
        w, buffer, copied = job
        if copied is not None:
            copied.synchronize()
        view = byte_view(buffer)
        lo = w * window
        hashed = mapper(lambda i: _hash_range([view], i * chunk - lo, min(total, (i + 1) * chunk) - lo), wanted[w])
        out.update(zip(wanted[w], hashed))

    pending: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None
    for k, w in enumerate(sorted(wanted)):
        buffer = buffers[k % 2]
        lo, hi = w * window, min(total, (w + 1) * window)
        for offset, piece in pieces_of(flats, lo, hi):
            buffer[offset - lo:offset - lo + len(piece)].copy_(piece, non_blocking=True)
        copied = None
        if cuda:
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(torch.cuda.current_stream(device))
        if pending is not None:
            drain(pending)  # the window before is hashed while this one crosses
        pending = (w, buffer, copied)
    if pending is not None:
        drain(pending)
    return out


def _chunks_of(sizes: Sequence[int], selected: Sequence[bool], chunk: int) -> list[int]:
    """The chunks (in stream order) that hold any byte of the selected tensors (`sizes`: each one's bytes)."""
    out: set[int] = set()
    start = 0
    for size, chosen in zip(sizes, selected):
        end = start + size
        if chosen and end > start:
            out.update(range(start // chunk, (end - 1) // chunk + 1))
        start = end
    return sorted(out)


_Bytes = TypeVar("_Bytes", memoryview, torch.Tensor)


def pieces_of(views: Sequence[_Bytes], lo: int, hi: int) -> Iterator[tuple[int, _Bytes]]:
    """(stream offset, slice) of every view's part that lies in the stream range [lo, hi): the views are flat
    bytes, memoryviews or uint8 tensors (a GPU state's, `_hash_staged`)."""
    start = 0
    for v in views:
        end = start + len(v)
        if end > lo and start < hi:
            a, b = max(lo, start), min(hi, end)
            yield a, v[a - start:b - start]
        start = end
        if start >= hi:
            break
