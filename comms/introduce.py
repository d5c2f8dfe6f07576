"""Introductions: our daemon learns members' addresses from their signed directory records.

The peers' libp2p daemons run without libp2p's own Kademlia DHT (`p2p.py`): that DHT answered anyone
who dialed one published address with every member's peer id and address. Without it a daemon can
dial only peers whose addresses it was given: the one it joined through, those that dialed it, and
those it is introduced to here. The directory (`peers/records.py`) hands every read's records to
`Introducer.meet`; such records are readable only by holders of the swarm secret and each is signed
by the peer it names, so only members' own addresses are ever dialed. `meet` connects to each member
it has not met for `every` seconds, at the addresses its record lists (connecting to a peer we are
connected to already costs one control message).

Failure semantics: `meet` never raises and never waits: connections are made in the background, each
bounded by `timeout`; one that fails is logged (debug) and tried again at a read `retry` seconds later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable

from .transport import PeerId

log = logging.getLogger(__name__)

MAX_PEERS = 4096
"""Peers whose last introduction is remembered (oldest forgotten first)."""


def dial_addrs(peer: str, addrs: Iterable[str]) -> list[str]:
    """The addresses to give the daemon for `peer`: without their `/p2p/<id>` part (the daemon takes the
    id separately), and none that names another peer id."""
    out = []
    for addr in addrs:
        base, sep, owner = addr.rpartition("/p2p/")
        if not sep:
            out.append(addr)
        elif owner == peer and base:
            out.append(base)
    return out


def due(last: float | None, now: float, every: float) -> bool:
    """Whether a peer last introduced at `last` (None: never) is due for another introduction."""
    return last is None or now - last >= every


async def connect(p2p: Any, peer: str, addrs: Iterable[str], timeout: float) -> None:
    """Have the daemon of `p2p` (hivemind's `P2P`) connect to `peer` at `addrs` (multiaddrs, with or
    without `/p2p/<peer>`); it keeps the addresses for later calls. Raises when it cannot within `timeout`."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    maddrs = [Multiaddr(a) for a in dial_addrs(peer, addrs)]
    await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer), maddrs), timeout)


class Introducer:
    """`p2p`: hivemind's `P2P`; `me`: our peer id (never introduced to ourselves)."""

    def __init__(self, p2p: Any, me: str, *, every: float = 60.0, retry: float = 5.0, timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.p2p, self.me = p2p, me
        self.every, self.retry, self.timeout, self._clock = every, retry, timeout, clock
        self._last: OrderedDict[str, float] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def meet(self, records: Iterable[Any]) -> None:
        """Connect, in the background, to every peer among `records` (`PeerRecord`s) that is due."""
        now = self._clock()
        for record in records:
            peer = str(record.peer)
            addrs = dial_addrs(peer, record.addrs)
            if peer == self.me or record.status == "left" or not addrs or not due(self._last.get(peer), now,
                                                                                  self.every):
                continue
            self._last.pop(peer, None)
            self._last[peer] = now
            while len(self._last) > MAX_PEERS:
                self._last.popitem(last=False)
            task = asyncio.create_task(self._connect(PeerId(peer), addrs))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self, peer: PeerId, addrs: list[str]) -> None:
        try:
            await connect(self.p2p, peer, addrs, self.timeout)
        except Exception as e:  # noqa: BLE001 - an unreachable member is the round protocol's business
            log.debug("event=introduction_failed peer=%s addrs=%s reason=%s", peer, addrs, e)
            if peer in self._last:  # try again at a read `retry` seconds from now
                self._last[peer] = self._clock() - self.every + self.retry

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
