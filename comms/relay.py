"""Relays on the data plane: members that cannot be dialed are called through members that volunteer.

A lab behind a NAT, or a firewall that lets connections out only, can dial the swarm but nobody can dial it. Its
calls to others go direct; others' calls to it went through libp2p over the connections it opened, and two such
members could not reach each other at all. Here a member started with `--relay` (reachable itself) serves as a
relay for the members of its run, and a member that cannot be dialed keeps connections waiting at up to `MAX_VIA`
relays; others call it through one of them.

Every step is a call on the data plane (`comms/dataplane.py`), so a relay serves members of its own run only:
its port takes nothing before the data handshake (the swarm's credential, the caller's key, the allowlist), as
for any call. On that authenticated connection a member asks for one of three things (the handler names):

- `relay.wait` (from a member that cannot be dialed): keep this connection until a member calls me through you.
  The relay answers only then, with the caller's peer id, and from that answer on the connection carries the
  caller's bytes: the caller's own handshake with the waiting member, and its records.
- `relay.to` (from a caller), the body a member's peer id: put me through to a connection it keeps waiting here.
  After the relay's "+" the connection carries raw bytes both ways: the caller runs the data handshake with the
  member over it, end to end (its X25519 keys are the two ends', the signatures their libp2p keys'), so the relay
  copies records it can neither read nor forge, nor replay, reorder or cut without both ends refusing them.
- `relay.probe`, the body our data address: dial it and say whether the data handshake with us completed there
  (`reach="auto"` asks this once a relay is known, and waits at relays only when the answer is no).

A refusal is "!" and a reason, counted at the relay by reason (`REASONS`). The relay caps what each member may
hold: connections waiting (`waiting`), circuits open with it at either end (`circuits`), and the bytes it sends
through the relay each second (`rate_mbit`; a member over it is slowed down, not the relay's other circuits).

The relay's own calls to a member that waits at it take one of its waiting connections directly (no second hop).
A member whose relays are all gone is called through libp2p again (`DirectTransport.call`), reachable by those
members it dialed itself; its waiting tasks try again every few seconds and it is back through a relay as soon as
one answers (tests/test_relay.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

from .dataplane import RECORD, REPLY, REQUEST, Channel, parse_address
from .pipe import Pipe
from .transport import PeerId, TransportError

if TYPE_CHECKING:
    from .dataplane import DirectTransport

log = logging.getLogger(__name__)

WAIT, TO, PROBE = "relay.wait", "relay.to", "relay.probe"
NAMES = frozenset({WAIT, TO, PROBE})
REASONS = ("relay_off", "relay_no_target", "relay_busy", "relay_malformed")
"""Why a relay refused a member's request (counted with the data port's refusals)."""
MAX_VIA = 2
"""Relays a member that cannot be dialed waits at, at most."""
GIVE_UP = 30.0
"""Seconds a relay may stay lost before a member waits at another one the directory shows instead."""
TAKE_TIMEOUT = 2.0
"""Seconds a call through a relay waits there for the callee's next waiting connection (all in use at once)."""
REACH = ("auto", "relay", "direct")
QUEUED = 1 << 17
"""Bytes a circuit may hold queued for one end before it waits for that end to read them."""
UNREACHED = (TransportError, OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError)
"""What a connection to a member or a relay fails with when the other end cannot be reached or went away
(ValueError: an address the resolver refuses)."""


@dataclass(frozen=True)
class RelayConfig:
    """What a member does about relays (`SwarmConfig.relay` and friends)."""

    serve: bool = False
    """Serve as a relay for the members of this run that cannot be dialed (`--relay`; a member whose own data
    port others can reach). Off: a member asking for it is refused (`relay_off`)."""
    circuits: int = 256
    """Circuits one member may have open through this relay at once as caller: it keeps up to `data_streams` (8)
    open to each member it calls through the relay, so 256 serve calls to 32 members behind NATs; a callee's
    circuits are bounded by the connections it keeps waiting."""
    waiting: int = 32
    """Connections one member may keep waiting here at once."""
    rate_mbit: float = 0.0
    """Megabits per second one member may send through this relay, summed over its circuits (0: no cap)."""
    reach: str = "auto"
    """"auto": once a relay is known, ask it to dial our data port, and wait at relays if it cannot; "relay":
    wait at relays and be called through them whatever the answer (a test, a benchmark, a port known to be
    closed); "direct": never (others call us on our data port, else through libp2p)."""
    slots: int = 8
    """Connections kept waiting at each relay: calls to us in flight through it at once (a new one replaces each
    taken at once)."""

    def __post_init__(self) -> None:
        if self.reach not in REACH:
            raise ValueError(f"reach must be one of {', '.join(REACH)}, got {self.reach!r}")
        if self.circuits < 1:
            raise ValueError(f"relay_circuits must be >= 1 circuit a member, got {self.circuits}")
        if self.waiting < 1 or self.slots < 1:
            raise ValueError(f"waiting and slots must be >= 1 connection, got {self.waiting} and {self.slots}")
        if not self.rate_mbit >= 0:
            raise ValueError(f"relay_rate must be >= 0 Mbit/s (0: no cap), got {self.rate_mbit}")


class Refused(TransportError):
    """A relay refused a request; `reason` is one of `REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def refusal(reason: str, detail: str) -> bytes:
    return b"!" + f"{reason} {detail}".encode()[:300]


def answer(reply: bytes, relay: PeerId) -> bytes:
    """The body of a relay's "+" answer; raises `Refused` for a "!" one."""
    if reply[:1] == b"+":
        return reply[1:]
    reason, _, detail = reply[1:].decode(errors="replace").partition(" ")
    raise Refused(reason if reason in REASONS else "relay_malformed", f"relay {relay} refused: {reason} {detail}")


@dataclass
class Bucket:
    """A member's allowance of bytes through a relay: `rate` a second, a tenth of a second's worth (at least a
    record) in hand. `take` returns how long the sender must wait for what it sent (its debt)."""

    rate: float
    tokens: float = 0.0
    at: float = field(default_factory=time.monotonic)

    def take(self, n: int, now: float) -> float:
        burst = max(self.rate / 10, RECORD)
        self.tokens = min(burst, self.tokens + (now - self.at) * self.rate) - n
        self.at = now
        return max(0.0, -self.tokens / self.rate)


class RelayService:
    """The relay's side: connections members keep waiting here, the circuits between them, and what each member
    moved. `dial(peer, address)` opens a data connection to `peer` at `address` (a probe); `refused(reason, caller,
    detail)` counts and logs a refusal as the data port does its own."""

    names = NAMES

    def __init__(self, cfg: RelayConfig, refused: Callable[[str, str, str], None],
                 dial: Callable[[PeerId, tuple[str, int]], Awaitable[Channel]]) -> None:
        self.cfg, self._refused, self._dial = cfg, refused, dial
        self.waiting: dict[PeerId, list[Channel]] = {}
        self.circuits: Counter[PeerId] = Counter()
        """Circuits open now, by caller."""
        self.opened = 0
        """Circuits put through so far."""
        self.moved: Counter[PeerId] = Counter()
        """Bytes each member sent through us."""
        self.throttled: dict[PeerId, float] = {}
        """Seconds each member's bytes were held back by its rate cap (`rate_mbit`)."""
        self._buckets: dict[PeerId, Bucket] = {}
        self._arrived: dict[PeerId, asyncio.Event] = {}
        self._probing: set[PeerId] = set()

    async def serve(self, channel: Channel, name: str, body: bytes) -> None:
        """A member's request on its data connection `channel`, which this takes over until it ends."""
        member = channel.peer
        if not self.cfg.serve:
            return await self._refuse(channel, name, "relay_off", "this member is no relay (it runs without --relay)")
        if name == WAIT:
            await self._wait(channel)
        elif name == TO:
            await self._put_through(channel, body)
        elif name == PROBE:
            await self._probe(channel, member, body)

    async def _refuse(self, channel: Channel, name: str, reason: str, detail: str) -> None:
        self._refused(reason, channel.peer, detail)
        await channel.send(REPLY, name, refusal(reason, detail))

    async def _wait(self, channel: Channel) -> None:
        member = channel.peer
        queue = self.waiting.setdefault(member, [])
        if len(queue) >= self.cfg.waiting:
            return await self._refuse(channel, WAIT, "relay_busy", f"{len(queue)} connections wait here already")
        channel.pipe.keep_alive()
        queue.append(channel)
        self._arrived.setdefault(member, asyncio.Event()).set()
        try:
            await channel.pipe.ended()  # taken or not, the connection is done when its member (or a circuit) ends it
        finally:
            if channel in queue:
                queue.remove(channel)

    async def take(self, member: PeerId, caller: PeerId, timeout: float = TAKE_TIMEOUT) -> Pipe | None:
        """One of the connections `member` keeps waiting here, told that `caller` is on it (from then on its bytes
        are the caller's); None if none came within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            queue = self.waiting.get(member, [])
            while queue:
                channel = queue.pop(0)
                if channel.pipe.ended_already:
                    continue
                try:
                    await channel.send(REPLY, WAIT, b"+" + caller.encode())
                except (OSError, ConnectionError):
                    continue
                return channel.pipe
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            arrived = self._arrived.setdefault(member, asyncio.Event())
            arrived.clear()
            try:
                await asyncio.wait_for(arrived.wait(), left)
            except asyncio.TimeoutError:
                return None

    @staticmethod
    async def through(hop: Channel, target: PeerId) -> Pipe:
        """Ask the relay at the other end of `hop` (our data connection to it) to put us through to `target`: the
        connection, raw from then on (closed if the relay refused, `Refused`)."""
        try:
            await hop.send(REQUEST, TO, target.encode())
            _, reply = await asyncio.wait_for(hop.receive(REPLY), TAKE_TIMEOUT + 5)
            answer(reply, hop.peer)
        except BaseException:
            hop.close()
            raise
        return hop.pipe

    async def _put_through(self, channel: Channel, body: bytes) -> None:
        caller = channel.peer
        target = PeerId(bytes(body).decode(errors="replace"))
        if not 0 < len(target) <= 128 or target == caller:
            return await self._refuse(channel, TO, "relay_malformed", "no member named")
        if target not in self.waiting:
            return await self._refuse(channel, TO, "relay_no_target", f"{target} never waited here")
        if self.circuits[caller] >= self.cfg.circuits:  # the callee's side: bounded by the connections it keeps here
            return await self._refuse(channel, TO, "relay_busy", f"{caller} has {self.cfg.circuits} circuits open")
        self.circuits[caller] += 1
        try:
            pipe = await self.take(target, caller)
            if pipe is None:
                return await self._refuse(channel, TO, "relay_no_target", f"{target} keeps no connection here")
            await channel.send(REPLY, TO, b"+")
            self.opened += 1
            await self.splice(caller, channel.pipe, target, pipe)
        finally:
            self.circuits[caller] -= 1
            if not self.circuits[caller]:
                del self.circuits[caller]

    async def splice(self, a: PeerId, pa: Pipe, b: PeerId, pb: Pipe) -> None:
        """Copy bytes both ways between `a`'s connection and `b`'s until either ends; then close both at once (what
        is still queued for an end that stopped reading is dropped, not kept)."""
        pumps = [asyncio.ensure_future(self._pump(pa, pb, a)), asyncio.ensure_future(self._pump(pb, pa, b))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            pa.abort()
            pb.abort()

    async def _pump(self, src: Pipe, dst: Pipe, sender: PeerId) -> None:
        bucket = self._buckets.setdefault(sender, Bucket(self.cfg.rate_mbit * 1e6 / 8)) if self.cfg.rate_mbit else None
        while True:
            chunk = await src.read_some(RECORD)
            if not chunk:
                return
            if bucket is not None:
                wait = bucket.take(len(chunk), time.monotonic())
                if wait > 0:
                    self.throttled[sender] = self.throttled.get(sender, 0.0) + wait
                    await asyncio.sleep(wait)
            dst.write(chunk)
            self.moved[sender] += len(chunk)
            if dst.buffered() > QUEUED:
                await dst.drain()  # an end that does not read holds its sender back, not the relay's memory

    async def _probe(self, channel: Channel, member: PeerId, body: bytes) -> None:
        address = parse_address(bytes(body).decode(errors="replace"))
        if address is None:
            return await self._refuse(channel, PROBE, "relay_malformed", "no host:port to probe")
        if member in self._probing:
            return await self._refuse(channel, PROBE, "relay_busy", "a probe of this member is in flight")
        self._probing.add(member)
        try:
            dialed = await self._dial(member, address)
            dialed.close()
            reply = b"+"
        except UNREACHED as e:
            reply = b"-" + f"{type(e).__name__}: {e or 'no answer in time'}".encode()[:300]
        finally:
            self._probing.discard(member)
        await channel.send(REPLY, PROBE, reply)

    def stats(self) -> dict[str, object]:
        """What this relay did, for the final metrics line."""
        return {"circuits": self.opened, "waiting": sum(len(q) for q in self.waiting.values()),
                "moved": dict(self.moved), "throttled_s": {p: round(s, 2) for p, s in self.throttled.items()}}


class Reach:
    """A member's side of relays: whether others can dial its data port (asked of a relay), and, when they cannot
    (or with `reach="relay"`), connections kept waiting at up to `MAX_VIA` relays, each served as a call to us
    once a member comes through it. `dial(relay)` opens a data connection to a relay (at its record's address),
    `serve(pipe, label)` serves a connection whose next bytes are a caller's data handshake."""

    def __init__(self, cfg: RelayConfig, me: PeerId, address: Callable[[], str],
                 dial: Callable[[PeerId], Awaitable[Channel]], serve: Callable[[Pipe, str], Awaitable[None]]) -> None:
        self.cfg, self.me, self._address, self._dial, self._serve = cfg, me, address, dial, serve
        self.reachable: bool | None = None if cfg.reach == "auto" else cfg.reach == "direct"
        """Whether members can dial our data port (None: not known yet)."""
        self.live: Counter[PeerId] = Counter()
        """Connections waiting at each relay now."""
        self.served: Counter[PeerId] = Counter()
        """Calls that came to us through each relay."""
        self._tasks: dict[PeerId, list[asyncio.Task[None]]] = {}
        self._probe: asyncio.Task[None] | None = None
        self._lost: dict[PeerId, float] = {}
        """Relays our waiting connections lost, since when (until one waits there again)."""
        self._closed = False

    @property
    def via(self) -> tuple[PeerId, ...]:
        """The relays where a connection of ours waits now: our record names them, and members call us there."""
        return tuple(sorted(r for r, n in self.live.items() if n > 0))

    def update(self, relays: list[PeerId]) -> None:
        """The relays the directory shows now (no network I/O here: starts or stops tasks)."""
        if self._closed:
            return
        relays = [r for r in relays if r != self.me]
        if self.reachable is None and relays and (self._probe is None or self._probe.done()):
            self._probe = asyncio.ensure_future(self._ask(relays))
        now = time.monotonic()
        working = [r for r in relays if now - self._lost.get(r, now) < GIVE_UP]  # a relay gone that long: the next
        chosen = (working + [r for r in relays if r not in working])[:MAX_VIA] if self.reachable is False else []
        for relay in [r for r in self._tasks if r not in chosen]:
            for task in self._tasks.pop(relay):
                task.cancel()
        for relay in chosen:
            if relay not in self._tasks:
                self._tasks[relay] = [asyncio.ensure_future(self._wait_at(relay)) for _ in range(self.cfg.slots)]

    async def _ask(self, relays: list[PeerId]) -> None:
        """Whether a relay can dial our data port: the first relay that answers decides."""
        for relay in relays:
            try:
                channel = await self._dial(relay)
                try:
                    await channel.send(REQUEST, PROBE, self._address().encode())
                    _, reply = await asyncio.wait_for(channel.receive(REPLY), 15)
                finally:
                    channel.close()
                body = reply[1:] if reply[:1] == b"-" else answer(reply, relay)  # "-": it could not; "!": refused
            except UNREACHED as e:
                log.info("event=relay_probe_failed relay=%s reason=%s", relay, e)
                continue
            self.reachable = reply[:1] == b"+"
            if self.reachable:
                log.info("event=reach path=direct relay=%s", relay)
            else:
                log.warning("event=reach path=relay relay=%s reason=%s: members cannot dial this peer's data port; "
                            "it keeps connections waiting at relays and is called through them", relay,
                            bytes(body).decode(errors="replace"))
            return

    async def _wait_at(self, relay: PeerId) -> None:
        """One connection waiting at `relay`, again and again: each one a member takes is served as a call."""
        backoff = 0.5
        while not self._closed:
            channel: Channel | None = None
            try:
                channel = await self._dial(relay)
                channel.pipe.keep_alive()
                await channel.send(REQUEST, WAIT, b"")
                self.live[relay] += 1
                if relay in self._lost:
                    del self._lost[relay]
                    log.warning("event=relay_back relay=%s: members can call this peer through it again", relay)
                backoff = 0.5
                try:
                    _, reply = await channel.receive(REPLY)
                finally:
                    self.live[relay] -= 1
                caller = answer(reply, relay)
            except BaseException as e:
                if channel is not None:
                    channel.close()
                if not isinstance(e, UNREACHED):
                    raise
                self._lose(relay, e)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 5.0)
                continue
            self.served[relay] += 1
            log.debug("event=relay_call relay=%s caller=%s", relay, bytes(caller).decode(errors="replace"))
            asyncio.ensure_future(self._serve(channel.pipe, f"relay:{relay}"))

    def _lose(self, relay: PeerId, e: BaseException) -> None:
        if relay not in self._lost:
            self._lost[relay] = time.monotonic()
            others = [r for r in self.via if r != relay]
            log.warning("event=relay_lost relay=%s reason=%s: %s", relay, f"{type(e).__name__}: {e}"[:200],
                        f"still reachable through {', '.join(others)}" if others else
                        "members that cannot dial this peer call it through libp2p, and those it never dialed "
                        "cannot reach it until a relay is back (tried again every few seconds)")

    def close(self) -> None:
        self._closed = True
        for tasks in self._tasks.values():
            for task in tasks:
                task.cancel()
        self._tasks.clear()
        if self._probe is not None:
            self._probe.cancel()


def attach(transport: DirectTransport, cfg: RelayConfig) -> None:
    """Give a data plane its relay's side (serving, or refusing, members' relay requests) and its reach (probing,
    waiting at relays). Call on the transport's event loop, after `start` (the address to probe is known)."""
    transport.relay = RelayService(cfg, transport.refused, transport.connect_to)
    transport.reach = Reach(cfg, transport.peer_id, lambda: transport.address, transport.dial, transport.serve)


__all__ = ["RelayConfig", "RelayService", "Reach", "Refused", "Bucket", "NAMES", "WAIT", "TO", "PROBE", "REASONS",
           "MAX_VIA", "answer", "refusal", "attach"]

