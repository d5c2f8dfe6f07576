"""`diloco status ADDR [--watch]`: who is in a swarm, their round, loss, bandwidth, utilization and last
heartbeat.

An observer joins the swarm's DHT in client mode through the first address that answers (it stores
nothing and publishes no record, so it never appears as a peer) and reads the peer records of the run:
twice, `interval` seconds apart, for one table; or every `interval` seconds until stopped, with
`--watch`. Rates (inner steps and bytes per second) come from two records of the same peer, over the
time between their heartbeats on that peer's own clock. Its libp2p daemon is watched by the same
reaper as a peer's.

Before the directory, the observer shakes hands with that peer as a joining peer does (the swarm's credential, the
run id) and reads the swarm's time from then on (`comms.clock`): the records' expirations and the heartbeats' ages
are the swarm's, so a laptop whose clock is off by a minute still sees every peer, with its true age.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from diloco.comms.loop import LoopThread
from diloco.peers import PeerRecord


@dataclass(frozen=True)
class PeerStatus:
    record: PeerRecord
    heartbeat_age: float | None  # seconds since its last heartbeat (on the swarm's clock), None if unknown
    steps_per_second: float | None
    bytes_per_second: float | None = None  # sent + received, None until two heartbeats were seen

    def to_json(self) -> dict[str, Any]:
        return {**self.record.to_wire(), "heartbeat_age": self.heartbeat_age,
                "steps_per_second": self.steps_per_second, "bytes_per_second": self.bytes_per_second}


def rates(before: PeerRecord | None, after: PeerRecord, interval: float) -> tuple[float | None, float | None]:
    """Pure: (inner steps, bytes) per second between two records of one peer: over the time between their
    heartbeats when both carry one, else over `interval` (the time between our reads); None where the
    counters went back (the peer restarted) or no time passed."""
    if before is None:
        return None, None
    span = after.beat - before.beat if after.beat > before.beat > 0 else interval
    if span <= 0:
        return None, None
    steps = (after.step - before.step) / span if after.step >= before.step else None
    moved_before = before.bytes_sent + before.bytes_received
    moved_after = after.bytes_sent + after.bytes_received
    moved = (moved_after - moved_before) / span if moved_after >= moved_before and moved_after else None
    return steps, moved


def _order(r: PeerRecord) -> tuple[bool, int, str]:
    return r.status != "training", -r.round, r.peer  # training first, newest round first


def summarize(first: Iterable[PeerRecord], second: list[PeerRecord], interval: float, now: float) -> list[PeerStatus]:
    """Pure: the status rows from two reads of the records, `interval` seconds apart."""
    before = {r.peer: r for r in first}
    out = []
    for r in sorted(second, key=_order):
        steps, moved = rates(before.get(r.peer), r, interval)
        age = max(0.0, now - r.beat) if r.beat > 0 else None
        out.append(PeerStatus(r, age, steps, moved))
    return out


class Tracker:
    """Rows across many reads (`--watch`): a peer's rates are measured from its previous heartbeat's record
    to its newest one, and stand until its next heartbeat (reads can come faster than heartbeats)."""

    def __init__(self) -> None:
        self._seen: dict[str, PeerRecord] = {}
        self._rates: dict[str, tuple[float | None, float | None]] = {}

    def rows(self, records: list[PeerRecord], interval: float, now: float) -> list[PeerStatus]:
        out = []
        for r in sorted(records, key=_order):
            prev = self._seen.get(r.peer)
            if prev is None or r.beat != prev.beat:
                self._rates[r.peer] = rates(prev, r, interval)
                self._seen[r.peer] = r
            age = max(0.0, now - r.beat) if r.beat > 0 else None
            out.append(PeerStatus(r, age, *self._rates[r.peer]))
        return out


def swarm_time() -> float:
    """Now, on the swarm's clock (what the handshake in `Observer.open` adopted)."""
    from diloco.comms.clock import SWARM_CLOCK

    return SWARM_CLOCK.now()


def why_not(error: BaseException) -> str:
    """Why connecting to one address failed, in the user's terms: the handshake's refusal of our credential (which
    is the run's: another secret and another run id read alike), or the DHT's refusal of a request signed for
    another run or with another secret, which reads, from hivemind, as a bootstrap failure with an option nobody here
    can set."""
    from diloco.comms.hello import HandshakeError

    text = str(error).splitlines()[0] if str(error) else ""
    if isinstance(error, HandshakeError) and error.field in ("secret", "run_id"):
        return ("its handshake refused us: a wrong --run-id or swarm secret (a swarm answers only the holders of its "
                "secret, for its run)")
    if isinstance(error, HandshakeError):
        return text
    if "DHTNode bootstrap failed" in text:
        return ("its DHT did not answer us: a wrong --run-id or swarm secret (it answers only requests signed for "
                "its run with its secret), or the peer is down")
    return f"{type(error).__name__}: {text}"


class Observer:
    """A read-only view of a swarm's records: `open` through the first address that answers, `read` as
    often as wanted, `close` (or use it as a context manager)."""

    def __init__(self, run_id: str, secret: str, timeout: float = 30.0) -> None:
        self.run_id, self.secret, self.timeout = run_id, secret, timeout
        self.address: str | None = None
        self._loop: LoopThread | None = None
        self._reaper: Any = None
        self._transport: Any = None
        self._directory: Any = None

    def __enter__(self) -> Observer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self, addresses: list[str]) -> str:
        """Connect through the first of `addresses` that answers (its DHT, signing our requests with the
        swarm secret); returns it. Raises RuntimeError listing what failed."""
        tried = []
        for addr in addresses:
            try:
                self._connect(addr)
                self.address = addr
                return addr
            except Exception as e:  # noqa: BLE001 - any failure means "try the next address"
                self.close()
                tried.append(f"{addr} ({why_not(e)})")
        raise RuntimeError("no address answered:\n  " + "\n  ".join(tried) +
                           "\nCheck the address (from the output of `diloco start`) and the --run-id.")

    def _connect(self, addr: str) -> None:
        from diloco.comms.auth import HmacAuthorizer
        from diloco.comms.clock import SWARM_CLOCK, use_in_hivemind
        from diloco.comms.hello import HandshakeError
        from diloco.comms.p2p import P2PTransport
        from diloco.comms.transport import TransportError
        from diloco.config import SwarmConfig
        from diloco.connect import hello, peer_of
        from diloco.peers import DHTDirectory
        from diloco.peers.reaper import Reaper

        self._loop, self._reaper = LoopThread(name="diloco-status"), Reaper()
        reaper = self._reaper

        async def connect() -> None:
            self._transport = await P2PTransport.create(initial_peers=[addr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            self._transport.watched_by(reaper)
            cfg = SwarmConfig(run_id=self.run_id, secret=self.secret)
            self._transport.guard = cfg.guard(self._transport.peer_id)
            use_in_hivemind(SWARM_CLOCK.now)  # the directory reads the swarm's time, as a peer's does
            try:
                offset = await hello(self._transport, peer_of(addr), cfg, "")
            except HandshakeError as e:
                if e.field in ("secret", "run_id", "clock"):  # the directory would refuse us too: say why now
                    raise
                # an allowlist keeps our new peer id out of its calls, not out of its directory; a peer of another
                # version answers its own hello: read the directory on this machine's clock, as before the handshake
                offset = None
            except TransportError:
                offset = None  # a peer still starting (its handlers not there yet), or a refusal that names no setting
                # of ours (a replay, a malformed call: `connect.REFUSED_FIELD`): its directory may answer
            SWARM_CLOCK.adopt([] if offset is None else [offset])
            self._directory = await asyncio.wait_for(
                DHTDirectory.create(self._transport.p2p, self.run_id, [addr], client_mode=True,
                                    authorizer=HmacAuthorizer(self.secret, self.run_id)), self.timeout)
            await self._directory.read()  # a DHT that does not answer us (another secret) fails here

        self._loop.run(connect(), timeout=self.timeout + 30)

    def read(self) -> list[PeerRecord]:
        if self._loop is None or self._directory is None:
            raise RuntimeError("Observer.read before open")
        records: list[PeerRecord] = self._loop.run(self._directory.read(), timeout=self.timeout)
        return records

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            async def shut() -> None:  # an observer published nothing: no graceful DHT leave is owed
                try:
                    if self._directory is not None:
                        await asyncio.wait_for(self._directory.close(), 3)
                finally:
                    if self._transport is not None:
                        await self._transport.close()
            try:
                loop.run(shut(), timeout=10)
            except Exception:  # noqa: BLE001 - closing must never fail
                pass
            loop.stop()
        self._directory = self._transport = None
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None


def observe(addresses: list[str], run_id: str, secret: str, interval: float = 2.0,
            timeout: float = 30.0) -> list[PeerStatus]:
    """Read the swarm at the first of `addresses` that answers, twice, `interval` seconds apart; raises
    RuntimeError listing what failed."""
    with Observer(run_id, secret, timeout) as obs:
        obs.open(addresses)
        first = obs.read()
        t0 = time.monotonic()
        time.sleep(interval)
        second = obs.read()
        return summarize(first, second, time.monotonic() - t0, swarm_time())


def watch(addresses: list[str], run_id: str, secret: str, show: Callable[[list[PeerStatus]], None],
          interval: float = 2.0, stop: threading.Event | None = None, timeout: float = 30.0) -> None:
    """Read the swarm at the first of `addresses` that answers every `interval` seconds and `show` its rows,
    until `stop` is set (or Ctrl-C: KeyboardInterrupt). Raises RuntimeError when no address answers."""
    stop = stop or threading.Event()
    tracker = Tracker()
    with Observer(run_id, secret, timeout) as obs:
        obs.open(addresses)
        while not stop.is_set():
            started = time.monotonic()
            show(tracker.rows(obs.read(), interval, swarm_time()))
            stop.wait(max(0.0, interval - (time.monotonic() - started)))
