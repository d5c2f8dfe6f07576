"""comms/pipe.py on real TCP connections on 127.0.0.1: reads land in the reader's buffer, flow control holds a
connection that is not read, and a connection that ends mid-read says so."""

from __future__ import annotations

import asyncio

import pytest

from diloco.comms import pipe as pp

pytestmark = pytest.mark.unit


async def _pair() -> tuple[pp.Pipe, pp.Pipe, asyncio.Server]:
    served: asyncio.Future[pp.Pipe] = asyncio.get_running_loop().create_future()

    async def on_open(p: pp.Pipe) -> None:
        served.set_result(p)

    server = await pp.serve_pipes(on_open, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = await pp.open_pipe("127.0.0.1", port)
    return client, await asyncio.wait_for(served, 5), server


def test_bytes_arrive_in_order_into_the_readers_own_buffer_across_small_and_bulk_reads():
    async def main() -> None:
        client, server_side, server = await _pair()
        data = bytes(range(256)) * 40_000  # 10 MB
        client.write(b"head" + data)
        assert await server_side.read_exactly(4) == b"head"
        got = bytearray(len(data))
        await server_side.read_into(memoryview(got))
        assert got == data
        server_side.write(b"ok")
        await server_side.drain()
        assert await client.read_exactly(2) == b"ok"
        client.close(), server_side.close(), server.close()
    asyncio.run(main())


def test_a_connection_nobody_reads_stops_reading_past_its_mark_and_reads_again_when_a_reader_comes():
    async def main() -> None:
        client, server_side, server = await _pair()
        data = bytes(32 << 20)  # more than loopback's socket buffers take (tcp_rmem + tcp_wmem, ~10 MB at most)
        client.write(data)
        await asyncio.sleep(0.3)  # the sender goes on while the kernel's buffers take it; we hold at most the mark
        assert len(server_side.pending) <= pp.HIGH + pp.SCRATCH
        assert client.buffered() > 0  # TCP holds the rest back: the sender is not drained
        got = bytearray(len(data))
        await asyncio.wait_for(server_side.read_into(memoryview(got)), 10)
        assert got == data
        client.close(), server_side.close(), server.close()
    asyncio.run(main())


def test_a_connection_that_ends_mid_read_raises_with_what_came_and_a_cancelled_read_leaves_the_pipe_usable():
    async def main() -> None:
        client, server_side, server = await _pair()
        buf = bytearray(100)
        reading = asyncio.create_task(server_side.read_into(memoryview(buf)))
        await asyncio.sleep(0.05)
        reading.cancel()  # a deadline: the next read starts clean, nothing is lost
        with pytest.raises(asyncio.CancelledError):
            await reading
        client.write(b"x" * 10)
        assert await asyncio.wait_for(server_side.read_exactly(10), 5) == b"x" * 10
        client.write(b"y" * 30)
        client.transport.write_eof()  # the caller shuts its side after 30 of 100 bytes
        with pytest.raises(asyncio.IncompleteReadError) as cut:
            await asyncio.wait_for(server_side.read_into(memoryview(buf)), 5)
        assert cut.value.partial == b"y" * 30 and cut.value.expected == 100
        server_side.write(b"reply")  # its side shut, ours still sends (a reply to a request sent whole)
        await server_side.drain()
        assert await asyncio.wait_for(client.read_exactly(5), 5) == b"reply"
        client.close(), server_side.close(), server.close()
    asyncio.run(main())


def test_drain_after_the_other_side_closed_raises_and_a_cancelled_drain_does_not_release_the_others():
    async def main() -> None:
        client, server_side, server = await _pair()
        client.transport.set_write_buffer_limits(high=1, low=0)
        client.write(bytes(64 << 20))  # far more than the kernel takes while nobody reads
        waiters = [asyncio.create_task(client.drain()) for _ in range(2)]
        await asyncio.sleep(0.1)
        waiters[0].cancel()
        await asyncio.sleep(0.1)
        assert not waiters[1].done()  # still waits for the buffer, not released by the other's cancellation
        server_side.close()  # the reader goes away: the writer's drain ends with an error, not a hang
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(waiters[1], 5)
        with pytest.raises(ConnectionError):
            await client.drain()
        client.close(), server.close()
    asyncio.run(main())
