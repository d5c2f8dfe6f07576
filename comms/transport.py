"""Transports: how the round protocol moves bytes between peers.

A transport offers exactly two things: register a named async handler, and call a named handler on
another peer with one request and get one reply back, under a timeout. Every message of the round
protocol (ready, contribution, result) and the state download are such calls. Two implementations:

- `InProcNetwork` / `InProcTransport` (this module): peers in one process, for fast tests and
  simulation. Calls go straight to the other peer's handler; killing a peer makes calls to it fail.
- `P2PTransport` (`p2p.py`): hivemind's libp2p daemon, one stream per call, for real swarms.

Both count the bytes of every request and reply they send and receive (`ByteCounter`), so the
round protocol can report exact bytes on the wire per peer per round. Given a `Guard` (`auth.py`:
the swarm's credential), both seal every call and reply and hand a handler only requests that are
authentic and fresh; everything else is refused before the handler sees a byte of it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable, NewType, Optional, Protocol

from diloco.compression.errors import DiLoCoError

if TYPE_CHECKING:
    from .auth import Guard

PeerId = NewType("PeerId", str)
Handler = Callable[[PeerId, bytes], Awaitable[bytes]]
"""A named call's handler: (caller, request) -> reply. The request is the handler's to keep (`bytes`, or a
`bytearray` the transport filled for this call alone and holds no more)."""


class TransportError(DiLoCoError):
    """A call could not be completed: the peer is unreachable, gone, too slow, or refused."""


class CallTimedOut(TransportError):
    """A call got no reply within its timeout (the peer may be alive: frozen, overloaded, or behind a slow link)."""


@dataclass
class ByteCounter:
    """Bytes this peer sent and received, in total and per remote peer."""

    sent: int = 0
    received: int = 0
    per_peer: dict[PeerId, list[int]] = field(default_factory=dict)

    def add(self, peer: PeerId, sent: int = 0, received: int = 0) -> None:
        self.sent += sent
        self.received += received
        row = self.per_peer.setdefault(peer, [0, 0])
        row[0] += sent
        row[1] += received

    def snapshot(self) -> tuple[int, int]:
        return self.sent, self.received


class Transport(Protocol):
    """What the round protocol needs from a transport."""

    peer_id: PeerId
    counter: ByteCounter
    guard: Guard | None
    """Set before the first `register`/`call` to authenticate everything (None: an open transport)."""

    async def register(self, name: str, handler: Handler) -> None: ...

    async def call(self, peer: PeerId, name: str, payload: bytes, timeout: float) -> bytes: ...

    async def close(self) -> None: ...


class InProcNetwork:
    """A registry of in-process peers; `transport(peer_id)` creates one peer's endpoint.

    `latency` (seconds) is added to every call, to give tests a realistic ordering of events.
    """

    def __init__(self, latency: float = 0.0) -> None:
        self.latency = latency
        self._peers: dict[PeerId, InProcTransport] = {}

    def transport(self, peer_id: str, drop: Optional[Callable[[PeerId, str], bool]] = None) -> InProcTransport:
        """A new peer. `drop(target, handler)` returning True loses that outgoing call (fault injection)."""
        if peer_id in self._peers:
            raise ValueError(f"peer id {peer_id!r} is already on this in-process network")
        endpoint = InProcTransport(self, PeerId(peer_id), drop)
        self._peers[endpoint.peer_id] = endpoint
        return endpoint

    def kill(self, peer_id: str) -> None:
        """Drop a peer at once, as if its process was SIGKILLed: calls to it fail from now on."""
        self._peers.pop(PeerId(peer_id), None)

    def lookup(self, peer_id: PeerId) -> InProcTransport | None:
        return self._peers.get(peer_id)


class InProcTransport:
    def __init__(self, network: InProcNetwork, peer_id: PeerId,
                 drop: Optional[Callable[[PeerId, str], bool]] = None) -> None:
        self.network = network
        self.peer_id = peer_id
        self.drop = drop
        self.counter = ByteCounter()
        self.guard: Guard | None = None
        self.handlers: dict[str, Handler] = {}

    async def register(self, name: str, handler: Handler) -> None:
        async def serve(caller: PeerId, data: bytes) -> bytes:
            if self.guard is None:
                return await handler(caller, data)
            return await self.guard.serve(name, caller, data, handler)

        self.handlers[name] = serve

    async def call(self, peer: PeerId, name: str, payload: bytes, timeout: float) -> bytes:
        if self.guard is None:
            return await self._send(peer, name, payload, timeout)
        return await self.guard.call(name, peer, payload, lambda data: self._send(peer, name, data, timeout))

    async def _send(self, peer: PeerId, name: str, payload: bytes, timeout: float) -> bytes:
        if self.network.lookup(self.peer_id) is not self:
            raise TransportError(f"this peer ({self.peer_id}) has been removed from the network")
        target = self.network.lookup(peer)
        if self.drop is not None and self.drop(peer, name):
            raise TransportError(f"call {name!r} to {peer} lost (injected)")
        if target is None or name not in target.handlers:
            raise TransportError(f"peer {peer} is not reachable (no handler {name!r})")
        try:
            if self.network.latency:
                await asyncio.sleep(self.network.latency)
            reply = await asyncio.wait_for(target.handlers[name](self.peer_id, bytes(payload)), timeout)
        except asyncio.TimeoutError as e:
            raise CallTimedOut(f"call {name!r} to {peer} timed out after {timeout:.1f}s") from e
        if self.network.lookup(peer) is not target:
            raise TransportError(f"peer {peer} died during call {name!r}")
        self.counter.add(peer, sent=len(payload), received=len(reply))
        target.counter.add(self.peer_id, sent=len(reply), received=len(payload))
        return reply

    async def close(self) -> None:
        if self.network.lookup(self.peer_id) is self:
            self.network.kill(self.peer_id)


class ScopedTransport:
    """Another protocol namespace on a peer's transport: every handler name gets the prefix `scope/`, so a
    second round protocol (a region's rounds next to the swarm's, `diloco.regions`) runs over the same
    connections, credentials and byte counters without seeing the first one's calls. Closing it closes
    nothing: the transport underneath belongs to the peer."""

    def __init__(self, base: Transport, scope: str) -> None:
        if not scope or "/" in scope:
            raise ValueError(f"a transport scope is a non-empty name without '/', got {scope!r}")
        self.base, self.scope = base, scope
        self.peer_id = base.peer_id
        self.counter = base.counter

    @property
    def guard(self) -> Guard | None:
        return self.base.guard

    @guard.setter
    def guard(self, value: Guard | None) -> None:
        self.base.guard = value

    async def register(self, name: str, handler: Handler) -> None:
        await self.base.register(f"{self.scope}/{name}", handler)

    async def call(self, peer: PeerId, name: str, payload: bytes, timeout: float) -> bytes:
        return await self.base.call(peer, f"{self.scope}/{name}", payload, timeout)

    async def close(self) -> None:
        pass
