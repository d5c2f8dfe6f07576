"""The real transport: hivemind's libp2p daemon (p2pd), one stream per call.

Each call opens a libp2p stream to the peer's named handler, writes one length-prefixed request,
reads one length-prefixed reply, and closes the stream. libp2p encrypts the connection and
authenticates the remote peer id (`StreamInfo.peer_id`), which is what handlers receive as the
caller. Large payloads are fine: the stream is raw bytes, not a size-limited unary protobuf.

The daemon runs without libp2p's own DHT (which would tell anyone who dials us every member's id
and address) and relays nothing for others: it dials the peers it joined through, those that dial
it, and those the directory introduces (`introduce.py`). Its socket files live in the temp directory
(`$TMPDIR`, else /tmp) and are removed when we close, also when the daemon died first or never
finished starting.

Failure semantics: every call has a timeout; an unreachable, dead or slow peer surfaces as
`TransportError`, never as a hang. A served stream must deliver its length prefix and first 56
bytes within the stream gate's bounds (`streamgate.py`: a deadline and caps for callers not yet
known), else it is closed unread. A request larger than `max_message` is refused before it is
read into memory. With a `Guard` (the swarm's credential, `auth.py`) a request's first 56 bytes
(envelope head and tag) are checked before anything else: a caller without the key is answered
with a 56-byte refusal and its stream closed, its body never read; one that keeps trying waits for
its refusals (`tarpit.py`). Streams still open when we shut down end quietly. The daemon is a child
process: `diloco.peers.reaper` makes sure it dies with us even when we are SIGKILLed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import tempfile
from contextlib import contextmanager, nullcontext, suppress
from typing import Any, Iterable, Iterator, Literal, Sequence

from hivemind.p2p import P2P, PeerID

from .auth import HEAD_SIZE, MAC_SIZE, Guard, Refusal
from .fdlimit import raise_open_files_limit
from .identity import Identity
from .streamgate import Cut, StreamGate
from .transport import ByteCounter, CallTimedOut, Handler, PeerId, TransportError

log = logging.getLogger(__name__)

_LEN = 8  # bytes of the length prefix, as hivemind's P2P.send_raw_data writes it
_BYTEORDER: Literal["big"] = "big"


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    await P2P.send_raw_data(data, writer, chunk_size=1 << 20)


async def _prefix(reader: asyncio.StreamReader) -> int:
    return int.from_bytes(await reader.readexactly(_LEN), _BYTEORDER)


def _within(length: int, max_message: int) -> int:
    if length > max_message:
        raise TransportError(f"message of {length} bytes exceeds the limit of {max_message} bytes")
    return length


async def _receive(reader: asyncio.StreamReader, max_message: int) -> bytes:
    return await reader.readexactly(_within(await _prefix(reader), max_message))


async def _head(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The length prefix, and the first bytes of the message (its envelope head, if it is that long)."""
    length = await _prefix(reader)
    return length, await reader.readexactly(min(length, HEAD_SIZE))


class _Daemon(P2P):  # type: ignore[misc]  # hivemind ships no type information
    """hivemind's P2P with its socket files in the temp directory (`$TMPDIR`, else /tmp), not always /tmp,
    and a daemon that may run without libp2p's DHT (`dht_mode="off"`)."""

    DHT_MODE_MAPPING = {**P2P.DHT_MODE_MAPPING, "off": {}}

    @classmethod
    def use_temp_dir(cls) -> None:
        cls._UNIX_SOCKET_PREFIX = f"/unix{tempfile.gettempdir()}/hivemind-"


def _unix_path(maddr: str) -> str | None:
    """The file of a `/unix/...` multiaddr (how hivemind names the daemon's control socket), else None."""
    return maddr[len("/unix"):] if maddr.startswith("/unix/") else None


def _listen_path(args: Sequence[str]) -> str | None:
    """The control socket file a p2pd command line (`-listen=/unix/tmp/…sock`) makes the daemon create."""
    return next((_unix_path(a.split("=", 1)[1]) for a in args if a.startswith("-listen=")), None)


def _remove(paths: Iterable[str | None]) -> None:
    for path in paths:
        if path:
            with suppress(FileNotFoundError):
                os.remove(path)


DAEMON_ENV = {"LIBP2P_TCP_REUSEPORT": "false"}
"""The daemon dials from a port of its own for each connection, not from its listening port (libp2p's default, for
NAT hole punching, which we do not do). With the listening port, a member dialing a peer that takes no inbound
connection (its SYNs dropped: the socket waits in SYN_SENT, retrying) and that peer dialing the member back use the
same address pair: TCP opens one connection both ways, both daemons act as its dialer, and the security handshake
fails ("noise: message is too short"), again at every retry while the member's own dial waits. The peer behind the
NAT stayed unreachable from that member, whose rounds then closed other views than the others'
(tests/test_multiproc.py, `no_inbound`; tests/test_discovery.py checks the port)."""


Spawned = list[tuple[asyncio.subprocess.Process, list[str]]]
_STARTING: contextvars.ContextVar[Spawned | None] = contextvars.ContextVar("diloco_p2pd_starting", default=None)
_REAL_EXEC = asyncio.subprocess.create_subprocess_exec


async def _exec(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
    """asyncio's `create_subprocess_exec`, except for a p2pd started inside `_daemon_in_own_session` (in the context
    that entered it, and the tasks that context starts, which keep it): that one gets a session of its own and
    `DAEMON_ENV`."""
    spawned = _STARTING.get()
    if spawned is None or not args or os.path.basename(str(args[0])) != "p2pd":
        return await _REAL_EXEC(*args, **kwargs)
    env = {**(kwargs.get("env") or os.environ), **DAEMON_ENV}
    proc = await _REAL_EXEC(*args, **{**kwargs, "start_new_session": True, "env": env})
    spawned.append((proc, [str(a) for a in args]))
    return proc


@contextmanager
def _daemon_in_own_session() -> Iterator[Spawned]:
    """Start hivemind's p2pd in a session of its own, with `DAEMON_ENV`. Ctrl-C in a terminal sends SIGINT to the
    whole foreground process group, and p2pd installs its own SIGINT handler and exits at once, so the peer
    could not announce that it leaves; in its own session only we stop it (and our reaper, if we die).
    hivemind offers no hook for this: asyncio's subprocess call is wrapped (once, for good: `_exec`), and the
    wrapper applies only in the context that entered this block. Swapping the function in and out around each
    start instead raced between threads starting daemons at once (one could restore another's wrapper for good)
    and changed every other subprocess started meanwhile. Yields the list of daemons started, so a start that
    fails can clean up after them."""
    if asyncio.subprocess.create_subprocess_exec is not _exec:
        asyncio.subprocess.create_subprocess_exec = _exec
    spawned: Spawned = []
    token = _STARTING.set(spawned)
    try:
        yield spawned
    finally:
        _STARTING.reset(token)


async def _cleanup_failed_start(spawned: Spawned) -> None:
    """hivemind's P2P.create leaves its daemon's control socket behind when the daemon exits during
    start-up (a bootstrap address that does not answer makes p2pd exit before Python is told), and a
    daemon behind if a later start-up step fails: stop what it started and remove the socket."""
    for proc, args in spawned:
        if proc.returncode is None:
            with suppress(ProcessLookupError):
                proc.terminate()
            with suppress(Exception):
                await asyncio.wait_for(proc.wait(), 5)
        _remove([_listen_path(args)])


class P2PTransport:
    """A `Transport` over a hivemind `P2P` instance (create it with `await P2PTransport.create()`)."""

    def __init__(self, p2p: P2P, max_message: int) -> None:
        self.p2p = p2p
        self.peer_id = PeerId(p2p.peer_id.to_base58())
        self.counter = ByteCounter()
        self.max_message = max_message
        self.guard: Guard | None = None
        self._gate = StreamGate()

    @classmethod
    async def create(
        cls,
        *,
        initial_peers: list[str] | None = None,
        host_maddrs: list[str] | None = None,
        announce_maddrs: list[str] | None = None,
        max_message: int = 1 << 30,
        identity: Identity | None = None,
    ) -> P2PTransport:
        """`identity`: the key the daemon runs under (one we can sign with); None lets the daemon make one.
        Raises this process's soft open-files limit to the hard one first (the daemon inherits it)."""
        raise_open_files_limit()
        with _daemon_in_own_session() as spawned, \
                (identity.key_file() if identity else nullcontext(None)) as key_path:
            _Daemon.use_temp_dir()
            try:
                p2p = await _Daemon.create(
                    initial_peers=initial_peers or None,
                    host_maddrs=host_maddrs or ["/ip4/127.0.0.1/tcp/0"],
                    announce_maddrs=announce_maddrs or None,
                    identity_path=key_path,
                    # probing the swarm for our id would start a second daemon; a kept key file is locked instead
                    check_if_identity_free=False,
                    # A LAN/WAN swarm of explicitly addressed peers: no IPFS, no NAT port mapping probes.
                    nat_port_map=False,
                    auto_nat=False,
                    # No libp2p DHT: it told anyone who dialed us every member's id and address. Members find
                    # each other's addresses in their signed directory records instead (introduce.py).
                    dht_mode="off",
                    # Nor do we relay connections for others (a stranger could use us as a relay).
                    use_relay=False,
                    startup_timeout=30,
                )
            except BaseException:
                await _cleanup_failed_start(spawned)
                raise
        transport = cls(p2p, max_message)
        if identity is not None and transport.peer_id != identity.peer_id:
            await transport.close()
            raise RuntimeError(f"the p2p daemon runs as {transport.peer_id}, not as our key's {identity.peer_id}")
        return transport

    @property
    def daemon_pid(self) -> int | None:
        child = getattr(self.p2p, "_child", None)
        return child.pid if child is not None else None

    @property
    def socket_paths(self) -> list[str]:
        """The unix sockets the daemon and client use; left behind if we are SIGKILLed."""
        paths: list[str] = []
        for attr in ("_daemon_listen_maddr", "_client_listen_maddr"):
            maddr: Any = getattr(self.p2p, attr, None)
            with suppress(Exception):
                paths.append(str(maddr["unix"]))
        return paths

    def watched_by(self, reaper: Any) -> None:
        """Have `reaper` (a `diloco.peers.reaper.Reaper`) take the daemon and its sockets down with this process,
        however it ends."""
        if self.daemon_pid:
            reaper.watch_pid(self.daemon_pid)
        for path in self.socket_paths:
            reaper.watch_file(path)

    async def visible_addresses(self) -> list[str]:
        return [str(m) for m in await self.p2p.get_visible_maddrs()]

    @property
    def gate(self) -> StreamGate:
        """What bounds streams waiting for their first bytes: the guard's (its counters are the refusal
        counters), or, without a guard, the transport's own."""
        return self.guard.gate if self.guard is not None else self._gate

    async def register(self, name: str, handler: Handler) -> None:
        async def serve(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            caller = PeerId(info.peer_id.to_base58())
            try:
                length, head = await self._first_bytes(caller, reader)
                self.counter.add(caller, received=len(head) + _LEN)
                if self.guard is None:
                    request = head + await reader.readexactly(_within(length, self.max_message) - len(head))
                    self.counter.add(caller, received=len(request) - len(head))
                    reply = await handler(caller, request)
                else:
                    reply = await self._serve_guarded(self.guard, name, caller, length, head, reader, handler)
                await _send(writer, reply)
                self.counter.add(caller, sent=len(reply) + _LEN)
            except (TransportError, Cut, asyncio.IncompleteReadError, ConnectionError) as e:
                log.debug("event=stream_dropped handler=%s peer=%s reason=%s", name, caller, e)
            except asyncio.CancelledError:
                # We are shutting down (a refusal the tarpit holds, a handler mid-call). Nobody awaits this
                # task but asyncio's stream callback, which logs a cancelled one with a traceback: end quietly.
                log.debug("event=stream_dropped handler=%s peer=%s reason=shutting down", name, caller)
            finally:
                writer.close()

        await self.p2p.add_binary_stream_handler(name, serve)

    async def _first_bytes(self, caller: PeerId, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        """A request's declared length and its first (up to HEAD_SIZE) bytes, read within the gate's
        bounds (`streamgate.py`); raises `Cut` when the stream must be closed instead."""
        gate = self.gate
        with gate.opening(caller) as seconds:
            try:
                return await asyncio.wait_for(_head(reader), seconds)
            except asyncio.TimeoutError:
                raise gate.cut("slow_head", caller, f"no length prefix and head within {seconds:g} s") from None

    async def _serve_guarded(self, guard: Guard, name: str, caller: PeerId, length: int, head: bytes,
                             reader: asyncio.StreamReader, handler: Handler) -> bytes:
        """Refuse a caller without the key at its head (held if it keeps trying: `tarpit.py`); only then
        look at the declared length, read and open the rest."""
        try:
            body_len = guard.check_head(name, caller, head)
        except Refusal as r:
            await guard.tarpit.refused(caller)
            return r.reply
        guard.gate.passed(caller)
        _within(length, self.max_message)
        try:
            if length != HEAD_SIZE + body_len + MAC_SIZE:
                raise guard.refuse("malformed", caller, f"envelope declares {body_len} body bytes in {length}")
            rest = await reader.readexactly(length - HEAD_SIZE)
            self.counter.add(caller, received=len(rest))
            body, seal = guard.open_body(name, caller, head, rest, body_len)
        except Refusal as r:
            return r.reply
        return seal(await handler(caller, bytes(body)))

    async def call(self, peer: PeerId, name: str, payload: bytes, timeout: float) -> bytes:
        if self.guard is None:
            return await self._call(peer, name, payload, timeout)
        return await self.guard.call(name, peer, payload, lambda data: self._call(peer, name, data, timeout))

    async def _call(self, peer: PeerId, name: str, payload: bytes, timeout: float) -> bytes:
        async def exchange() -> bytes:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), name)
            try:
                await _send(writer, payload)
                self.counter.add(peer, sent=len(payload) + _LEN)
                reply = await _receive(reader, self.max_message)
                self.counter.add(peer, received=len(reply) + _LEN)
                return reply
            finally:
                writer.close()

        try:
            return await asyncio.wait_for(exchange(), timeout)
        except asyncio.TimeoutError as e:
            raise CallTimedOut(f"call {name!r} to {peer} timed out after {timeout:.1f}s") from e
        except TransportError:
            raise
        except Exception as e:  # p2pd control errors, resets, refused dials: all mean "unreachable"
            raise TransportError(f"call {name!r} to {peer} failed: {type(e).__name__}: {e}") from e

    async def close(self) -> None:
        """Stop the daemon and remove both socket files (hivemind removes the daemon's only while the
        daemon still runs: one that died before us would leave its socket in /tmp)."""
        with suppress(Exception):
            await asyncio.wait_for(self.p2p.shutdown(), 10)
        _remove(self.socket_paths)
