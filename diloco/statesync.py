"""Moving the global state to a peer that is behind: in chunks, from every peer that holds it.

Every peer that committed a round holds the same bytes, so any of them can serve any chunk. A
catching-up peer asks a holder for the state's manifest (the next one too if it has not answered within `HEDGE`) (`diloco.state.Manifest`: the header
and the SHA-256 of every chunk), checks that it hashes to the digest the swarm's records vouch for,
then downloads the chunks from all holders at once: each holder's workers take the next missing
chunk from a shared queue, so faster holders serve more and the download gets faster as the swarm
grows. Every chunk is checked against the manifest before it is written; a chunk that does not
match is counted, re-queued for another holder, and the holder that sent it is tried last; a holder
that stops answering has its chunks taken over by the others (at the end of a download, once they are `HEDGE`
seconds late, not after their call timeout). Each chunk has its own deadline
(`call_timeout`), none the whole state: a large state over a slow link takes as long as it takes,
as long as chunks keep coming.

A server answers from a *snapshot* (`Snapshot`): a copy of the state taken when the first peer asks
for its manifest, kept while downloads use it (the live state moves on with every round), and
dropped when nobody asked for a chunk for a while. The copy costs the state's size while serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Collection, Sequence

import torch

from diloco.comms import Collective, PeerId, TransportError
from diloco.comms import messages as msg
from diloco.peers import PeerRecord
from diloco.compression import PayloadRejected, Reason

from .state import GlobalState, Manifest, Receiver, StateError, byte_view, pieces_of

NOT_HELD = "state not held"


class NotHeld(StateError):
    """No holder serves that state at the moment: it moved on to a newer one, or (an FSDP2 site) gathers it
    from its ranks at its next synchronization slot. Nobody misbehaved: read the records and ask again."""

log = logging.getLogger(__name__)

IN_FLIGHT = 2
"""Chunk requests each holder serves at once: keeps its link busy while one chunk's reply is in flight."""
STRIKES = 3
"""Failed or bad chunks after which a holder is no longer asked during this download."""
HEDGE = 2.0
"""Seconds a manifest request waits on one holder before the next holder is asked too, the first valid answer
taken; at the end of a download (nothing left to ask for), a chunk in flight that long, and three times the slowest
chunk received so far, is asked of another holder too. A frozen holder then costs a catching-up peer about this
much, not a call timeout per request (`diloco bench chaos`: a restarted worker that downloaded from a worker frozen
just after)."""


@dataclass
class Snapshot:
    """A copy of the state as it was at one round, served chunk by chunk."""

    round: int
    manifest: Manifest
    tensors: list[torch.Tensor]
    info: dict[str, Any]
    used: float = field(default_factory=time.monotonic)

    @classmethod
    def take(cls, state: GlobalState, manifest: Manifest, info: dict[str, Any]) -> Snapshot:
        tensors, _ = state.layout()
        return cls(state.round, manifest, [t.detach().to("cpu", copy=True) for _, t in tensors], info)

    @property
    def digest(self) -> str:
        return self.manifest.digest

    def chunk(self, index: int) -> bytes:
        self.used = time.monotonic()
        lo, hi = self.manifest.span(index)
        return b"".join(bytes(piece) for _, piece in pieces_of([byte_view(t) for t in self.tensors], lo, hi))


Call = Callable[[PeerId, str, bytes, float], Awaitable[bytes]]


@dataclass
class Progress:
    """How a download is going: for logs, the metrics and a progress bar."""

    total: int
    received: int = 0
    sources: int = 0
    started: float = field(default_factory=time.monotonic)
    bad_chunks: Counter[PeerId] = field(default_factory=Counter)

    @property
    def rate(self) -> float:
        """Bytes per second so far."""
        return self.received / max(1e-9, time.monotonic() - self.started)


async def download(call: Call, *, run_id: str, me: PeerId, digest: str, holders: Sequence[PeerId],
                   receiver: Callable[[Manifest], Receiver], chunk_timeout: float,
                   on_progress: Callable[[Progress], None] = lambda p: None,
                   on_refused: Callable[[PeerId, str], None] = lambda peer, reason: None,
                   ) -> tuple[Receiver, dict[str, Any], Progress]:
    """Download the state named `digest` from `holders` (asked for the manifest in order, the next one `HEDGE`
    seconds after the last). Returns the filled receiver, the serving peer's info, and the progress; raises
    StateError when no holder serves the manifest or when the holders left cannot supply every chunk.
    `on_refused(peer, reason)` hears every refusal (a peer that banned us says so)."""
    manifest, info = await _first_manifest(call, run_id, me, digest, holders, chunk_timeout, on_refused)
    into = receiver(manifest)  # checks the header against our model before any chunk is asked for
    progress = Progress(total=manifest.total, sources=len(holders))
    queue: deque[int] = deque(range(into.chunks))
    strikes: Counter[PeerId] = Counter()
    refused: dict[int, set[PeerId]] = {}  # chunk -> holders whose copy of it did not match
    asked: dict[int, dict[PeerId, float]] = {}  # chunk in flight -> the holders asked for it, since when
    slowest = [0.0]  # the longest a chunk took to arrive so far
    wake = asyncio.Event()

    def complete() -> bool:
        return len(into.done) == into.chunks

    def take(peer: PeerId) -> int | None:
        """The next chunk `peer` should send: one it has not sent a bad copy of, unless nobody else can; with
        none left, one in flight at another holder for `HEDGE` seconds and three times the slowest chunk."""
        for _ in range(len(queue)):
            index = queue.popleft()
            others = [p for p in holders if strikes[p] < STRIKES and p not in refused.get(index, ())]
            if peer not in refused.get(index, ()) or not others:
                return index
            queue.append(index)
        late = time.monotonic() - max(HEDGE, 3 * slowest[0])
        return next((i for i, at in asked.items() if i not in into.done and peer not in at
                     and peer not in refused.get(i, ()) and min(at.values()) <= late), None)

    async def worker(peer: PeerId) -> None:
        while strikes[peer] < STRIKES and not complete():
            index = take(peer)
            if index is None:
                if not asked:
                    return  # nothing left that this holder may send
                wake.clear()
                try:  # a chunk in flight elsewhere may fail and come back, or be late enough to ask again
                    await asyncio.wait_for(wake.wait(), HEDGE / 2)
                except asyncio.TimeoutError:
                    pass
                continue
            started = time.monotonic()
            asked.setdefault(index, {})[peer] = started
            try:
                data = await _chunk(call, run_id, me, peer, digest, index, chunk_timeout)
                if index not in into.done:  # (a chunk asked of two holders: the first copy counts)
                    into.write(index, data)
                    progress.received += len(data)
                    slowest[0] = max(slowest[0], time.monotonic() - started)
                    on_progress(progress)
            except StateError as e:  # a chunk that does not match the manifest: tampered, or a bug
                refused.setdefault(index, set()).add(peer)
                progress.bad_chunks[peer] += 1
                strikes[peer] += 1
                _again(queue, asked, index, peer, into.done)
                log.warning("event=state_chunk_refused peer=%s chunk=%d reason=%s", peer, index, e)
            except (TransportError, PayloadRejected) as e:
                strikes[peer] += 1
                _again(queue, asked, index, peer, into.done)
                log.info("event=state_chunk_failed peer=%s chunk=%d reason=%s", peer, index, e)
            else:
                asked.pop(index, None)
            finally:
                wake.set()

    workers = {asyncio.ensure_future(worker(p)) for p in holders for _ in range(IN_FLIGHT)}
    try:
        while workers and not complete():
            done, workers = await asyncio.wait(workers, return_when=asyncio.FIRST_COMPLETED)
            for w in done:
                w.result()  # a worker's unexpected error ends the download here, not in a wait that never ends
    finally:  # every chunk here: a request still waiting on a frozen holder is dropped, not waited out
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    progress.sources = sum(1 for p in holders if strikes[p] < STRIKES)
    if len(into.done) != into.chunks:
        raise StateError(f"{into.chunks - len(into.done)} of {into.chunks} chunks could not be had from "
                         f"{len(holders)} holder(s) (failed or refused: {dict(strikes)})")
    return into, info, progress


def _again(queue: deque[int], asked: dict[int, dict[PeerId, float]], index: int, peer: PeerId,
           done: Collection[int]) -> None:
    """`peer` did not deliver chunk `index`: ask for it again, unless another holder has it in flight or sent it."""
    others = asked.get(index, {})
    others.pop(peer, None)
    if not others:
        asked.pop(index, None)
        if index not in done:
            queue.append(index)


async def _first_manifest(call: Call, run_id: str, me: PeerId, digest: str, holders: Sequence[PeerId],
                          timeout: float, on_refused: Callable[[PeerId, str], None]) -> tuple[Manifest, dict[str, Any]]:
    """The manifest of `digest` from the first holder that serves it: asked in order, the next one `HEDGE` seconds
    after the last (or at once, when the last refused); raises StateError (NotHeld when every holder said it
    moved on) naming why when none does."""
    why: list[Exception] = []
    waiting: dict[asyncio.Future[tuple[Manifest, dict[str, Any]]], PeerId] = {}
    left = list(holders)
    try:
        while left or waiting:
            if left:
                peer = left.pop(0)
                waiting[asyncio.ensure_future(_manifest(call, run_id, me, peer, digest, timeout, on_refused))] = peer
            done, _ = await asyncio.wait(waiting, timeout=HEDGE if left else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                peer = waiting.pop(task)
                try:
                    return task.result()
                except (TransportError, PayloadRejected, StateError) as e:
                    why.append(e)
                    log.info("event=manifest_failed peer=%s reason=%s", peer, e)
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    kind = NotHeld if why and all(isinstance(e, NotHeld) for e in why) else StateError
    raise kind(f"none of the {len(holders)} peer(s) holding state {digest} served its manifest: "
               + "; ".join(map(str, why[:3])))


async def _manifest(call: Call, run_id: str, me: PeerId, peer: PeerId, digest: str, timeout: float,
                    on_refused: Callable[[PeerId, str], None]) -> tuple[Manifest, dict[str, Any]]:
    reply = await call(peer, "diloco.manifest", msg.encode(msg.STATE, run=run_id, sender=me, view=digest), timeout)
    header, body, _ = msg.decode(reply, run=run_id, kind=msg.STATE, caller=peer, max_body=64 << 20)
    if not header.meta.get("ok", False):
        reason = str(header.meta.get("reason", "no reason"))
        on_refused(peer, reason)
        raise (NotHeld if reason == NOT_HELD else StateError)(f"peer {peer} does not serve state {digest} ({reason})")
    manifest = Manifest.unpack(bytes(body))
    if manifest.digest != digest:
        raise StateError(f"peer {peer} served a manifest that hashes to {manifest.digest}, not {digest}")
    info = {k.removeprefix("info."): v for k, v in header.meta.items() if k.startswith("info.")}
    return manifest, info


async def _chunk(call: Call, run_id: str, me: PeerId, peer: PeerId, digest: str, index: int, timeout: float) -> bytes:
    request = msg.encode(msg.STATE, run=run_id, sender=me, view=digest, span=index)
    reply = await call(peer, "diloco.chunk", request, timeout)
    header, body, _ = msg.decode(reply, run=run_id, kind=msg.STATE, caller=peer, max_body=1 << 30)
    if not header.meta.get("ok", False) or header.span != index:
        raise PayloadRejected(Reason.WRONG_SPAN, f"peer {peer} did not serve chunk {index} of {digest} "
                                                 f"({header.meta.get('reason', 'another chunk')})")
    return bytes(body)


def serve_manifest(snapshot: Snapshot | None, *, run_id: str, me: PeerId, reason: str = "") -> bytes:
    if snapshot is None:
        return msg.encode(msg.STATE, run=run_id, sender=me, meta={"ok": False, "reason": reason or NOT_HELD})
    meta: dict[str, Any] = {"ok": True, **{f"info.{k}": v for k, v in snapshot.info.items()}}
    return msg.encode(msg.STATE, run=run_id, sender=me, view=snapshot.digest, meta=meta, body=snapshot.manifest.pack())


def serve_chunk(snapshot: Snapshot | None, index: int, *, run_id: str, me: PeerId, reason: str = "") -> bytes:
    if snapshot is None or not 0 <= index < len(snapshot.manifest.hashes):
        return msg.encode(msg.STATE, run=run_id, sender=me, meta={"ok": False, "reason": reason or "chunk not held"})
    return msg.encode(msg.STATE, run=run_id, sender=me, view=snapshot.digest, span=index, meta={"ok": True},
                      body=snapshot.chunk(index))


SnapshotProvider = Callable[[str], "Snapshot | None"]
"""digest -> the snapshot of that state, if we hold it."""


class StateServer:
    """Our side of the peers catching up from us: the snapshots we serve, who asked for state lately (our next round
    waits for them: `catching_up`), and who asked for a state we did not hold (`unserved`)."""

    def __init__(self, run_id: str, me: PeerId, collective: Collective, call_timeout: float) -> None:
        self.run_id, self.me, self.collective, self.call_timeout = run_id, me, collective, call_timeout
        self.snapshot: SnapshotProvider | None = None
        """The snapshot of a state we hold (`Swarm.serve_state`); None: we serve nothing yet."""
        self.wait_unserved = True
        """Whether a peer that asked for a state we did not hold is waited for too (see `Swarm.serve_state`)."""
        self._fetchers: dict[PeerId, float] = {}  # peers that asked us for state, and when they last did
        self._unserved: dict[PeerId, float] = {}  # with wait_unserved off: who asked for state we did not hold

    async def on_manifest(self, caller: PeerId, data: bytes) -> bytes:
        snapshot, _, reason = self._request(caller, data)
        return serve_manifest(snapshot, run_id=self.run_id, me=self.me, reason=reason)

    async def on_chunk(self, caller: PeerId, data: bytes) -> bytes:
        snapshot, index, reason = self._request(caller, data)
        return serve_chunk(snapshot, index, run_id=self.run_id, me=self.me, reason=reason)

    def _request(self, caller: PeerId, data: bytes) -> tuple[Snapshot | None, int, str]:
        """(the snapshot a manifest or chunk request names, the chunk index, why not when there is none)."""
        try:
            self.collective.check_banned(caller)  # it takes nothing from the swarm, our state included
            header, _, _ = msg.decode(data, run=self.run_id, kind=msg.STATE, caller=caller, max_body=0)
        except PayloadRejected as e:
            self.collective.rejections[e.reason.value] += 1
            return None, -1, e.reason.value
        snapshot = self.snapshot(header.view) if self.snapshot is not None else None
        if snapshot is not None or self.wait_unserved:
            self._fetchers[caller] = time.monotonic()
        else:
            self._unserved[caller] = time.monotonic()
        return snapshot, header.span, "" if snapshot is not None else NOT_HELD

    def unserved(self) -> set[PeerId]:
        """Peers that asked us for a state we did not hold within the last `call_timeout`."""
        now = time.monotonic()
        return {p for p, t in list(self._unserved.items()) if now - t < self.call_timeout}

    def wait_for_unserved(self) -> None:
        """We now hold the state the unserved peers want: our next round waits for them."""
        now = time.monotonic()
        for peer in self.unserved():
            self._fetchers[peer] = now
        self._unserved.clear()

    def catching_up(self, records: Sequence[PeerRecord]) -> set[PeerId]:
        """Peers that asked us for state (a manifest or a chunk, whether we still held it or not) within
        the last `call_timeout`: they are catching up to us, and our next round waits for them, unless
        `records` show that they said goodbye since."""
        now = time.monotonic()
        self._fetchers = {p: t for p, t in self._fetchers.items() if now - t < self.call_timeout}
        gone = {r.peer for r in records if r.status == "left"} | self.collective.banned | {self.me}
        return set(self._fetchers) - gone
