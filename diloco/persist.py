"""What a DiLoCo worker writes to a checkpoint, and how it reads it back (format: diloco.checkpoint;
the tensors file is written by the safetensors package).

A checkpoint holds, as safetensors tensors:

- ``theta/<parameter name>``: the global parameters θ, fp32, under the model's own parameter names
  (any safetensors reader can load them as a plain model state);
- ``global_state``: the whole global state (θ, outer-optimizer state, round) as the same strictly
  validated msgpack bytes peers exchange (`GlobalState.to_bytes`), stored as a U8 tensor: this is
  what `read` loads, so a checkpoint passes exactly the checks a downloaded state passes;
- ``ef/<fragment>``: this worker's error-feedback residuals (what it has not delivered yet);

and as metadata: round, state digest, schema digest (model, compression, fragments), inner steps,
schedule position and the last round's members. No pickle anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import numpy.typing as npt
import torch

from . import progress
from .checkpoint import CheckpointError, Loaded, load_latest, save
from .outer import OuterFactory
from .state import GlobalState, StateError


def fp32_array(t: torch.Tensor, what: str) -> npt.NDArray[np.float32]:
    """A CPU fp32 tensor as a numpy array sharing its memory (θ and residuals are always fp32)."""
    if t.dtype != torch.float32:
        raise CheckpointError(f"{what}: expected an fp32 tensor, got {t.dtype}")
    return t.detach().cpu().contiguous().numpy()


def fp32_tensor(arr: npt.NDArray[Any], numel: int, what: str) -> torch.Tensor:
    if arr.dtype != np.float32 or arr.size != numel:
        raise CheckpointError(f"{what}: expected {numel} fp32 values, found {arr.dtype} {arr.shape}")
    return torch.from_numpy(arr.reshape(-1))


def write(root: Path, names: Sequence[str], state: GlobalState, residuals: Sequence[torch.Tensor] | None,
          meta: dict[str, Any], keep: int = 3) -> Path:
    tensors = {f"theta/{n}": fp32_array(p, f"theta/{n}") for n, p in zip(names, state.params)}
    tensors["global_state"] = np.frombuffer(state.to_bytes(), dtype=np.uint8)
    for i, r in enumerate(residuals or ()):
        tensors[f"ef/{i}"] = fp32_array(r, f"ef/{i}")
    size = sum(t.nbytes for t in tensors.values())
    with progress.transfer(f"checkpoint round {state.round}", size) as shown:  # large states only
        return save(root, state.round, tensors, {**meta, "round": state.round, "digest": state.digest()}, keep=keep,
                    progress=lambda done, total: shown.update(done, total))


def read(root: Path, params: Sequence[torch.Tensor], outer_factory: OuterFactory,
         residual_sizes: Sequence[int] | None, schema: str) -> tuple[GlobalState, list[torch.Tensor] | None, Loaded] | None:
    """The newest verified checkpoint under `root` as a fresh GlobalState shaped like `params`, or None
    when there is none. Raises CheckpointError when it is for another model or configuration."""
    loaded = load_latest(root)
    if loaded is None:
        return None
    if loaded.meta.get("schema") != schema:
        raise CheckpointError(f"checkpoint {loaded.path} is for another model, compression or fragment layout "
                              f"(schema {loaded.meta.get('schema')!r}, this run {schema!r}); "
                              "point --checkpoint-dir elsewhere or start without --resume")
    blob = loaded.tensors.get("global_state")
    if blob is None or blob.dtype != np.uint8 or blob.ndim != 1:
        raise CheckpointError(f"checkpoint {loaded.path} has no global_state")
    state = GlobalState(params, outer_factory)
    try:
        state.load_bytes(blob.tobytes())
    except StateError as e:
        raise CheckpointError(f"checkpoint {loaded.path}: {e}") from e
    if state.digest() != loaded.meta.get("digest"):
        raise CheckpointError(f"checkpoint {loaded.path}: state digest {state.digest()} != recorded "
                              f"{loaded.meta.get('digest')}")
    residuals = None
    if residual_sizes is not None:
        residuals = []
        for i, n in enumerate(residual_sizes):
            arr = loaded.tensors.get(f"ef/{i}")
            residuals.append(torch.zeros(n) if arr is None else fp32_tensor(arr, n, f"ef/{i}"))
    return state, residuals, loaded
