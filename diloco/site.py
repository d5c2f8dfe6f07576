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
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

T = TypeVar("T")


class SiteError(RuntimeError):
    """The site's leader failed at a decision point; its error, as this rank heard it."""


class Site:
    """The torch.distributed group `group` (default: the world) as one worker; see the module docstring."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0
        self._device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(group) == "nccl" else torch.device("cpu")

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
        box = [obj]
        dist.broadcast_object_list(box, src=self._src, group=self.group, device=self._device)
        return box[0]

    def __repr__(self) -> str:
        return f"Site(rank={self.rank}, size={self.size})"


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling (the other ranks raise the same type), else a SiteError naming it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - exceptions with custom constructors do not unpickle
        return SiteError(f"{type(e).__name__}: {e}")
