"""Who can learn who is in the swarm (comms/p2p.py runs its daemons without libp2p's DHT), and how
members find each other's addresses instead (comms/introduce.py, from their signed records)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from diloco.comms.introduce import Introducer, dial_addrs, due
from diloco.peers import PeerRecord

A = "12D3KooWA"
B = "12D3KooWB"


@pytest.mark.unit
def test_dial_addrs_drop_the_peer_id_and_addresses_of_other_peers():
    addrs = [f"/ip4/1.2.3.4/tcp/5/p2p/{A}", "/ip4/1.2.3.4/tcp/6", f"/ip4/9.9.9.9/tcp/7/p2p/{B}", f"/p2p/{A}"]
    assert dial_addrs(A, addrs) == ["/ip4/1.2.3.4/tcp/5", "/ip4/1.2.3.4/tcp/6"]


@pytest.mark.unit
def test_due():
    assert due(None, 0.0, 60.0) and due(0.0, 60.0, 60.0) and not due(0.0, 59.0, 60.0)


class FakeClient:
    def __init__(self, fail: set[str]) -> None:
        self.fail, self.calls = fail, []

    async def connect(self, peer, maddrs) -> None:
        self.calls.append((peer.to_base58(), [str(m) for m in maddrs]))
        if peer.to_base58() in self.fail:
            raise ConnectionError("unreachable")


class FakeP2P:
    def __init__(self, fail: set[str] = frozenset()) -> None:
        self._client = FakeClient(set(fail))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_members_are_introduced_once_a_minute_and_failures_retried_sooner():
    from diloco.comms.identity import Identity

    me, ok, bad = (Identity.generate().peer_id for _ in range(3))

    def rec(peer: str, status: str = "training") -> PeerRecord:
        return PeerRecord(peer=peer, status=status, round=0, addrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peer}",))

    async def settle(intro: Introducer) -> None:  # the connections it started have ended
        while intro._tasks:
            await asyncio.sleep(0.01)

    async def main():
        clock, p2p = Clock(), FakeP2P({bad})
        intro = Introducer(p2p, me, every=60.0, retry=5.0, clock=clock)
        records = [rec(me), rec(ok), rec(bad), rec(Identity.generate().peer_id, "left")]
        intro.meet(records)
        await settle(intro)
        first = sorted(p for p, _ in p2p._client.calls)
        clock.now = 6.0
        intro.meet(records)  # the failed one is tried again, the other one is not due
        await settle(intro)
        second = [p for p, _ in p2p._client.calls[len(first):]]
        clock.now = 61.0
        intro.meet(records)
        await settle(intro)
        await intro.close()
        return first, second, p2p._client.calls

    first, second, calls = asyncio.run(main())
    assert first == sorted([ok, bad])  # not ourselves, not one that left
    assert second == [bad]
    assert [p for p, _ in calls].count(ok) == 2
    assert calls[0][1] == ["/ip4/127.0.0.1/tcp/1"]


# ---------------------------------------------------------------------- real daemons


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_stranger_dialing_a_member_learns_no_other_member_and_a_swarm_joined_in_a_chain_trains(tmp_path):
    """A starts; B joins through A; C joins through B, so C must reach A, whose address it was never
    given, and A must reach C. All three commit rounds together. A stranger (no secret, hivemind's
    defaults: a libp2p DHT server) that dials A's published address sees, 5 s later, only A among
    the peers its daemon knows: members' daemons run no libp2p DHT that would tell it the others."""
    from hivemind.p2p import P2P

    from multiproc_util import TINY, Peers

    group = Peers(tmp_path, "chain")
    try:
        common = ["--rounds", "1000", "-H", "4", "--min-peers", "3", "--wait-for", "3", *TINY]
        group.spawn(0, ["start", *common])
        group.spawn(1, ["join", group.address(0), *common])
        group.spawn(2, ["join", group.address(1), *common])
        deadline = time.monotonic() + 60
        while not all(any(r["committed"] and r["peers"] == 3 for r in group.lines(i, "round")) for i in range(3)):
            assert time.monotonic() < deadline, group.log(2)
            time.sleep(0.2)
        members = {group.address(i).rsplit("/p2p/", 1)[1] for i in range(3)}

        async def stranger() -> set[str]:
            p2p = await P2P.create(initial_peers=[group.address(0)])
            try:
                await asyncio.sleep(5)
                return {p.peer_id.to_base58() for p in await p2p.list_peers()}
            finally:
                await p2p.shutdown()

        seen = asyncio.run(stranger())
        for p in group.procs:
            p.send_signal(signal.SIGTERM)
        codes = [group.wait(p, 60) for p in group.procs]
    finally:
        group.kill_all()
    assert seen & members == {group.address(0).rsplit("/p2p/", 1)[1]}, seen
    assert codes == [0, 0, 0]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_daemon_dials_from_a_port_of_its_own_not_from_the_one_it_listens_on():
    """With libp2p's default (dialing from the listening port) a peer behind a NAT and a member dialing it at once
    open one TCP connection both ways, and the security handshake fails on it (comms/p2p.py, `DAEMON_ENV`). The
    connection A opens reaches B from another port than A's listening one."""
    from diloco.comms.introduce import connect
    from diloco.comms.p2p import P2PTransport

    async def run() -> tuple[int, set[int]]:
        a = await P2PTransport.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        b = await P2PTransport.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            listening = {int(str(m).split("/tcp/")[1].split("/")[0]) for m in await a.p2p.get_visible_maddrs()}
            await connect(a.p2p, b.p2p.peer_id.to_base58(), [str(m) for m in await b.p2p.get_visible_maddrs()], 10)
            seen = [info for info in await b.p2p.list_peers() if info.peer_id == a.p2p.peer_id]
            assert seen, "B does not list A's connection"
            return listening.pop(), {int(str(m).split("/tcp/")[1].split("/")[0]) for m in seen[0].addrs}
        finally:
            await a.close()
            await b.close()

    listening, dialed_from = asyncio.run(run())
    assert dialed_from and listening not in dialed_from, (listening, dialed_from)
