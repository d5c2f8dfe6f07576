"""`Holding`: the global state one worker holds, and what derives from it.

The state is θ (fp32 copies of the trained parameters), the outer optimizer over θ and the round
(`diloco.state.GlobalState`). Derived from it: the manifest (SHA-256 of every 4 MiB chunk) and the digest
the swarm compares, and the digests of the last rounds held (`recent`, published with the peer's record).
Two threads touch the state: the training thread changes it (an outer step, a download), the event-loop
thread serializes it for a peer catching up; `lock` keeps the second from seeing half of a change.
Whatever must follow a change (the snapshot server dropping idle copies) registers with `on_change`.
"""

from __future__ import annotations

import collections
import copy
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch

from .outer import OuterFactory, is_pinned
from .state import GlobalState, Manifest

RECENT = 4
"""How many (round, digest) pairs of the states we held our record publishes."""


class Holding:
    """One worker's global state, its digest, and the lock around changes to it."""

    def __init__(self, state: GlobalState, outer_factory: OuterFactory, device: torch.device,
                 manifest_of: Callable[[GlobalState], Manifest] | None = None) -> None:
        """`device`: where θ and the outer state live (`DiLoCo(global_device=...)`). `manifest_of`: how the state
        is hashed (default `GlobalState.manifest`; an FSDP2 site hashes the whole state from its ranks' pieces,
        `SiteShards.manifest`)."""
        self.state = state
        self.outer_factory = outer_factory
        self.device = device
        self.lock = threading.Lock()
        """Held by the training thread while it changes the state, and by the event-loop thread while it
        serializes the state for a peer catching up."""
        self.recent: collections.deque[tuple[int, str]] = collections.deque(maxlen=RECENT)
        """The last (round, digest) states we held, published with our record (`PeerRecord.recent`)."""
        self._manifest_of = manifest_of or GlobalState.manifest
        self._listeners: list[Callable[[], None]] = []
        with self.lock:
            self.changed()

    @property
    def round(self) -> int:
        return self.state.round

    @property
    def params(self) -> list[torch.Tensor]:
        """θ."""
        return self.state.params

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after every change of the state (with `lock` held)."""
        self._listeners.append(listener)

    def changed(self) -> None:
        """The state changed (call with `lock` held): new manifest and digest; one state per round in `recent`
        (a state replaced at its round, by a resync, is not ours any more)."""
        self.manifest = self._manifest_of(self.state)
        self.digest = self.manifest.digest
        while self.recent and self.recent[-1][0] >= self.state.round:
            self.recent.pop()
        self.recent.append((self.state.round, self.digest))
        for listener in self._listeners:
            listener()

    @contextmanager
    def changing(self) -> Iterator[GlobalState]:
        """`with holding.changing() as state:` change `state` in place; the digest follows on leaving."""
        with self.lock:
            yield self.state
            self.changed()

    def replace(self, fresh: GlobalState) -> None:
        """Hold `fresh` from now on (downloaded, resumed, handed out by a site's leader)."""
        with self.lock:
            self.state = fresh
            self.changed()

    def empty_like(self) -> GlobalState:
        """A new state shaped like ours, on the same device (to load bytes into)."""
        return GlobalState(self.state.params, self.outer_factory, self.device)

    def clone(self) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        """A private copy of θ and the outer optimizer (the eager overlapped step, which must not touch θ)."""
        params = [torch.empty_like(p, pin_memory=is_pinned(p)).copy_(p) for p in self.state.params]
        outer = self.outer_factory(params)
        outer.load_state_dict(copy.deepcopy(self.state.outer.state_dict()))
        return params, outer


def views(tensors: Sequence[torch.Tensor], indices: Sequence[int]) -> list[torch.Tensor]:
    """The tensors of one fragment (its parameter indices), in order."""
    return [tensors[i] for i in indices]
