"""The direct data plane: calls between members on TCP connections of their own, beside libp2p.

Every call through the libp2p daemons crosses two processes and a unix socket on each side; a round moved 1.5-3% of
plain TCP's speed on loopback that way (docs/BENCHMARKS.md, B3). Here a member listens on a data port of its own,
advertises it in its signed directory record (`PeerRecord.data`), and other members call it on direct connections:
the same named handlers, the same one-request-one-reply calls (`DirectTransport`). libp2p keeps identities, the
directory, the join handshake, and every call to a peer whose data port cannot be reached, which falls back to it.

A connection starts with a handshake bound to both peer ids and the run, then carries AEAD records.

    client -> server   "DLD1" | client's X25519 key (32) | nonce (16) | u8 n | client peer id (n)
    server -> client   "DLD1" | server's X25519 key (32) | u8 n | server peer id (n) | signature (64) | proof (32)
    client -> server   signature (64) | proof (32)

    T         = SHA-256("diloco-data/1" | client hello | server's X25519 key | server peer id)
    keys      = HKDF-SHA256(X25519 shared secret, salt = the run's data key, info = T): client->server,
                server->client, confirmation (32 bytes each)
    proof     = HMAC-SHA256(confirmation key, "S" | T), or "C" | T from the client
    signature = Ed25519 over "diloco-data/server" | T (or "/client") with the peer's libp2p key

The run's data key is derived from the swarm secret and the run id (`Guard.data_key`); the secret never travels.
A side without it derives other keys, so its proof fails: the server checks the client's proof (the credential)
first, then its signature (the peer id it claims: the key is embedded in the id), then the allowlist; the client
checks that the server is the peer whose record named the address. The ephemeral X25519 keys make each
connection's keys new (nothing recorded from one connection opens another).

After it, each direction is a sequence of records, `u32 length | AES-256-GCM ciphertext`, the length as associated
data and the record's position in its direction as the nonce: a record replayed, reordered, dropped, cut short or
changed fails authentication, and the connection is closed. A message (a request or its reply) is one record with
its kind, its handler's name and its length, then the records of its body (at most `RECORD` bytes each). Nothing
that fails authentication reaches a handler; a message longer than the receiver's limit is refused before a byte
of its body is read. A stranger at the data port must finish the handshake within `HELLO_TIMEOUT` seconds, and the
port keeps the stream gate's caps on handshakes in progress, per address and in all (`streamgate.py`). Every
refusal is counted by reason with the libp2p port's (`Guard.refused`, reasons `data_*` and the gate's).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import struct
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, cast

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .identity import Identity, verify
from .pipe import Pipe, open_pipe, serve_pipes
from .streamgate import Cut, GateConfig, StreamGate
from .transport import ByteCounter, CallTimedOut, Handler, PeerId, Transport, TransportError

if TYPE_CHECKING:
    from .auth import Guard
    from .relay import Reach, RelayService

log = logging.getLogger(__name__)

MAGIC = b"DLD1"
RECORD = 1 << 20
"""Most body bytes in one record: a message is read, authenticated and copied a record at a time."""
TAG = 16
HELLO_TIMEOUT = 5.0
"""Seconds a connection has to finish its handshake."""
CONNECT_TIMEOUT = 2.0
"""Seconds a member's data port has to take our TCP connection (a few round trips of the longest link, and a SYN
resent): past it the port counts as unreachable (behind a NAT or a firewall that only lets connections out) and the
call goes through libp2p, within the round's deadlines, not after them."""
REQUEST, REPLY = 1, 2
RELAYED = ("relay", "")
"""The pool key of a member's connections through relays (`comms/relay.py`)."""
_LEN = struct.Struct(">I")
_START = struct.Struct(">BQH")  # kind, body length, name length: the first record of a message
REASONS = ("data_unauthorized", "data_not_allowed", "data_malformed", "data_bad_frame", "data_oversized",
           "data_wrong_peer")
"""Why the data port refused a connection or a message (counted beside the libp2p port's reasons)."""


class DataRefused(TransportError):
    """A data connection or message refused; `reason` is one of `REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


# ---------------------------------------------------------------------- the handshake (pure functions)


def _public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def client_hello(ephemeral: bytes, nonce: bytes, me: str) -> bytes:
    peer = me.encode()
    return MAGIC + ephemeral + nonce + bytes([len(peer)]) + peer


def transcript(hello: bytes, server_ephemeral: bytes, server: str) -> bytes:
    return hashlib.sha256(b"diloco-data/1" + hello + server_ephemeral + server.encode()).digest()


@dataclass(frozen=True)
class Keys:
    """One connection's keys: each direction's AEAD, and the key both sides prove they derived."""

    client_to_server: AESGCM
    server_to_client: AESGCM
    confirm: bytes

    @classmethod
    def derive(cls, own: X25519PrivateKey, their_public: bytes, data_key: bytes, t: bytes) -> Keys:
        shared = own.exchange(X25519PublicKey.from_public_bytes(their_public))
        okm = HKDF(algorithm=hashes.SHA256(), length=96, salt=data_key, info=t).derive(shared)
        return cls(AESGCM(okm[:32]), AESGCM(okm[32:64]), okm[64:])

    def proof(self, side: bytes, t: bytes) -> bytes:
        return hmac.new(self.confirm, side + t, hashlib.sha256).digest()


def _signed(side: str, t: bytes) -> bytes:
    return f"diloco-data/{side}".encode() + t


# ---------------------------------------------------------------------- records


@dataclass
class Sealer:
    """One direction of a connection: AES-256-GCM records, the record's position its nonce."""

    aead: AESGCM
    count: int = 0

    def _nonce(self) -> bytes:
        nonce = b"\0\0\0\0" + self.count.to_bytes(8, "big")
        self.count += 1
        return nonce

    def seal(self, plain: bytes | memoryview) -> bytes:
        head = _LEN.pack(len(plain) + TAG)
        return head + self.aead.encrypt(self._nonce(), plain, head)

    def seal_into(self, plain: memoryview, out: memoryview) -> int:
        """`seal(plain)` written into `out` (no allocation); returns its length."""
        n = plain.nbytes + TAG
        out[:_LEN.size] = _LEN.pack(n)
        self.aead.encrypt_into(self._nonce(), plain, out[:_LEN.size], out[_LEN.size:_LEN.size + n])
        return _LEN.size + n

    def open(self, head: bytes, sealed: bytes | memoryview, into: memoryview | None = None) -> bytes:
        """The plaintext of a record (`head`: its length prefix), or with `into` written there (returns b"")."""
        try:
            if into is not None:
                self.aead.decrypt_into(self._nonce(), sealed, head, into)
                return b""
            return self.aead.decrypt(self._nonce(), sealed, head)
        except InvalidTag:
            raise DataRefused("data_bad_frame", "a record failed authentication (changed, replayed, reordered, "
                                                "cut short, or sealed with other keys)") from None


@dataclass
class Channel:
    """An established data connection to `peer`: one message out, one back, at a time."""

    peer: PeerId
    pipe: Pipe
    out: Sealer
    into: Sealer
    counter: ByteCounter
    max_message: int

    async def send(self, kind: int, name: str, body: bytes | memoryview) -> None:
        view = memoryview(body).cast("B")
        label = name.encode()
        first = RECORD - _START.size - len(label)
        self._write(self.out.seal(_START.pack(kind, view.nbytes, len(label)) + label + bytes(view[:first])))
        for lo in range(first, view.nbytes, RECORD):  # each record sealed into memory of its own: the transport
            piece = view[lo:lo + RECORD]  # may keep it queued as it is (`Pipe.write`)
            record = bytearray(_LEN.size + piece.nbytes + TAG)
            self.out.seal_into(piece, memoryview(record))
            self._write(record)
            if self.pipe.buffered() > 4 * RECORD:
                await self.pipe.drain()
        await self.pipe.drain()

    def _write(self, record: bytes | bytearray) -> None:
        self.pipe.write(record)  # sent, or kept queued: never written to again
        self.counter.add(self.peer, sent=len(record))

    async def _record(self, limit: int, first: bool = False, into: memoryview | None = None,
                      sealed: bytearray | None = None) -> bytes:
        """The next record's plaintext (with `into`: written there, of which it must fill all but `TAG` bytes,
        and b"" returned). A connection closed before a message's first byte raises `IncompleteReadError` (the
        caller is done); closed anywhere else, the message was cut short. The sealed record lands in `sealed` (a
        message's buffer for its records, one after the other; else one of its own), the kernel writing it there
        (`Pipe.read_into`), and is opened from it."""
        try:
            head = await self.pipe.read_exactly(_LEN.size)
        except asyncio.IncompleteReadError as e:
            if first and not e.partial:
                raise
            raise DataRefused("data_malformed", "a message cut short") from None
        (length,) = _LEN.unpack(head)
        if length < TAG or length > limit + TAG:
            raise DataRefused("data_oversized" if length > limit + TAG else "data_malformed",
                              f"a record of {length} bytes (at most {limit + TAG})")
        if into is not None and length != into.nbytes + TAG:
            raise DataRefused("data_malformed", f"a record of {length} bytes inside a message, not {into.nbytes + TAG}")
        view = memoryview(sealed if sealed is not None and len(sealed) >= length else bytearray(length))[:length]
        try:
            await self.pipe.read_into(view)
        except asyncio.IncompleteReadError:
            raise DataRefused("data_malformed", "a message cut short") from None
        self.counter.add(self.peer, received=_LEN.size + length)
        return self.into.open(head, view, into)

    async def receive(self, kind: int) -> tuple[str, bytes]:
        """The next message, which must be of `kind`: (handler name, body). Raises `DataRefused` for a record
        that fails authentication, a message longer than `max_message`, one malformed or cut short, and
        `IncompleteReadError` when the connection closed between messages."""
        first = await self._record(RECORD, first=True)
        if len(first) < _START.size:
            raise DataRefused("data_malformed", "a message's first record is shorter than its header")
        got, length, named = _START.unpack_from(first)
        if got != kind or len(first) < _START.size + named:
            raise DataRefused("data_malformed", f"message kind {got} (expected {kind}) or a name past its record")
        if length > self.max_message:
            raise DataRefused("data_oversized", f"a message of {length} bytes, the limit is {self.max_message}")
        name = first[_START.size:_START.size + named].decode(errors="replace")
        start = _START.size + named
        if len(first) - start > length:
            raise DataRefused("data_malformed", "a message's first record holds more than its length")
        if len(first) - start == length:
            return name, first[start:]
        body = bytearray(length)
        filled = len(first) - start
        body[:filled] = memoryview(first)[start:]
        into, sealed = memoryview(body), bytearray(RECORD + TAG)
        while filled < length:  # records of RECORD bytes, the last one the rest: each decrypted in place
            size = min(RECORD, length - filled)
            await self._record(size, into=into[filled:filled + size], sealed=sealed)
            filled += size
        # the message's own buffer, nobody else's: its reader keeps it, no copy. Typed as bytes for the handlers and
        # callers (`Handler`), which read it as bytes do (through memoryviews, msgpack, hashlib)
        return name, cast(bytes, body)

    def close(self) -> None:
        self.pipe.close()


async def connect(host: str, port: int, peer: PeerId, identity: Identity, data_key: bytes, counter: ByteCounter,
                  max_message: int, timeout: float = HELLO_TIMEOUT) -> Channel:
    """A data connection to `peer` at host:port, its handshake done; raises `TransportError` (a `DataRefused` when
    the other side is not `peer` or does not hold the run's key, or refused ours)."""
    pipe = await asyncio.wait_for(open_pipe(host, port), min(timeout, CONNECT_TIMEOUT))
    return await handshake(pipe, f"{host}:{port}", peer, identity, data_key, counter, max_message, timeout)


async def handshake(pipe: Pipe, where: str, peer: PeerId, identity: Identity, data_key: bytes, counter: ByteCounter,
                    max_message: int, timeout: float = HELLO_TIMEOUT) -> Channel:
    """The client's side of the handshake with `peer` on `pipe` (a connection to `where`: an address, or a relay's
    circuit); closes the pipe if it fails."""
    try:
        own = X25519PrivateKey.generate()
        hello = client_hello(_public(own), secrets.token_bytes(16), identity.peer_id)
        pipe.write(hello)
        head = await asyncio.wait_for(pipe.read_exactly(len(MAGIC) + 32 + 1), timeout)
        if head[:4] != MAGIC:
            raise DataRefused("data_malformed", f"{where} does not speak the data protocol")
        named = await asyncio.wait_for(pipe.read_exactly(head[-1] + 64 + 32), timeout)
        server = named[:head[-1]].decode(errors="replace")
        if server != peer:
            raise DataRefused("data_wrong_peer", f"{where} is {server[:60]}, not {peer}")
        t = transcript(hello, head[4:36], server)
        try:
            keys = Keys.derive(own, head[4:36], data_key, t)
        except ValueError:  # a low-order key: no peer sends one (a relay in the middle could)
            raise DataRefused("data_malformed", f"{where} sent an X25519 key that is not one") from None
        sig, proof = named[-96:-32], named[-32:]
        if not hmac.compare_digest(proof, keys.proof(b"S", t)) or not verify(server, _signed("server", t), sig):
            raise DataRefused("data_unauthorized", f"{peer} at {where} did not prove the run's key and its "
                                                   "identity (another swarm secret or run id?)")
        pipe.write(identity.sign(_signed("client", t)) + keys.proof(b"C", t))
        counter.add(peer, sent=len(hello) + 96, received=len(head) + len(named))
        return Channel(peer, pipe, Sealer(keys.client_to_server), Sealer(keys.server_to_client), counter,
                       max_message)
    except BaseException:
        pipe.close()
        raise


async def accept(pipe: Pipe, identity: Identity, data_key: bytes, allow: frozenset[str] | None, counter: ByteCounter,
                 max_message: int) -> Channel:
    """The server's side of the handshake (call under a deadline); raises `DataRefused` with the reason."""
    head = await pipe.read_exactly(len(MAGIC) + 32 + 16 + 1)
    if head[:4] != MAGIC or head[-1] == 0:
        raise DataRefused("data_malformed", "not a data-protocol hello")
    caller = (await pipe.read_exactly(head[-1])).decode(errors="replace")
    hello = head + caller.encode()
    own = X25519PrivateKey.generate()
    me = identity.peer_id.encode()
    t = transcript(hello, _public(own), identity.peer_id)
    try:
        keys = Keys.derive(own, head[4:36], data_key, t)
    except ValueError:
        raise DataRefused("data_malformed", "an X25519 key that is not one") from None
    pipe.write(MAGIC + _public(own) + bytes([len(me)]) + me + identity.sign(_signed("server", t)) +
                 keys.proof(b"S", t))
    finish = await pipe.read_exactly(96)
    if not hmac.compare_digest(finish[64:], keys.proof(b"C", t)):
        raise DataRefused("data_unauthorized", "the caller did not prove the run's key (no key, another secret or "
                                               "run id)")
    if not verify(caller, _signed("client", t), finish[:64]):
        raise DataRefused("data_unauthorized", f"the caller holds the run's key but did not prove it is {caller[:60]}")
    if allow is not None and caller not in allow:
        raise DataRefused("data_not_allowed", f"{caller[:60]} is not on the allowlist")
    peer = PeerId(caller)
    counter.add(peer, received=len(hello) + 96, sent=4 + 32 + 1 + len(me) + 96)
    return Channel(peer, pipe, Sealer(keys.server_to_client), Sealer(keys.client_to_server), counter,
                   max_message)


# ---------------------------------------------------------------------- the transport


def parse_address(text: str) -> tuple[str, int] | None:
    """`host:port` (an IPv6 host in brackets) as (host, port), or None when it is not one."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        return None
    return host.strip("[]"), int(port)


@dataclass
class DataConfig:
    """The data plane's settings (`SwarmConfig.data_port` and friends)."""

    host: str = "127.0.0.1"
    port: int = 0
    """Port to listen on (0: any free one)."""
    announce: str = ""
    """host:port to advertise, when others must dial another address than the one we listen on (NAT, a proxy)."""
    announce_host: str = ""
    """The host to advertise with the port we listen on ("": the listening host)."""
    streams: int = 8
    """Connections to one peer at most: calls to it in flight at once (a round's spans) use one each. 8: on an
    emulated 100 Mbit/s, 50 ms link a 2-peer round took 3.10 s with 1, 2.77 s with 4, 2.34 s with 8 and 2.33 s with
    16 (each connection's window starts small again after the idle inner steps); on loopback 1 to 8 made no
    difference (docs/BENCHMARKS.md, B3)."""
    retry_after: float = 30.0
    """Seconds a peer whose data port could not be reached is called through libp2p before it is tried again."""


@dataclass
class _Pool:
    """One member's data connections: those idle (kept for its next calls), the calls in flight (`slots`), and
    the address they go to."""

    idle: list[Channel] = field(default_factory=list)
    slots: asyncio.Semaphore | None = None
    address: tuple[str, int] | tuple[str, str] | None = None
    """host, port; or `RELAYED` for connections through relays."""


class DirectTransport:
    """A transport that calls members on their data ports (`Channel`s, `DataConfig.streams` a peer at most) and
    falls back to `inner` (libp2p) for a peer whose data address is unknown or unreachable, and for `inner_only`
    handlers (the join handshake). It serves its handlers on both. `address_of(peer)` reads a member's data address
    from its signed record."""

    def __init__(self, inner: Transport, identity: Identity, cfg: DataConfig, max_message: int,
                 inner_only: frozenset[str] = frozenset()) -> None:
        self.inner = inner
        self.peer_id: PeerId = inner.peer_id
        self.counter: ByteCounter = inner.counter  # one count of our bytes, whichever way they went
        self.identity = identity
        self.cfg = cfg
        self.max_message = max_message
        self.inner_only = inner_only
        self.address_of: Callable[[PeerId], str] = lambda peer: ""
        self.via_of: Callable[[PeerId], tuple[PeerId, ...]] = lambda peer: ()
        """The relays a member's record says it waits at (`comms/relay.py`): it is called through them."""
        self.relay: RelayService | None = None
        """What we do for members that wait at us or call through us (`relay.attach`; refuses all when not a relay)."""
        self.reach: Reach | None = None
        """Whether members can dial us, and our connections waiting at relays when they cannot."""
        self.address = ""
        """host:port our record advertises ("" until `start`)."""
        self.paths: dict[PeerId, str] = {}
        """How our last call to each peer went: direct, relay (through a relay it waits at), or libp2p (its data
        port unknown or unreachable, or its relays gone)."""
        self.fallbacks: Counter[str] = Counter()
        """Calls that went through libp2p because the data port could not be used, by why."""
        self._handlers: dict[str, Handler] = {}
        self._pools: dict[PeerId, _Pool] = {}
        self._unreachable: dict[PeerId, tuple[tuple[str, int], float]] = {}
        """Members whose data port could not be reached: at which address, and until when it is not tried again
        (a member that restarted on another port is tried there at once)."""
        self._server: asyncio.Server | None = None
        self._logged: set[tuple[str, str]] = set()
        self._serving: set[asyncio.Task[None]] = set()
        self._closed = False
        self._gate = StreamGate(GateConfig(), refused=inner.guard.refused if inner.guard is not None else None)
        """Handshakes in progress at the data port: the libp2p port's caps and deadline, counted with its cuts."""

    @property
    def guard(self) -> Guard | None:
        return self.inner.guard

    @guard.setter
    def guard(self, guard: Guard | None) -> None:
        self.inner.guard = guard
        if guard is not None:
            self._gate = StreamGate(GateConfig(), refused=guard.refused)

    async def start(self) -> str:
        """Listen on the data port; returns the address to advertise."""
        self._server = await serve_pipes(self.serve, self.cfg.host, self.cfg.port)
        host, port = self._server.sockets[0].getsockname()[:2]
        host = self.cfg.announce_host or host
        self.address = self.cfg.announce or (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        log.info("event=data_port address=%s", self.address)
        return self.address

    async def register(self, name: str, handler: Handler) -> None:
        self._handlers[name] = handler
        await self.inner.register(name, handler)

    # ------------------------------------------------------------------ calling

    async def call(self, peer: PeerId, name: str, payload: bytes, timeout: float) -> bytes:
        via = () if name in self.inner_only else self.via_of(peer)
        address = None if name in self.inner_only or via else parse_address(self.address_of(peer))
        why = "" if via or address is not None else "no_address"
        marked, until = self._unreachable.get(peer, (None, 0.0))
        if address is not None and marked == address and until > time.monotonic():
            why = "unreachable"
        elif via or address is not None:
            path = "relay" if via else "direct"
            try:
                if via:
                    return await asyncio.wait_for(self._through(peer, via, name, payload), timeout)
                assert address is not None
                return await asyncio.wait_for(self._direct(peer, address, name, payload), timeout)
            except asyncio.TimeoutError:
                raise CallTimedOut(f"call {name!r} to {peer} timed out after {timeout:.1f}s") from None
            except _NotConnected as e:
                why = "unreachable" if address is not None else "relay_failed"
                if address is not None:
                    self._unreachable[peer] = (address, time.monotonic() + self.cfg.retry_after)
                if self.paths.get(peer) != "libp2p":
                    log.warning("event=data_path peer=%s path=libp2p tried=%s reason=%s", peer, path, e)
        if name not in self.inner_only:
            self.fallbacks[why] += 1
            self.paths[peer] = "libp2p"
        return await self.inner.call(peer, name, payload, timeout)

    async def _through(self, peer: PeerId, via: tuple[PeerId, ...], name: str, payload: bytes) -> bytes:
        """A call to `peer` through the first of its relays that puts us through (ourselves first when we are one
        of them: its waiting connections here, no second hop)."""
        failed: list[str] = []
        for relay in sorted(via, key=lambda r: r != self.peer_id):
            try:
                return await self._direct(peer, RELAYED, name, payload, path="relay", through=relay)
            except _NotConnected as e:
                failed.append(str(e))
        raise _NotConnected("; ".join(failed) or "no relay")

    async def _direct(self, peer: PeerId, address: tuple[str, int] | tuple[str, str], name: str, payload: bytes,
                      path: str = "direct", through: PeerId | None = None) -> bytes:
        """A call on one of `peer`'s kept connections (to `address`, or `RELAYED` through the relay `through`: a
        connection through any relay is the two ends' own, so those through one relay serve when another is asked),
        else on a new one."""
        pool = self._pools.setdefault(peer, _Pool())
        if pool.slots is None:
            pool.slots = asyncio.Semaphore(max(1, self.cfg.streams))
        async with pool.slots:
            if pool.address != address:  # the member moved (restarted on another port, or now waits at relays):
                for stale in pool.idle:  # its old connections are gone
                    stale.close()
                pool.idle, pool.address = [], address
            channel = pool.idle.pop() if pool.idle else None
            while True:
                kept = channel is not None
                if channel is None:
                    channel = await (self._connect_via(peer, through) if through is not None
                                     else self.connect_to(peer, (address[0], int(address[1]))))
                try:
                    reply = await self._exchange(channel, name, payload)
                    break
                except (OSError, asyncio.IncompleteReadError) as e:
                    channel.close()
                    if not kept or (isinstance(e, asyncio.IncompleteReadError) and e.partial):
                        raise TransportError(f"call {name!r} to {peer} on its data port failed: "
                                             f"{type(e).__name__}: {e}") from None
                    channel = None  # a kept connection the member dropped while it idled (it restarted under the
                    # same id): once more, on a new one
                except BaseException:
                    channel.close()
                    raise
            pool.idle.append(channel)
        self.paths[peer] = path
        return reply

    @staticmethod
    async def _exchange(channel: Channel, name: str, payload: bytes) -> bytes:
        await channel.send(REQUEST, name, payload)
        _, reply = await channel.receive(REPLY)
        return reply

    async def connect_to(self, peer: PeerId, address: tuple[str, int]) -> Channel:
        """A data connection of our own to `peer` at `address` (`_NotConnected` when none could be made)."""
        guard = self.guard
        if guard is None:
            raise _NotConnected("no credential to open a data connection with")
        try:
            return await connect(address[0], address[1], peer, self.identity, guard.data_key, self.counter,
                                 self.max_message)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, TransportError) as e:
            raise _NotConnected(f"{address[0]}:{address[1]}: {type(e).__name__}: {e}") from None

    async def _connect_via(self, peer: PeerId, relay: PeerId) -> Channel:
        """A data connection to `peer` through `relay`, where it keeps connections waiting: the handshake is the two
        ends' own, the relay copies it (`comms/relay.py`). Through ourselves when we are that relay."""
        guard = self.guard
        if guard is None or self.relay is None:
            raise _NotConnected("no credential to open a data connection with, or no relays attached")
        try:
            if relay == self.peer_id:
                pipe = await self.relay.take(peer, self.peer_id)
                if pipe is None:
                    raise _NotConnected(f"{peer} keeps no connection waiting at us")
            else:
                pipe = await self.relay.through(await self.dial(relay), peer)
            return await handshake(pipe, f"relay {relay}", peer, self.identity, guard.data_key, self.counter,
                                   self.max_message)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, TransportError) as e:
            raise _NotConnected(f"through relay {relay}: {type(e).__name__}: {e}") from None

    async def dial(self, peer: PeerId) -> Channel:
        """A data connection of our own to `peer` at the address its record names (a relay: `comms/relay.py`)."""
        address = parse_address(self.address_of(peer))
        if address is None:
            raise _NotConnected(f"{peer} names no data address")
        return await self.connect_to(peer, address)

    # ------------------------------------------------------------------ serving

    async def serve(self, pipe: Pipe, caller: str = "") -> None:
        """Serve a connection whose next bytes are a member's data handshake: one that came to our data port, or one
        of ours a relay put a caller through (`comms/relay.py`; `caller` then names the relay in refusals)."""
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        if not caller:
            where = pipe.peername()
            caller = f"data:{where[0] if where else '?'}"
        guard = self.guard
        try:
            if guard is None or self._closed:  # (a connection accepted while we closed: its task began after
                return  # close() cancelled those it found)
            try:
                with self._gate.opening(caller):
                    channel = await asyncio.wait_for(
                        accept(pipe, self.identity, guard.data_key, guard.allow, self.counter,
                               self.max_message), HELLO_TIMEOUT)
            except asyncio.TimeoutError:
                self._gate.cut("slow_head", caller, f"no handshake within {HELLO_TIMEOUT:g} s")
                return
            # until we close: close() cancels this task, but a cancellation that lands as the handshake ends is dropped
            # by wait_for (CPython < 3.12), and a relay's waiting member would then wait on a closed relay for good
            while not self._closed:
                try:
                    name, request = await channel.receive(REQUEST)
                except asyncio.IncompleteReadError:
                    return  # the caller closed the connection
                if self.relay is not None and name in self.relay.names:
                    return await self.relay.serve(channel, name, request)  # the relay owns the connection now
                handler = self._handlers.get(name)
                if handler is None:
                    raise DataRefused("data_malformed", f"no handler {name[:60]!r}")
                reply = await handler(channel.peer, request)
                await channel.send(REPLY, name, reply)
        except DataRefused as e:
            self.refused(e.reason, caller, str(e))
            if e.reason == "data_unauthorized" and guard is not None:
                await guard.tarpit.refused(caller)  # a caller that keeps trying waits, its connection unread
        except (Cut, OSError, asyncio.IncompleteReadError):
            pass  # the gate counted its cut; a connection reset or cut short has nothing more to tell
        except asyncio.CancelledError:
            pass  # shutting down
        except Exception as e:  # noqa: BLE001 - a handler's failure ends this connection, never the peer
            log.warning("event=data_call_failed peer=%s reason=%s: %s", caller, type(e).__name__, e)
        finally:
            self._serving.discard(task)
            pipe.close()

    def refused(self, reason: str, caller: str, detail: str) -> None:
        """Count a refusal; log it once per caller and reason (a flood logs one line per address)."""
        guard = self.guard
        if guard is not None:
            guard.refused[reason] += 1
        if (caller, reason) not in self._logged and len(self._logged) < 10_000:
            self._logged.add((caller, reason))
            log.warning("event=call_refused reason=%s peer=%s detail=%s", reason, caller, detail)

    async def close(self) -> None:
        self._closed = True
        if self.reach is not None:
            self.reach.close()
        for pool in self._pools.values():
            for channel in pool.idle:
                channel.close()
        if self._server is not None:
            self._server.close()
            for task in list(self._serving):
                task.cancel()
            with suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        await self.inner.close()


class _NotConnected(TransportError):
    """No data connection could be opened (nothing was sent): the call may go through libp2p instead."""


def data_paths(transport: Transport) -> dict[str, list[PeerId]]:
    """The peers `transport`'s last call reached on their data port ("direct"), through a relay ("relay") and through
    libp2p ("libp2p"); {} without a data plane."""
    paths = transport.paths if isinstance(transport, DirectTransport) else {}
    return {how: sorted(p for p, used in paths.items() if used == how) for how in sorted(set(paths.values()))}


def relay_stats(transport: Transport) -> dict[str, object]:
    """What this peer did as a relay (circuits put through, bytes each member sent through it, the seconds its rate
    cap held each back) and where it waits itself; {} without a data plane."""
    t = transport
    if not isinstance(t, DirectTransport) or t.relay is None or t.reach is None:
        return {}
    out: dict[str, object] = {"via": list(t.reach.via), "reachable": t.reach.reachable,
                              "served_through": dict(t.reach.served)}
    if t.relay.cfg.serve:
        out.update(t.relay.stats())
    return out


__all__ = ["DataConfig", "DataRefused", "DirectTransport", "Channel", "connect", "accept", "parse_address", "REASONS",
           "data_paths", "relay_stats"]
