"""A TCP connection whose bulk reads land in the reader's own buffer: the kernel's copy is the only one.

asyncio's streams read every byte into a `bytes` of their own, append it to a buffer, and copy it out again for
`readexactly` (three copies and an allocation per chunk, and a wake-up per 256 KiB). The data plane knows each
record's length before it reads it (`comms/dataplane.py`), so `Pipe.read_into(view)` hands the kernel `view`
itself (`asyncio.BufferedProtocol`): the socket's bytes go straight into the record's buffer. Small reads (the
handshake, a record's length) come through a scratch buffer (`read_exactly`). Writes go through the transport
(`write`, `drain`), which sends at once what the socket takes and keeps the rest.

Flow control: bytes that arrive while nobody reads wait in `pending`, and past `HIGH` of them the connection stops
reading until a reader comes (a caller that sends while we do not read is held back by TCP, not by our memory).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Callable

SCRATCH = 1 << 16
"""Bytes one read takes when no `read_into` is waiting (allocated at the first byte that arrives)."""
HIGH = 1 << 17
"""Bytes held unread before the connection stops reading (what asyncio's streams held: a stranger's connection
that is not read, one the tarpit holds, pins at most this and `SCRATCH`)."""


class Pipe(asyncio.BufferedProtocol):
    """One TCP connection for one reader and one writer at a time. `on_open(pipe)` (a server's) runs as a task once
    the connection is made."""

    def __init__(self, on_open: Callable[[Pipe], Any] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending = bytearray()
        """Bytes received and not read yet."""
        self._on_open = on_open
        self._scratch: bytearray | None = None
        self._into: memoryview | None = None  # a read_into in progress: where the kernel writes next
        self._filled = 0
        self._wake: asyncio.Future[None] | None = None
        self._eof = False
        self._paused = False
        self._writable: asyncio.Future[None] | None = None  # set while the transport's buffer is over its mark
        self._ended: asyncio.Future[None] | None = None  # `ended()`'s waiters
        self.task: asyncio.Task[Any] | None = None
        """`on_open`'s task: held here, since the loop keeps only a weak reference to a task."""

    # ------------------------------------------------------------------ the protocol (asyncio calls these)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self._on_open is not None:
            self.task = asyncio.get_running_loop().create_task(self._on_open(self))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._into is not None:
            return self._into[self._filled:]
        if self._scratch is None:
            self._scratch = bytearray(SCRATCH)
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self._into is not None:
            self._filled += nbytes
            if self._filled == self._into.nbytes:
                self._wakeup()
            return
        assert self._scratch is not None
        self.pending += memoryview(self._scratch)[:nbytes]
        self._wakeup()
        if len(self.pending) > HIGH and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wakeup()
        self._end()
        return True  # a caller that shut its side down after its request still gets the reply

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._wakeup()
        self._end()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)  # `drain` sees the closed transport and raises

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def _end(self) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    async def ended(self) -> None:
        """Until the other side closed the connection (or it broke, or we closed it), without reading from it."""
        if self._eof:
            return
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._ended)

    # ------------------------------------------------------------------ reading

    def _wakeup(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _wait(self) -> None:
        """Until more bytes came (or the connection ended)."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._wake = asyncio.get_running_loop().create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    async def read_exactly(self, n: int) -> bytes:
        """The next `n` bytes; raises `asyncio.IncompleteReadError` (with what came) if the connection ends first."""
        while len(self.pending) < n:
            if self._eof:
                raise asyncio.IncompleteReadError(bytes(self.pending), n)
            await self._wait()
        out = bytes(self.pending[:n])
        del self.pending[:n]
        return out

    async def read_some(self, n: int) -> bytes:
        """What came, at most `n` bytes, as soon as anything did; b"" once the connection ended (a relay's copy of a
        connection's bytes, `comms/relay.py`)."""
        while not self.pending:
            if self._eof:
                return b""
            await self._wait()
        out = bytes(self.pending[:n])
        del self.pending[:n]
        return out

    async def read_into(self, view: memoryview) -> None:
        """Fill `view` (bytes) with the next `view.nbytes` bytes, the kernel writing into it; raises
        `asyncio.IncompleteReadError` if the connection ends first."""
        take = min(len(self.pending), view.nbytes)
        if take:
            view[:take] = memoryview(self.pending)[:take]
            del self.pending[:take]
        if take == view.nbytes:
            return
        self._into, self._filled = view, take
        try:
            while self._filled < view.nbytes:
                if self._eof:
                    raise asyncio.IncompleteReadError(bytes(view[:self._filled]), view.nbytes)
                await self._wait()
        finally:
            self._into = None

    # ------------------------------------------------------------------ writing

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send `data`, which must not change afterwards: the transport sends what the socket takes now and keeps
        the rest (Python 3.12 and later keep the caller's buffer itself, earlier ones a copy)."""
        assert self.transport is not None
        self.transport.write(data)

    def buffered(self) -> int:
        """Bytes written and not sent yet."""
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    async def drain(self) -> None:
        """Until the transport's buffer is below its mark; raises `ConnectionResetError` on a closed connection."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the data connection is closed")
        if self._writable is not None and not self._writable.done():
            await asyncio.shield(self._writable)  # a waiter cancelled does not cancel the others' wait
            if self.transport.is_closing():
                raise ConnectionResetError("the data connection is closed")

    def keep_alive(self, idle: int = 20) -> None:
        """TCP keepalive probes after `idle` quiet seconds: a connection that waits long with nothing to send (one kept
        at a relay) stays in the NATs and firewalls on its way, and a dead other side is noticed."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)

    def peername(self) -> Any:
        return self.transport.get_extra_info("peername") if self.transport is not None else None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close at once, dropping what is still queued to send (a relay's circuit that ended: nobody waits for it)."""
        if self.transport is not None:
            self.transport.abort()

    @property
    def ended_already(self) -> bool:
        """Whether the other side closed the connection (or it broke, or we closed it)."""
        return self._eof or self.transport is None or self.transport.is_closing()


async def open_pipe(host: str, port: int) -> Pipe:
    """A connection to host:port."""
    _, pipe = await asyncio.get_running_loop().create_connection(Pipe, host, port)
    return pipe


async def serve_pipes(on_open: Callable[[Pipe], Any], host: str, port: int) -> asyncio.Server:
    """A server on host:port whose every connection runs `on_open(pipe)` as a task."""
    return await asyncio.get_running_loop().create_server(lambda: Pipe(on_open), host, port)
