"""The tarpit's decisions (comms/tarpit.py): who waits for a refusal, how long, and within what bounds."""

import asyncio

import pytest

from diloco.comms.tarpit import Tarpit, TarpitConfig, hold_seconds

CFG = TarpitConfig(hold=10.0, memory=300.0, per_caller=2, max_held=3, max_callers=4)


@pytest.mark.unit
@pytest.mark.parametrize("last, now, by_caller, total, expected", [
    (None, 0.0, 0, 0, 0.0),      # first offence: answered at once
    (0.0, 1.0, 0, 0, 10.0),      # again: held
    (0.0, 300.0, 0, 0, 10.0),    # still remembered at the edge
    (0.0, 300.5, 0, 0, 0.0),     # forgotten after `memory` of quiet: a first offence again
    (0.0, 1.0, 2, 2, 0.0),       # this caller's holds are full
    (0.0, 1.0, 1, 3, 0.0),       # all holds are full
    (0.0, 1.0, 1, 2, 10.0),
])
def test_hold_seconds(last, now, by_caller, total, expected):
    assert hold_seconds(CFG, last, now, by_caller, total) == expected


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_repeat_offenders_wait_within_bounds_and_the_books_balance():
    async def main():
        clock = Clock()
        pit = Tarpit(TarpitConfig(hold=0.2, memory=300.0, per_caller=2, max_held=3, max_callers=4), clock)
        await pit.refused("a")  # first: no wait
        assert pit.held_total == 0
        held = [asyncio.create_task(pit.refused(c)) for c in ("a", "a", "a", "b")]
        await asyncio.sleep(0)  # each is now holding or has returned
        # a's two holds fill its share; its third returns at once; b is a first offence
        assert pit.holding == 2 and pit.held_total == 2
        assert [t.done() for t in held] == [False, False, True, True]
        await asyncio.gather(*held)
        assert pit.holding == 0 and pit.held_total == 2
        clock.now = 301.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await pit.refused("a")  # forgotten: answered at once
        assert loop.time() - t0 < 0.1

    asyncio.run(main())


@pytest.mark.unit
def test_callers_remembered_are_bounded_oldest_forgotten_first():
    async def main():
        pit = Tarpit(TarpitConfig(hold=0.05, max_callers=4), Clock())
        for c in "abcde":  # five first offences: 'a' is forgotten
            await pit.refused(c)
        await pit.refused("a")
        await pit.refused("e")
        return pit.held_total

    assert asyncio.run(main()) == 1  # only 'e' was held


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_a_peer_that_exits_while_its_tarpit_holds_a_stream_logs_no_traceback(caplog):
    """A peer leaves (transport closed, then its loop's tasks cancelled, as `Swarm.close` does) while a
    refusal is held: the held stream ends quietly, no `CancelledError` traceback is logged."""
    import logging
    import time

    from diloco.comms import PeerId
    from diloco.comms.auth import Guard
    from diloco.comms.loop import LoopThread
    from diloco.comms.p2p import P2PTransport
    from diloco.comms.transport import TransportError

    async def pong(caller: PeerId, data: bytes) -> bytes:
        return data

    caplog.set_level(logging.DEBUG)
    ours, theirs = LoopThread(name="peer"), LoopThread(name="stranger")
    peer = ours.run(P2PTransport.create(), timeout=30)
    stranger = None
    try:
        peer.guard = Guard("s" * 32, "run", peer.peer_id)
        peer.guard.tarpit = Tarpit(TarpitConfig(hold=30.0))
        ours.run(peer.register("x", pong), timeout=10)
        stranger = theirs.run(P2PTransport.create(initial_peers=ours.run(peer.visible_addresses())), timeout=30)
        stranger.guard = Guard("w" * 32, "run", stranger.peer_id)
        with pytest.raises(TransportError):
            theirs.run(stranger.call(peer.peer_id, "x", b"hi", 10), timeout=15)  # first refusal: at once
        held = theirs.submit(stranger.call(peer.peer_id, "x", b"hi", 40))  # the next one is held
        deadline = time.monotonic() + 10
        while peer.guard.tarpit.holding == 0:
            assert time.monotonic() < deadline, "the second refusal was never held"
            time.sleep(0.05)
        ours.run(peer.close(), timeout=20)
        ours.stop()  # cancels the held refusal
        with pytest.raises(TransportError):
            held.result(timeout=20)  # the stranger sees its stream end
    finally:
        ours.stop()
        if stranger is not None:
            theirs.run(stranger.close(), timeout=20)
        theirs.stop()
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info
             or "CancelledError" in r.getMessage()]
    assert not noisy, [r.getMessage() for r in noisy]
    assert any("reason=shutting down" in r.getMessage() for r in caplog.records)  # the held stream did end here
