"""`SnapshotServer`: the copies of our state that peers catching up download (`diloco.statesync` moves them).

A peer that asks for the state we hold gets a snapshot taken when the first one asks: a copy, so that our
next outer step does not change the bytes under a download. A snapshot stays while downloads use it and
goes once idle; at most `SNAPSHOTS` are held (a download of an older one may overlap a newer). An FSDP2 site
cannot copy its state on the event-loop thread (its pieces are on every rank): its ranks gather a whole copy
at a synchronization slot (`offer`) and the leader serves that one.
"""

from __future__ import annotations

import time
from typing import Callable

from .holding import Holding
from .state import GlobalState
from .statesync import Snapshot

SNAPSHOT_IDLE, SNAPSHOTS = 30.0, 2
"""Seconds a snapshot we serve stays after its last chunk was asked for (a download may resume), and how
many we hold at most (each is a copy of the state: a download of an older one overlapping a newer)."""


class SnapshotServer:
    """Snapshots of one worker's state for peers catching up (see the module docstring)."""

    def __init__(self, holding: Holding, info: Callable[[], dict[str, object]], *, on_demand: bool = True) -> None:
        """`info()`: what a peer downloading our state learns with it (our place in the schedule, the last
        round's members, …). `on_demand`: take a snapshot when a peer asks (off for an FSDP2 site: `offer`)."""
        self._holding = holding
        self._info = info
        self._on_demand = on_demand
        self._snapshots: list[Snapshot] = []
        holding.on_change(self._prune)

    def serve(self, digest: str) -> Snapshot | None:
        """The snapshot of state `digest`, taken from our current state when a peer first asks for it; None when
        we do not hold that state. Runs on the event-loop thread."""
        held = self._holding
        with held.lock:
            for snap in self._snapshots:
                if snap.digest == digest:
                    return snap
            if not self._on_demand or digest != held.known():  # an FSDP2 leader gathers one at its next slot
                return None  # (a state still being hashed is not in our record yet: nobody asks for it)
            return self._keep(Snapshot.take(held.state, held.manifest, self._info()))

    def offer(self, whole: GlobalState) -> None:
        """Serve `whole`, a copy of the state we hold (an FSDP2 site's, gathered from its ranks)."""
        snap = Snapshot(whole.round, self._holding.manifest, [t for _, t in whole.layout()[0]], self._info())
        with self._holding.lock:
            self._keep(snap)

    def _keep(self, snap: Snapshot) -> Snapshot:
        """Serve `snap` from now on (call with the lock held): the least recently used goes first."""
        self._snapshots = [*sorted(self._snapshots, key=lambda s: s.used)[-(SNAPSHOTS - 1):], snap]
        return snap

    def _prune(self) -> None:
        """The state changed: a snapshot stays while a download uses it, and goes once idle."""
        now = time.monotonic()
        self._snapshots = [snap for snap in self._snapshots if now - snap.used <= SNAPSHOT_IDLE]
