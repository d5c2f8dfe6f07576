"""The direct data plane (comms/dataplane.py) on real TCP connections on 127.0.0.1: calls between members go
direct, a peer whose data port cannot be reached is called through the fallback transport, and everything a
stranger or a broken peer can send at the data port is refused, counted, and never reaches a handler."""

from __future__ import annotations

import asyncio
import secrets
import socket
import struct

import pytest

from diloco.bench.flood import stranger_handshake
from diloco.comms import dataplane as dp
from diloco.comms.auth import Guard
from diloco.comms.identity import Identity
from diloco.comms.transport import InProcNetwork, PeerId, TransportError

pytestmark = pytest.mark.unit

SECRET = "s" * 32
RUN = "run"


class Pair:
    """Two members A and B, each a DirectTransport over an in-process fallback; B serves "echo" (its calls are
    recorded) and A knows B's data address."""

    def __init__(self, secret_a: str = SECRET, run_a: str = RUN, allow: frozenset[str] | None = None) -> None:
        self.net = InProcNetwork()
        self.ida, self.idb = Identity.generate(), Identity.generate()
        self.a = dp.DirectTransport(self.net.transport(self.ida.peer_id), self.ida, dp.DataConfig(), 64 << 20)
        self.b = dp.DirectTransport(self.net.transport(self.idb.peer_id), self.idb, dp.DataConfig(), 64 << 20)
        self.a.guard = Guard(secret_a, run_a, PeerId(self.ida.peer_id))
        self.b.guard = Guard(SECRET, RUN, PeerId(self.idb.peer_id), allow)
        self.calls: list[tuple[str, int]] = []

    async def __aenter__(self) -> Pair:
        async def echo(caller: PeerId, data: bytes) -> bytes:
            self.calls.append((caller, len(data)))
            return data[::-1]

        await self.b.register("echo", echo)
        await self.a.start()
        address = await self.b.start()
        self.a.address_of = lambda peer: address if peer == self.idb.peer_id else ""
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.a.close()
        await self.b.close()

    @property
    def port(self) -> int:
        parsed = dp.parse_address(self.b.address)
        assert parsed is not None
        return parsed[1]

    def refused(self) -> dict[str, int]:
        guard = self.b.guard
        assert guard is not None
        return {k: v for k, v in guard.refused.items() if v}


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.parametrize("size", [0, 1, dp.RECORD - 20, dp.RECORD, 3 * dp.RECORD + 5])
def test_a_call_goes_direct_and_its_reply_comes_back_whole(size: int) -> None:
    async def main() -> None:
        async with Pair() as p:
            payload = secrets.token_bytes(size)
            for _ in range(3):  # the connection is kept and reused
                assert await p.a.call(PeerId(p.idb.peer_id), "echo", payload, 10) == payload[::-1]
            assert p.a.paths[PeerId(p.idb.peer_id)] == "direct" and not p.a.fallbacks
            assert p.calls == [(p.ida.peer_id, size)] * 3  # the caller is the id its handshake proved
            sent, received = p.a.counter.snapshot()
            assert sent >= 3 * size and received >= 3 * size
            assert len(p.a._pools[PeerId(p.idb.peer_id)].idle) == 1

    run(main())


def test_calls_in_flight_at_once_use_as_many_connections_up_to_the_cap() -> None:
    async def main() -> None:
        async with Pair() as p:
            gate = asyncio.Event()

            async def slow(caller: PeerId, data: bytes) -> bytes:
                await gate.wait()
                return data

            await p.b.register("slow", slow)
            n = dp.DataConfig().streams + 2  # more calls at once than the cap
            calls = [asyncio.ensure_future(p.a.call(PeerId(p.idb.peer_id), "slow", bytes([i]), 10)) for i in range(n)]
            await asyncio.sleep(0.3)
            gate.set()
            assert await asyncio.gather(*calls) == [bytes([i]) for i in range(n)]
            assert len(p.a._pools[PeerId(p.idb.peer_id)].idle) == dp.DataConfig().streams

    run(main())


def test_a_peer_whose_data_port_cannot_be_reached_is_called_through_the_fallback() -> None:
    async def main() -> None:
        async with Pair() as p:
            with socket.socket() as s:  # a port nothing listens on: B's data port blocked, its fallback up
                s.bind(("127.0.0.1", 0))
                closed = s.getsockname()[1]
            b = PeerId(p.idb.peer_id)
            p.a.address_of = lambda peer: f"127.0.0.1:{closed}"
            assert await p.a.call(b, "echo", b"abc", 5) == b"cba"
            assert p.a.paths[b] == "libp2p" and p.a.fallbacks["unreachable"] == 1
            assert await p.a.call(b, "echo", b"abc", 5) == b"cba"  # not tried again for retry_after seconds
            assert p.a.fallbacks["unreachable"] == 2
            # ...unless its record names another address (it restarted on another port): tried there at once
            p.a.address_of = lambda peer: p.b.address
            assert await p.a.call(b, "echo", b"abc", 5) == b"cba" and p.a.paths[b] == "direct"
            p.a.address_of = lambda peer: ""
            assert await p.a.call(b, "echo", b"x", 5) == b"x"
            assert p.a.fallbacks["no_address"] == 1

    run(main())


def test_a_caller_with_another_secret_or_run_is_refused_and_counted_and_reaches_no_handler() -> None:
    async def main() -> None:
        for secret, run_id in (("t" * 32, RUN), (SECRET, "other-run")):
            async with Pair(secret_a=secret, run_a=run_id) as p:
                with pytest.raises(dp.DataRefused) as e:  # the server's proof fails for us: we never send
                    await dp.connect("127.0.0.1", p.port, PeerId(p.idb.peer_id), p.ida, p.a.guard.data_key,
                                     p.a.counter, 1 << 20)
                assert e.value.reason == "data_unauthorized"
                # a stranger that sends its finish anyway is refused by the server
                await _handshake(p, data_key=p.a.guard.data_key)
                await asyncio.sleep(0.2)
                assert p.refused() == {"data_unauthorized": 1} and p.calls == []
                # and a call falls back to libp2p, where the guard refuses it as before
                with pytest.raises(TransportError):
                    await p.a.call(PeerId(p.idb.peer_id), "echo", b"x", 5)
                assert p.calls == []

    run(main())


def test_a_stranger_that_keeps_trying_waits_for_each_refusal_after_its_first() -> None:
    """The tarpit at the data port (as at the libp2p port: comms/tarpit.py): a caller's first refusal closes its
    connection at once, so a misconfigured peer learns at once; the next is held, unread, for the hold's seconds."""
    from diloco.comms.tarpit import Tarpit, TarpitConfig

    async def main() -> None:
        async with Pair(secret_a="t" * 32) as p:
            assert p.b.guard is not None
            p.b.guard.tarpit = Tarpit(TarpitConfig(hold=1.5))
            took = []
            for _ in range(2):
                started = asyncio.get_running_loop().time()
                await _handshake(p)
                took.append(asyncio.get_running_loop().time() - started)
            assert took[0] < 1.0 <= 1.5 <= took[1] + 0.05, took
            assert p.refused() == {"data_unauthorized": 2} and p.b.guard.tarpit.held_total == 1 and p.calls == []

    run(main())


def test_a_member_claiming_another_peer_id_or_not_on_the_allowlist_is_refused() -> None:
    async def main() -> None:
        async with Pair() as p:
            impostor = Identity.generate()
            await _handshake(p, claim=impostor.peer_id)  # the right key, signed with A's key, claiming another id
            await asyncio.sleep(0.2)
            assert p.refused() == {"data_unauthorized": 1}
        async with Pair(allow=frozenset({"someone-else"})) as p:
            with pytest.raises(TransportError):
                await p.a.call(PeerId(p.idb.peer_id), "echo", b"x", 5)
            assert p.refused().get("data_not_allowed") == 1 and p.calls == []

    run(main())


@pytest.mark.parametrize("attack", ["tampered", "replayed", "reordered", "truncated", "oversized", "garbage"])
def test_a_bad_record_from_a_member_is_refused_counted_and_never_reaches_the_handler(attack: str) -> None:
    async def main() -> None:
        async with Pair() as p:
            guard = p.a.guard
            assert guard is not None
            ch = await dp.connect("127.0.0.1", p.port, PeerId(p.idb.peer_id), p.ida, guard.data_key, p.a.counter,
                                  1 << 30)
            start = struct.pack(">BQH", dp.REQUEST, 2 * dp.RECORD, 4) + b"echo"
            first = ch.out.seal(start + bytes(dp.RECORD - len(start)))
            second = ch.out.seal(bytes(dp.RECORD))
            records = {
                "tampered": [first[:100] + bytes([first[100] ^ 1]) + first[101:], second],
                "replayed": [first, first],
                "reordered": [second, first],
                "truncated": [first, second[: len(second) // 2]],
                "oversized": [dp.Sealer(ch.out.aead).seal(struct.pack(">BQH", dp.REQUEST, 1 << 40, 4) + b"echo")],
                "garbage": [struct.pack(">I", 100) + secrets.token_bytes(100)],
            }[attack]
            for record in records:
                ch.pipe.write(record)
            await ch.pipe.drain()
            if attack == "truncated":
                ch.pipe.close()
            reason = {"oversized": "data_oversized", "truncated": "data_malformed"}.get(attack, "data_bad_frame")
            for _ in range(50):
                if p.refused():
                    break
                await asyncio.sleep(0.05)
            assert p.refused() == {reason: 1} and p.calls == []
            ch.close()
            # the member's next connection works: one bad connection closed, nothing else touched
            assert await p.a.call(PeerId(p.idb.peer_id), "echo", b"ok", 5) == b"ko"

    run(main())


def test_a_stranger_that_sends_nothing_is_cut_at_the_handshake_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp, "HELLO_TIMEOUT", 0.3)

    async def main() -> None:
        async with Pair() as p:
            reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
            writer.write(b"GET / HTTP/1.1\r\n\r\n" + bytes(200))
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            assert p.refused() == {"slow_head": 1, "data_malformed": 1}

    run(main())


async def _handshake(p: Pair, *, data_key: bytes | None = None, claim: str | None = None) -> None:
    """A client's side done by hand: A's key signs, `claim` is the id it says it has, `data_key` the run key it
    derives with; it sends its finish whatever the server proved."""
    guard = p.a.guard
    assert guard is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    await stranger_handshake(reader, writer, p.ida, data_key or guard.data_key, claim=claim)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the server closes it
    writer.close()


def test_silent_connections_are_capped_and_cut_and_members_still_get_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 connections from one address that send nothing: at most the gate's per-caller cap (32) wait for their
    handshake at once, the rest are closed at once (`too_many_streams`), the waiting ones at the deadline
    (`slow_head`), and the port serves a member afterwards. (The gate keys the data port by address: a member
    behind the same address as such a flood waits for it to be cut, or its calls go through libp2p.)"""
    monkeypatch.setattr(dp, "HELLO_TIMEOUT", 1.0)

    async def main() -> None:
        async with Pair() as p:
            silent = [await asyncio.open_connection("127.0.0.1", p.port) for _ in range(200)]
            await asyncio.sleep(0.3)
            assert p.b._gate.waiting <= dp.GateConfig().per_caller
            assert p.refused().get("too_many_streams", 0) >= 200 - dp.GateConfig().per_caller
            await asyncio.sleep(1.5)  # the deadline passes: the waiting ones are cut too
            assert p.b._gate.waiting == 0
            assert p.refused().get("slow_head", 0) >= 1
            assert await p.a.call(PeerId(p.idb.peer_id), "echo", b"still", 10) == b"llits"
            for _, w in silent:
                w.close()

    run(main())


def test_a_kept_connection_the_member_dropped_is_replaced_and_the_call_goes_through() -> None:
    """A member that restarted under the same id (or dropped our idle connection) is called again on a new
    connection, once: the request never reached it on the old one."""
    async def main() -> None:
        async with Pair() as p:
            b = PeerId(p.idb.peer_id)
            assert await p.a.call(b, "echo", b"one", 5) == b"eno"
            for task in list(p.b._serving):  # the member drops every connection it serves
                task.cancel()
            await asyncio.sleep(0.2)
            assert await p.a.call(b, "echo", b"two", 5) == b"owt"
            assert p.a.paths[b] == "direct" and not p.a.fallbacks and p.calls[-1] == (p.ida.peer_id, 3)

    run(main())
