"""One call's bytes over iroh (QUIC, the transport Psyche uses) between two endpoints of one process on loopback,
against the same bytes over plain TCP (asyncio streams), to compare with the data plane's own call
(`diloco.bench.transport.direct_copy`). Not part of the package: iroh is not a dependency. Run it in a virtual
environment of its own:

    python -m venv /tmp/iroh && /tmp/iroh/bin/pip install iroh==1.2.0
    /tmp/iroh/bin/python benchmarks/iroh_copy.py 1 10 100      # sizes in MB; prints one JSON line per size

Each figure is the median of 3 calls: the sender writes the payload on a stream opened on a connection made once,
the receiver reads all of it and answers 2 bytes (as a data-plane call answers), the sender reads the answer.
iroh's relays and discovery are off (preset_minimal, RelayMode.disabled): the endpoints dial each other's
loopback address directly, which is all this measures.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

ALPN = b"diloco/copy/1"
CHUNK = 1 << 20


async def iroh_copy(nbytes: int, repeats: int = 3) -> float:
    import iroh

    def options() -> iroh.EndpointOptions:
        return iroh.EndpointOptions(preset=iroh.preset_minimal(), bind_addr="127.0.0.1:0", alpns=[ALPN],
                                    relay_mode=iroh.RelayMode.disabled())

    server = await iroh.Endpoint.bind(options())
    client = await iroh.Endpoint.bind(options())
    payload = bytes(nbytes)

    async def serve() -> None:
        incoming = await server.accept_next()
        assert incoming is not None
        conn = await (await incoming.accept()).connect()
        for _ in range(repeats):
            stream = await conn.accept_bi()
            await stream.recv().read_exact(nbytes)
            await stream.send().write_all(b"ok")
            await stream.send().finish()
        await conn.closed()

    serving = asyncio.create_task(serve())
    conn = await client.connect(server.addr(), ALPN)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        stream = await conn.open_bi()
        send = stream.send()
        for i in range(0, nbytes, CHUNK):
            await send.write_all(payload[i:i + CHUNK])
        await send.finish()
        assert await stream.recv().read_exact(2) == b"ok"
        seconds.append(time.perf_counter() - started)
    conn.close(0, b"done")
    await asyncio.wait([serving], timeout=5)
    await client.close()
    await server.close()
    return statistics.median(seconds)


async def tcp_copy(nbytes: int, repeats: int = 3) -> float:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(repeats):
            await reader.readexactly(nbytes)
            writer.write(b"ok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = memoryview(bytes(nbytes))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        for i in range(0, nbytes, CHUNK):
            writer.write(payload[i:i + CHUNK])
            await writer.drain()
        assert await reader.readexactly(2) == b"ok"
        seconds.append(time.perf_counter() - started)
    writer.close()
    server.close()
    return statistics.median(seconds)


def main(sizes_mb: list[float]) -> None:
    for mb in sizes_mb:
        n = int(mb * 1e6)
        print(json.dumps({"mb": mb, "iroh_s": round(asyncio.run(iroh_copy(n)), 4),
                          "asyncio_tcp_s": round(asyncio.run(tcp_copy(n)), 4)}), flush=True)


if __name__ == "__main__":
    main([float(x) for x in sys.argv[1:]] or [1.0, 10.0, 100.0])
