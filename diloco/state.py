"""The global state every peer must hold identically: θ, the outer optimizer's state, the round.

`digest()` is a SHA-256 over all of it (round, every parameter's bytes, every outer-optimizer state
tensor and scalar), so two peers with equal digests hold bit-identical state. `to_bytes()` /
`load_bytes()` move it between peers as msgpack of raw little-endian tensors: no pickle, and every
name, shape and dtype is checked against what we expect before anything is loaded.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Sequence

import msgpack
import torch

from .outer import OuterFactory

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32}


def _host_copy(p: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """An fp32 copy of `p` on `device` (pinned host memory when that is the CPU and CUDA is available)."""
    copy = p.detach().to(device=device if device is not None else p.device, dtype=torch.float32, copy=True)
    if copy.device.type == "cpu" and torch.cuda.is_available():
        copy = copy.pin_memory()
    return copy


def schema_digest(named_params: Sequence[tuple[str, torch.Tensor]], compression: str) -> str:
    """SHA-256 over parameter names, shapes and dtypes and the compression spec: peers whose
    digests differ cannot exchange pseudo-gradients (their frames are rejected as wrong_schema)."""
    h = hashlib.sha256(f"compression={compression}".encode())
    for name, p in named_params:
        h.update(f"|{name}:{tuple(p.shape)}:{p.dtype}".encode())
    return h.hexdigest()[:16]


class StateError(ValueError):
    """Downloaded state does not fit this model (shape, dtype, count) or is malformed."""


class GlobalState:
    """θ (fp32 copies of the model's parameters), the outer optimizer over θ, and the round."""

    def __init__(self, params: Sequence[torch.Tensor], outer_factory: OuterFactory,
                 device: torch.device | str | None = None) -> None:
        """`device`: where θ and the outer state live (default: where `params` are). The wrapper keeps them
        in host memory, pinned when CUDA is there, so a model on the GPU pays no GPU memory for them."""
        self.params = [_host_copy(p, device) for p in params]
        self.outer = outer_factory(self.params)
        self.round = 0

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def digest(self) -> str:
        h = hashlib.sha256(f"round={self.round}".encode())
        for p in self.params:
            h.update(p.detach().contiguous().numpy().tobytes())
        for idx, entry in sorted(self.outer.state_dict()["state"].items()):
            for name, value in sorted(entry.items()):
                if torch.is_tensor(value):
                    h.update(f"|{idx}.{name}:{tuple(value.shape)}:{value.dtype}=".encode())
                    h.update(_tensor_bytes(value))
                else:
                    h.update(f"|{idx}.{name}={value!r}".encode())
        return h.hexdigest()[:16]

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
