"""Catching up with the swarm: whose state to take, and its verified download from every peer that holds it.

A worker falls behind when it joins a running swarm, when a round went on without it, or when its state
is in the minority. `CatchUp` finds the state to take (`peers.resync_source`: the swarm's newest state
that a majority vouches for), checks the records vouch for it before a byte moves (`peers.vouched`),
and downloads it in verified chunks from every holder at once (`diloco.statesync`): the manifest must
hash to the advertised digest and every chunk to its hash in the manifest. A source that failed (it
sent a chunk that did not verify, or the download broke off) is tried last next time, until a
download works. The wrapper decides when to catch up and adopts the state that arrives; nothing here
touches the model.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Sequence

from diloco.comms import PeerId
from diloco.compression import Reason
from diloco.peers import holders, resync_source, vouched
from diloco.peers.membership import gossip_source, serving
from diloco.peers.records import PeerRecord

from . import progress
from .outer import OuterFactory
from .state import GlobalState, Manifest, Receiver, StateError
from .statesync import NotHeld, Progress, download
from .swarm import StateNotHeld, Swarm, SwarmError

log = logging.getLogger(__name__)


class _DownloadLog:
    """A state download's progress: a line in the log every tenth of it (bytes, rate, sources), and the
    command's progress display (`diloco.progress`: shown for large states, when not --quiet)."""

    def __init__(self, digest: str) -> None:
        self.digest, self._next = digest, 0.1
        self.task: progress.Task | None = None

    def __call__(self, p: Progress) -> None:
        if self.task is None:
            self.task = progress.transfer(f"state {self.digest}", p.total)
        self.task.update(p.received, status=f"from {p.sources} peer(s)")
        if p.total and p.received / p.total >= self._next:
            self._next += 0.1
            log.info("event=state_download digest=%s bytes=%d/%d rate_mb_s=%.1f sources=%d", self.digest, p.received,
                     p.total, p.rate / 1e6, p.sources)

    def close(self, ok: bool) -> None:
        if self.task is not None:
            self.task.close("done" if ok else "failed")


class CatchUp:
    """One worker's catching up: the sources that failed, and what its downloads refused."""

    def __init__(self, publish: Callable[[str], None]) -> None:
        self._publish = publish  # our record's status: "joining" while we download, "training" after
        self.bad_sources: list[PeerId] = []
        """Peers whose download failed or did not verify since the last one that worked: tried last."""
        self.failures = 0
        """Downloads that failed or did not verify."""
        self.refused_chunks: collections.Counter[PeerId] = collections.Counter()
        """Chunks of state that did not match the manifest, by the peer that sent them (refetched elsewhere)."""
        self.gossip = False
        """A gossip swarm (`diloco.gossip`): every peer holds its own state, so a joiner takes the newest peer's
        (`peers.membership.gossip_source`), checked against that peer's advertised digest; no majority vouches for any."""
        self.swarm_round = 0
        """The newest round of another peer's state in the last read that showed any (0: none seen yet): how far the
        swarm had committed when we last saw it (`stranded`)."""
        self.swarm_peers: tuple[PeerId, ...] = ()
        """The other peers that read showed: whom a stranded peer looks for (`Swarm.look_for`)."""
        self._stranded_at: int | None = None  # the swarm round we last said we wait for (logged once)

    def source(self, swarm: Swarm, rnd: int, digest: str, *, cached: bool = False
               ) -> tuple[PeerRecord | None, str, list[PeerRecord]]:
        """The record of the peer whose state we should take instead of ours at (`rnd`, `digest`), with why,
        or (None, "") when ours is current; and the records that decided it. `cached`: the records the
        last heartbeat read (no network I/O)."""
        records = swarm.records(cached=cached)
        if self.gossip:
            source, why = gossip_source(records, swarm.peer_id, rnd, self.bad_sources)
        else:
            source, why = resync_source(records, swarm.peer_id, rnd, digest, self.bad_sources)
            shown = [r for r in serving(records) if r.peer != swarm.peer_id and r.digest]
            if shown:
                self.swarm_round = max(r.round for r in shown)
                self.swarm_peers = tuple(sorted(r.peer for r in shown))
        return source, why, records

    def stranded(self, rnd: int) -> str:
        """Why we must not start a round at `rnd` although no record names a state to take ("" when we may): the
        last read that showed other peers showed the swarm past `rnd`, and none shows a holder of its state now
        (our DHT node an island, their records expired while our downloads failed). A round of our own would
        commit rounds the swarm committed with other states: a fork of the run. We wait for a holder instead."""
        if self.gossip or self.swarm_round <= rnd:
            self._stranded_at = None
            return ""
        why = (f"the swarm was at round {self.swarm_round} when a record last showed it, we are at {rnd}, and no "
               f"record shows a holder of its state now: waiting for one (a round of our own would fork the run)")
        if self._stranded_at != self.swarm_round:
            self._stranded_at = self.swarm_round
            log.warning("event=stranded reason=%s", why)
        return why

    def download(self, swarm: Swarm, source: PeerRecord, why: str, into: Callable[[Manifest], Receiver],
                 outer: OuterFactory) -> tuple[GlobalState, dict[str, object]] | None:
        """The state `source` advertises, from every peer that holds it, verified, with what its server
        said of it (`position` in the schedule, `members` of its last round); None when it did not arrive
        (the reason is logged; a failed source is tried last next time). `into`: where the chunks go (the
        whole state, or an FSDP2 leader's receiver that hands out pieces)."""
        log.info("event=resync peer=%s reason=%s", source.peer, why)
        self._publish("joining")
        try:
            if not self.gossip:
                self._check_vouched(swarm, source.round, source.digest)
            others = holders(swarm.records(cached=True), swarm.peer_id, source.round, source.digest)
            order = [source.peer, *(p for p in others if p != source.peer and p not in self.bad_sources),
                     *(p for p in others if p != source.peer and p in self.bad_sources)]
            started, shown = time.monotonic(), _DownloadLog(source.digest)
            try:
                receiver, info, moved = fetch_state(swarm, source.digest, order, into, on_progress=shown)
            finally:
                shown.close(ok=shown.task is not None and shown.task.done >= (shown.task.total or 0))
            fresh = receiver.assemble(outer)
            if fresh.round != source.round or fresh.digest() != source.digest:
                raise StateError(f"downloaded state is round {fresh.round}, digest {fresh.digest()}; expected "
                                 f"round {source.round}, {source.digest}")
            log.info("event=state_downloaded round=%d bytes=%d seconds=%.2f sources=%d bad_chunks=%d", fresh.round,
                     moved.total, time.monotonic() - started, len(order), sum(moved.bad_chunks.values()))
            self.refused_chunks.update(moved.bad_chunks)
        except StateNotHeld as e:  # it moved on, or (an FSDP2 site) gathers it at its next slot: ask again
            log.info("event=resync_deferred peer=%s reason=%s", source.peer, e)
            self._publish("training")
            return None
        except (SwarmError, StateError) as e:
            log.warning("event=resync_failed peer=%s reason=%s", source.peer, e)
            self.bad_sources.append(source.peer)  # next time, another holder of that state first
            self.failures += 1
            self._publish("training")
            return None
        self.bad_sources.clear()
        return fresh, info

    def on_join(self, swarm: Swarm, ours: Callable[[], tuple[int, str]],
                take: Callable[[PeerRecord, str], bool], timeout: float) -> None:
        """On joining a running swarm, start from its state rather than from our own initialization: try
        `take(source, why)` (download and adopt) until it works, we are the first peer, everyone holds
        our state (`ours()`: our round and digest), every holder of the swarm's state failed verification
        (retried at the next slot), or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            rnd, digest = ours()
            source, why, records = self.source(swarm, rnd, digest)
            others = [r for r in records if r.peer != swarm.peer_id and r.status == "training"]
            if source is not None and take(source, why):
                return
            if time.monotonic() > deadline:
                return
            if source is None and (others or not swarm.bootstrapped):
                return  # first peer, or everyone holds our state already
            if source is not None and source.peer in self.bad_sources and \
                    all(r.peer in self.bad_sources for r in others if r.digest == source.digest):
                return  # every holder of the swarm's state failed verification: retry at the next slot
            time.sleep(0.25)  # nobody visible yet, or another holder of that state to try

    @staticmethod
    def _check_vouched(swarm: Swarm, rnd: int, digest: str) -> None:
        """Raise StateError unless the peers' records vouch for the state (`peers.vouched`); if no record
        shows that round yet, the others are about to publish it: read again for up to `call_timeout`."""
        deadline = time.monotonic() + swarm.cfg.round.call_timeout
        while True:
            ok, why = vouched(swarm.records(), swarm.peer_id, rnd, digest)
            if ok:
                return
            if ok is False or time.monotonic() >= deadline:
                raise StateError(f"state {digest} (round {rnd}) is not the swarm's: {why}")
            time.sleep(0.05)


def fetch_state(swarm: Swarm, digest: str, holders: Sequence[PeerId], receiver: Callable[[Manifest], Receiver],
                on_progress: Callable[[Progress], None] = lambda p: None,
                ) -> tuple[Receiver, dict[str, Any], Progress]:
    """Download the state named `digest` from `holders` at once over `swarm`'s connections, chunk by chunk, each
    chunk checked against the manifest (`diloco.statesync.download`). Returns the filled receiver, the serving
    peer's info (unchecked: validate before use) and how it went.

    Raises:
        StateNotHeld: no holder holds that state any more (the swarm moved on): ask again for the new one.
        SwarmError: the download failed otherwise (every holder refused, timed out or sent bad chunks)."""
    def refused(peer: PeerId, reason: str) -> None:
        if reason == Reason.BANNED.value:
            swarm.collective.banned_by.add(peer)  # its own sealed reply: see `Swarm.check_standing`

    async def get() -> tuple[Receiver, dict[str, Any], Progress]:
        return await download(swarm.transport.call, run_id=swarm.cfg.run_id, me=swarm.peer_id, digest=digest,
                              holders=holders, receiver=receiver, chunk_timeout=swarm.cfg.round.call_timeout,
                              on_progress=on_progress, on_refused=refused)

    try:
        return swarm.loop.run(get())
    except NotHeld as e:
        raise StateNotHeld(f"state download failed: {e}") from e
    except StateError as e:
        raise SwarmError(f"state download failed: {e}") from e
