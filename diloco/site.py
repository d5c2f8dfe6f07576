"""A site: the ranks of one torch.distributed process group acting as one worker of the swarm.

A lab runs its script under `torchrun --nproc-per-node K` with DDP (or K identical replicas) and
wants the K ranks to be *one* DiLoCo worker: one replica's worth of pseudo-gradient on the WAN per
round, not K, and every rank holding the same global state afterwards.

Design: the site's leader (rank 0 of the group) is its only peer in the swarm. The ranks take their
inner steps in lockstep (DDP all-reduces every gradient), so every rank forms the same Δ at the same
step; only the leader sends it. Wherever the wrapper's behaviour depends on the swarm (joining and
catching up, the standing check at a sync slot, a resync, a round's outcome) the leader decides and
`agree` broadcasts its decision over the group; every rank then applies it with the same code, so
all ranks of a site hold bit-identical global parameters and outer-optimizer state after every
round (tested across real torchrun processes by their digests). Why one talker rather than ranks
splitting the exchange by shard: under DDP every rank holds the whole Δ, so splitting would only add
WAN connections per site, and sites of different sizes (1, 2, 3 ranks) would cut the model
differently; one talker keeps the swarm's unit of membership the site, whatever its size.

Failure semantics: torch.distributed cannot lose a rank, so a rank that dies takes its site down
(torchrun ends the other ranks); the launcher restarts the site, which rejoins the swarm and
downloads its state (`diloco start/join --max-restarts N -- torchrun ...`). An exception the leader
raises at a decision point (banned, handshake refused) is sent to the other ranks, which raise it
too, instead of waiting on a broadcast that never comes.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from .compression.errors import DiLoCoError

log = logging.getLogger(__name__)

T = TypeVar("T")


class SiteError(DiLoCoError, RuntimeError):
    """The site's leader failed at a decision point; its error, as this rank heard it."""


class Site:
    """The torch.distributed group `group` (default: the world) as one worker; see the module docstring."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0
        self._device = _nccl_device(group) if dist.get_backend(group) == "nccl" else torch.device("cpu")

    @classmethod
    def detect(cls, group: dist.ProcessGroup | None = None) -> Site | None:
        """The initialized process group as a site, or None for a lone process (no torch.distributed,
        or a group of one)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
            return None
        return cls(group)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def agree(self, decide: Callable[[], T]) -> T:
        """Run `decide()` on the leader and return its value on every rank (an exception it raises is
        raised on every rank). Every rank must call `agree` at the same points, in the same order."""
        if self.leader:
            try:
                value = decide()
            except BaseException as e:
                self._broadcast(("raise", _portable(e)))
                raise
            self._broadcast(("ok", value))
            return value
        kind, value = self._broadcast(None)
        if kind == "raise":
            assert isinstance(value, BaseException)
            raise value
        return value

    def _broadcast(self, obj: Any) -> Any:
        return broadcast_object(obj, self._src, self.group, self._device)

    def __repr__(self) -> str:
        return f"Site(rank={self.rank}, size={self.size})"


def _nccl_device(group: dist.ProcessGroup | None) -> torch.device:
    """The GPU this rank's NCCL collectives run on: the one the group is bound to
    (`init_process_group(device_id=...)`), else the current device (`torch.cuda.set_device`, which NCCL
    scripts call; without either, every rank would use GPU 0)."""
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    return bound if isinstance(bound, torch.device) else torch.device("cuda", torch.cuda.current_device())


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup | None, device: torch.device) -> Any:
    """`obj` of global rank `src`, pickled, on every rank of `group` (what `dist.broadcast_object_list`
    does), returned only once the backend has let go of the tensors it moved (see `settle`)."""
    mine = dist.get_rank() == src
    payload = pickle.dumps(obj) if mine else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if mine \
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    settle(size, data)
    return obj if mine else pickle.loads(data.cpu().numpy().tobytes())


def settle(*tensors: torch.Tensor, timeout: float = 5.0) -> None:
    """Wait until the process group's worker threads have dropped their references to `tensors`.

    `work.wait()` returns when a collective has completed, but the backend's worker thread (gloo's, or
    NCCL's watchdog) drops its reference to the work a moment later, and dropping the last reference to a
    tensor created in Python takes the GIL. When that moment falls after the interpreter began shutting
    down (a rank leaving right after its last collective), the thread cannot take the GIL and the process
    aborts ("terminate called without an active exception", SIGABRT; torchrun then reports the rank as
    failed). Holding our reference until theirs is gone makes ours the last one. The wait is microseconds
    on gloo; `timeout` bounds it."""
    deadline = time.monotonic() + timeout
    while any(_references(t) > 1 for t in tensors):  # ours is the one reference left once they let go
        if time.monotonic() > deadline:
            log.debug("event=site_settle_timeout counts=%s", [_references(t) for t in tensors])
            return
        time.sleep(0.0002)


def _references(t: torch.Tensor) -> int:
    """How many owners the tensor's implementation has (this Python tensor counts as one)."""
    count: int = t._use_count()  # type: ignore[attr-defined]  # torch's C binding, not in its stubs
    return count


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling (the other ranks raise the same type), else a SiteError naming it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - exceptions with custom constructors do not unpickle
        return SiteError(f"{type(e).__name__}: {e}")
