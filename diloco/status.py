"""`diloco status ADDR`: who is in a swarm, their round, last heartbeat and throughput.

An observer joins the swarm's DHT in client mode through the first address that answers (it
stores nothing and publishes no record, so it never appears as a peer), reads the peer records of
the run twice `interval` seconds apart (throughput is the inner steps a peer took in between, per
second), and leaves. Its libp2p daemon is watched by the same reaper as a peer's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from diloco.comms.loop import LoopThread
from diloco.peers import PeerRecord


@dataclass(frozen=True)
class PeerStatus:
    record: PeerRecord
    heartbeat_age: float | None  # seconds since its last heartbeat (by its clock vs ours), None if unknown
    steps_per_second: float | None


def summarize(first: list[PeerRecord], second: list[PeerRecord], interval: float, now: float) -> list[PeerStatus]:
    """Pure: the status rows from two reads of the records, `interval` seconds apart."""
    before = {r.peer: r for r in first}
    out = []
    for r in sorted(second, key=lambda r: (r.status != "training", -r.round, r.peer)):
        prev = before.get(r.peer)
        rate = (r.step - prev.step) / interval if prev is not None and interval > 0 and r.step >= prev.step else None
        age = max(0.0, now - r.beat) if r.beat > 0 else None
        out.append(PeerStatus(r, age, rate))
    return out


def observe(addresses: list[str], run_id: str, secret: str, interval: float = 2.0,
            timeout: float = 30.0) -> list[PeerStatus]:
    """Read the swarm at the first of `addresses` that answers (its DHT, signing our requests with the
    swarm `secret`); raises RuntimeError listing what failed."""
    from diloco.comms.auth import HmacAuthorizer
    from diloco.comms.p2p import P2PTransport
    from diloco.peers import DHTDirectory
    from diloco.peers.reaper import Reaper

    tried = []
    for addr in addresses:
        loop, reaper = LoopThread(name="diloco-status"), Reaper()

        async def read_twice() -> tuple[list[PeerRecord], list[PeerRecord], float]:
            transport = await P2PTransport.create(initial_peers=[addr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            if transport.daemon_pid:
                reaper.watch_pid(transport.daemon_pid)
            for path in transport.socket_paths:
                reaper.watch_file(path)
            try:
                directory = await asyncio.wait_for(
                    DHTDirectory.create(transport.p2p, run_id, [addr], client_mode=True,
                                        authorizer=HmacAuthorizer(secret, run_id)), timeout)
                try:
                    first = await directory.read()
                    t0 = time.monotonic()
                    await asyncio.sleep(interval)
                    second = await directory.read()
                    return first, second, time.monotonic() - t0
                finally:
                    await asyncio.wait_for(directory.close(), 10)
            finally:
                await transport.close()

        try:
            first, second, waited = loop.run(read_twice(), timeout=timeout + interval + 30)
            return summarize(first, second, waited, time.time())
        except Exception as e:  # noqa: BLE001 - any failure means "try the next address"
            tried.append(f"{addr} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        finally:
            loop.stop()
            reaper.close()
    raise RuntimeError("no address answered:\n  " + "\n  ".join(tried) +
                       "\nCheck the address (from the output of `diloco start`) and the --run-id.")
