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

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import numpy.typing as npt
import torch

from . import progress
from .checkpoint import CheckpointError, Loaded, load_latest, require_safetensors, save
from .comms.transport import PeerId
from .compression.errors import ConfigError
from .outer import OuterFactory
from .state import GlobalState, StateError

if TYPE_CHECKING:
    from .engine import RoundEngine
    from .member import Member

log = logging.getLogger(__name__)


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
          meta: dict[str, Any], keep: int, digest: str) -> Path:
    """`digest`: the state's, as the worker holds it (hashing it again here would cost a pass over the state)."""
    tensors = {f"theta/{n}": fp32_array(p, f"theta/{n}") for n, p in zip(names, state.params)}
    tensors["global_state"] = np.frombuffer(state.to_bytes(), dtype=np.uint8)
    for i, r in enumerate(residuals or ()):
        tensors[f"ef/{i}"] = fp32_array(r, f"ef/{i}")
    size = sum(t.nbytes for t in tensors.values())
    with progress.transfer(f"checkpoint round {state.round}", size) as shown:  # large states only
        return save(root, state.round, tensors, {**meta, "round": state.round, "digest": digest},
                    keep=keep,
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


def save_model(model: torch.nn.Module, target: Path, round: int) -> Path:
    """Write `model` as its user loads it: through its `save_pretrained(target)` (a directory `from_pretrained`
    reads) when it has one (Hugging Face), else as a safetensors file of its whole state dict, a tied weight under
    each of its names (copied: the format stores no shared memory), so that a plain `load_state_dict(strict=True)`
    takes it."""
    saver = getattr(model, "save_pretrained", None)
    if callable(saver):
        saver(str(target))
        return target
    require_safetensors()
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}, str(target),
              metadata={"format": "pt", "diloco_round": str(round)})
    return target


def export(root: str | os.PathLike[str], out: str | os.PathLike[str]) -> tuple[Path, Loaded]:
    """Write the global parameters of the newest verified checkpoint under `root` as a plain safetensors state dict
    at `out`: each parameter under the model's own name, a tied one under each of its names, so that
    `model.load_state_dict(safetensors.torch.load_file(out))` or `from_pretrained` takes it (parameters the run
    did not train, frozen ones, and buffers are not in a checkpoint: load with `strict=False` over the base model).
    Raises CheckpointError when there is no checkpoint or it is not diloco's."""
    loaded = load_latest(Path(root))
    if loaded is None:
        raise CheckpointError(f"no verified checkpoint under {root}: give the --checkpoint-dir of a run")
    params = {k.removeprefix("theta/"): v for k, v in loaded.tensors.items() if k.startswith("theta/")}
    if not params:
        raise CheckpointError(f"checkpoint {loaded.path} holds no global parameters (theta/...): not a diloco "
                              "worker's checkpoint")
    aliases = loaded.meta.get("aliases") or {}
    if not isinstance(aliases, dict) or any(not isinstance(k, str) or v not in params for k, v in aliases.items()):
        raise CheckpointError(f"checkpoint {loaded.path}: its tied-parameter names do not match its parameters")
    tensors = {**params, **{alias: params[name].copy() for alias, name in aliases.items()}}
    require_safetensors()
    from safetensors.numpy import save_file

    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target), metadata={"format": "pt", "diloco_round": str(loaded.step)})
    return target, loaded


class Checkpoints:
    """One worker's checkpoints: every `every` committed rounds into `root`, and resuming from the newest.

    On an FSDP2 site every rank sends its pieces of the state and the leader writes the whole; on any other site
    the leader writes alone, the periodic checkpoints beside training (`write_beside`). A write that fails (disk
    full, …) is logged and training goes on."""

    def __init__(self, member: Member, engine: RoundEngine, names: Sequence[str], *, compression: str,
                 root: str | os.PathLike[str] | None, every: int, aliases: dict[str, str] | None = None) -> None:
        """`aliases`: the other names of tied parameters (name → the name θ holds it under), kept in the metadata so
        that `export` writes a complete state dict."""
        self.member, self.engine, self.names, self.compression = member, engine, list(names), compression
        self.aliases = dict(aliases or {})
        self.root = Path(root) if root is not None else None
        self.every = every

    def _target(self, root: str | os.PathLike[str] | None) -> Path:
        target = Path(root) if root is not None else self.root
        if target is None:
            raise ConfigError("no checkpoint directory: pass root or DiLoCo(checkpoint_dir=...)")
        return target

    def if_due(self) -> None:
        """After a round moved our state: write a checkpoint every `every` rounds (when we write them), beside
        training (`write_beside`; an FSDP2 site's ranks gather the state together, on the training thread)."""
        if self.root is not None and self.every and self.member.link.writes_checkpoints and \
                self.member.round % self.every == 0:
            if self.member.link.shards is None:
                self.write_beside()
            else:
                self.save()

    def _meta(self) -> dict[str, Any]:
        s = self.member.standing
        return {"schema": self.member.schema, "steps": s.steps, "swarm_step": s.swarm_step, "position": s.position,
                "members": ",".join(s.members or ()), "compression": self.compression, "aliases": self.aliases}

    def write_beside(self, keep: int = 3) -> None:
        """Write a checkpoint of the state we hold on a thread of its own, while training goes on: the state is read
        in place (its next change waits for the write: `Holding.beside`), the residuals are copied (the next round
        changes them), the digest is the one being hashed. A failure is logged, as `save`'s."""
        target, holding = self._target(None), self.member.holding
        state, meta, digest = holding.state, self._meta(), holding.later()
        residuals = [r.clone() for r in self.engine.residuals or ()] or None

        def work() -> None:
            try:
                path = write(target, self.names, state, residuals, meta, keep, digest=digest.get())
            except CheckpointError as e:
                log.warning("event=checkpoint_failed reason=%s", e)
                return
            log.info("event=checkpoint_saved path=%s round=%d", path, state.round)

        holding.beside(work, "diloco-checkpoint")

    def save(self, root: str | os.PathLike[str] | None = None, keep: int = 3) -> Path | None:
        """Write the global state, error-feedback residuals and schedule position atomically (format:
        docs/CHECKPOINTS.md), after any checkpoint still being written beside training; returns the path (None on
        the ranks that do not write, or when it failed)."""
        target = self._target(root)
        member, engine = self.member, self.engine
        member.holding.settle()  # a periodic checkpoint of this round may still be under way: after it
        state = member.link.gather(member)  # an FSDP2 site: every rank sends its pieces, the leader gets the whole
        if state is None or not member.link.talks:  # a site writes one checkpoint, its leader's
            return None
        try:
            with member.holding.lock:
                path = write(target, self.names, state, engine.residuals, self._meta(), keep,
                             digest=member.holding.digest)
        except CheckpointError as e:
            log.warning("event=checkpoint_failed reason=%s", e)
            return None
        log.info("event=checkpoint_saved path=%s round=%d", path, member.round)
        return path

    def resume(self, root: str | os.PathLike[str] | None = None) -> bool:
        """Load the newest verified checkpoint (falling back past damaged ones); False when there is none. On an
        FSDP2 site every rank calls it: the leader reads the checkpoint and hands out the pieces."""
        link = self.member.link
        if link.shards is None:
            return self.read(root)
        taken = link.agree(lambda: link.handed_out(self.member) if self.read(root) else None)
        if taken is None:
            return False
        link.took(self.member, taken)
        return True

    def read(self, root: str | os.PathLike[str] | None = None) -> bool:
        """The worker's side of `resume` (the leader's, on a site)."""
        target = self._target(root)
        member, engine = self.member, self.engine
        sizes = [f.numel for f in engine.fragments] if engine.error_feedback else None
        shards = member.link.shards
        like = member.holding.params if shards is None else [torch.empty(s) for s in shards.map.shapes]
        got = read(target, like, member.holding.outer_factory, sizes, member.schema)
        if got is None:
            return False
        state, residuals, loaded = got
        member.adopt(state)
        if residuals is not None:
            for kept, r in zip(engine.per_fragment, residuals):
                if kept.ef is not None:
                    kept.ef.residual = r
        steps = loaded.meta.get("steps")
        s = member.standing
        if isinstance(steps, int) and steps >= 0:
            position = loaded.meta.get("position")
            s.steps = steps
            s.last_slot = steps - (position if isinstance(position, int) and not isinstance(position, bool)
                                   else steps) % engine.period
            swarm_step = loaded.meta.get("swarm_step")
            if isinstance(swarm_step, int) and not isinstance(swarm_step, bool) and 0 <= swarm_step < 1 << 62:
                s.offset = swarm_step - steps  # negative too: we had trained more steps than the state we took
        # The saved membership is the quorum base of our next round (a strict majority of it must commit with us), as
        # it was before the restart, when we come back under the same peer id (`--identity`): without it, two
        # restarted members that cannot see each other each committed the next round alone (a fork the chaos soak
        # found). A restart under a new peer id was never a member: it gets the swarm's members with the catch-up.
        saved = tuple(PeerId(p) for p in str(loaded.meta.get("members", "")).split(",") if p)
        me = member.swarm.peer_id if member.swarm is not None else None
        s.members = saved if me is not None and me in saved else None
        s.attempt = 0
        if member.swarm is not None:
            member.swarm.moved_to(state.round)
        log.info("event=resumed path=%s round=%d skipped=%d", loaded.path, state.round, len(loaded.skipped))
        return True
