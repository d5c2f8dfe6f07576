"""DHT islands: a group of peers whose DHT nodes know only each other stores and reads records among
themselves alone. One answered ping between the groups (`DHTDirectory.reach`) joins them, and the swarm
pings the members of its last round that its reads miss."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from diloco.comms.identity import Identity
from diloco.peers import PeerRecord


def _islands(join):
    """A and B bootstrap through each other, C and D through each other, all in one run; each pair reads only its
    own records. `join(transports, dirs, records)` joins them; then one more heartbeat (every peer publishes, then
    reads). Returns (ids, reads before, what join returned, reads after)."""
    from diloco.comms.p2p import P2PTransport
    from diloco.peers import DHTDirectory

    async def main():
        transports, dirs = [], []
        try:
            for bootstrap in (None, 0, None, 2):  # A, B through A, C, D through C
                identity = Identity.generate()
                addrs = [] if bootstrap is None else [str(m) for m in await transports[bootstrap].visible_addresses()]
                t = await P2PTransport.create(identity=identity, initial_peers=addrs)
                transports.append(t)
                dirs.append(await DHTDirectory.create(t.p2p, "islands", addrs, identity=identity))
            ids = [t.peer_id for t in transports]
            records = [PeerRecord(peer=p, status="training", round=3,
                                  addrs=tuple(str(m) for m in await t.visible_addresses()))
                       for p, t in zip(ids, transports)]

            async def heartbeat():
                for d, r in zip(dirs, records):
                    await d.publish(r, 30)
                return [sorted(r.peer for r in await d.read()) for d in dirs]

            before = await heartbeat()
            joined = await join(transports, dirs, records)
            after = await heartbeat()
            return ids, before, joined, after
        finally:
            for d in dirs:
                await d.close()
            for t in transports:
                await t.close()

    ids, before, joined, after = asyncio.run(main())
    a, b, c, d = ids
    assert before == [sorted([a, b])] * 2 + [sorted([c, d])] * 2, before  # two islands
    return ids, joined, after


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_two_dht_islands_are_joined_by_reaching_a_peer_at_the_addresses_of_its_last_record():
    async def join(transports, dirs, records):
        return await dirs[0].reach([records[2]])  # A dials C where C's last record says

    ids, answered, after = _islands(join)
    assert answered == 1
    assert after == [sorted(ids)] * 4, after


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_two_dht_islands_are_joined_by_reaching_a_caller_by_its_id_alone():
    """C's daemon called A (a round's frames), so A reaches C without any record of it: by id, over that
    connection. Without the reach the call alone joins nothing (the DHT nodes never met)."""
    from diloco.comms.introduce import connect

    async def join(transports, dirs, records):
        await connect(transports[2].p2p, records[0].peer, records[0].addrs, 10)  # C dials A
        alone = sorted(r.peer for r in await dirs[0].read())
        answered = await dirs[0].reach([PeerRecord(peer=records[2].peer, status="training", round=0)])
        return alone, answered

    ids, (alone, answered), after = _islands(join)
    assert alone == sorted(ids[:2]) and answered == 1
    assert after == [sorted(ids)] * 4, after


# ---------------------------------------------------------------------- the swarm reaches its missing members


@pytest.mark.unit
def test_the_peers_to_reach_are_members_and_callers_a_read_misses_that_did_not_leave_once_a_period():
    from diloco.peers.membership import unseen_peers

    last = {p: PeerRecord(peer=p, status="training", round=3) for p in "abcde"}
    members = ("a", "b", "c", "d", "c")
    # a is me, b is here, c is missing, d said goodbye, e is missing but no member and did not call
    assert unseen_peers(members, (), "a", {"b"}, {"d"}, last, {}, 10.0, 2.0) == ["c"]
    assert unseen_peers(members, (), "a", {"b"}, {"d"}, last, {"c": 9.0}, 10.0, 2.0) == []  # tried a second ago
    assert unseen_peers(members, (), "a", {"b"}, {"d"}, last, {"c": 8.0}, 10.0, 2.0) == ["c"]
    assert unseen_peers(("a", "f"), (), "a", set(), (), last, {}, 10.0, 2.0) == []  # no record of f: nowhere to dial
    # members we hold no record of but that called us since the last read: reached by id (over that connection);
    # a caller that is no member is not (a stranger's bytes are counted before its call is refused)
    assert unseen_peers(("a", "f", "c"), ("f", "g", "b"), "a", {"b"}, (), last, {}, 10.0, 2.0) == ["f", "c"]
    assert unseen_peers(members, ("d", "a"), "a", {"b"}, {"d"}, last, {}, 10.0, 2.0) == ["c"]


class _Island:
    """Peer a's view of the shared board: the others' records are hidden from its reads (a DHT island of its own)
    until it reaches one of them, as `DHTDirectory.reach` joins two islands; every reach is recorded."""

    def __init__(self, board, hidden: set[str]) -> None:
        self.board, self.hidden, self.reached = board, set(), []
        self.dropped = board.dropped
        self.later = hidden

    def isolate(self) -> None:
        self.hidden = set(self.later)

    async def publish(self, record, ttl):
        await self.board.publish(record, ttl)

    async def read(self):
        return [r for r in await self.board.read() if r.peer not in self.hidden]

    async def reach(self, records):
        self.reached.append(sorted(r.peer for r in records))
        self.hidden.clear()
        return len(records)

    async def close(self):
        pass


@contextlib.contextmanager
def _worker(h, island: _Island, base: torch.nn.Module, name: str):
    """Peer `name` of the in-process harness `h` as a DiLoCo worker (SGD, H=3): peer a reads the board through
    `island`, the others the board itself. Yields (model, optimizer, its batches, the worker)."""
    import copy

    from test_swarm_inproc import _batches

    import diloco
    from diloco import DiLoCo

    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    swarm = diloco.Swarm.in_process(h.net, island if name == "a" else h.board, name, h.cfg, h.loop)
    h.swarms.append(swarm)
    with DiLoCo(model, opt, swarm=swarm, inner_steps=3) as d:
        yield model, opt, _batches(hash(name) % 100, 8), d


def test_a_peer_whose_reads_lose_its_last_rounds_members_reaches_them_and_commits_again():
    """a, b and c commit rounds; then a's directory shows a alone (its DHT node an island), so a's rounds have no
    quorum (1 of the last round's 3 members). a's heartbeat reaches b and c, its next read sees them again, and
    all three commit further rounds together."""
    import threading
    import time

    from test_swarm_inproc import Harness, _mlp, _run_threads, _train

    h = Harness()
    island = _Island(h.board, {"b", "c"})
    base = _mlp(5)
    together = threading.Barrier(3, timeout=20)
    rounds: dict[str, int] = {}

    def worker(name: str) -> None:
        with _worker(h, island, base, name) as (model, opt, data, d):
            together.wait()
            k, deadline = 0, time.monotonic() + 40
            while d.round < 6 and time.monotonic() < deadline:
                if name == "a" and d.round == 2 and not island.reached and not island.hidden:
                    island.isolate()
                _train(model, opt, [data[k % len(data)]])
                k += 1
            rounds[name] = d.round

    try:
        _run_threads([lambda: worker("a"), lambda: worker("b"), lambda: worker("c")], [together])
    finally:
        h.close()
    assert island.reached and island.reached[0] == ["b", "c"], island.reached
    assert rounds == {"a": 6, "b": 6, "c": 6}, rounds


class _Stranded:
    """A joiner's view of the shared board, in phases the test sets: "stale" shows the others' records as of a round
    they hold no longer (its downloads fail), "none" shows nobody (its DHT node an island, their records expired),
    "live" the board itself."""

    def __init__(self, board, me: str) -> None:
        self.board, self.me, self.phase, self.reached = board, me, "stale", []
        self.dropped = board.dropped

    async def publish(self, record, ttl):
        await self.board.publish(record, ttl)

    async def read(self):
        records = await self.board.read()
        if self.phase == "live":
            return records
        mine = [r for r in records if r.peer == self.me]
        if self.phase == "none":
            return mine
        from dataclasses import replace
        return mine + [replace(r, round=1, digest="f" * 16, recent=()) for r in records if r.peer != self.me]

    async def reach(self, records):
        self.reached.append((self.phase, sorted(r.peer for r in records)))
        return 0

    async def close(self):
        pass


def test_a_joiner_that_saw_the_swarm_ahead_commits_no_round_of_its_own_while_no_holder_shows_and_joins_later():
    """c joins a swarm at round 3 or later, but the records it reads first name a state nobody holds any more (its
    downloads fail), then name nobody at all (an island). A round of its own from its initial state would commit a
    round 1 the swarm holds with another digest (a fork, seen in a chaos soak): c waits instead, saying why, pings
    the peers it last saw (as an island's peer pings its last round's members), and once the records show the
    swarm's holders it downloads their state and trains with them."""
    import copy
    import threading
    import time

    from test_swarm_inproc import Harness, _batches, _mlp, _run_threads, _train

    import diloco
    from diloco import DiLoCo

    h = Harness()
    view = _Stranded(h.board, "c")
    base = _mlp(6)
    ahead = threading.Event()
    finished = threading.Event()
    seen: dict[str, list] = {}

    def worker(name: str) -> None:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        data = _batches(hash(name) % 100, 8)
        if name == "c":
            ahead.wait(30)
        swarm = diloco.Swarm.in_process(h.net, view if name == "c" else h.board, name, h.cfg, h.loop)
        h.swarms.append(swarm)
        with DiLoCo(model, opt, swarm=swarm, inner_steps=3, join_timeout=1.0) as d:
            k, deadline = 0, time.monotonic() + 60
            phase_at = time.monotonic()
            while time.monotonic() < deadline and not finished.is_set():
                _train(model, opt, [data[k % len(data)]])
                k += 1
                if name != "c":
                    if d.round >= 3:
                        ahead.set()
                    continue
                if view.phase == "stale" and time.monotonic() - phase_at > 2:
                    view.phase, phase_at = "none", time.monotonic()
                elif view.phase == "none" and time.monotonic() - phase_at > 8:
                    seen["stranded"] = list(d.reports)  # what c did while no record named a holder
                    view.phase = "live"
                elif view.phase == "live" and sum(r.committed for r in d.reports) >= 2:
                    finished.set()
            seen[name] = list(d.reports)

    try:
        _run_threads([lambda: worker("a"), lambda: worker("b"), lambda: worker("c")], [])
    finally:
        h.close()
    stranded = seen["stranded"]
    assert stranded and not any(r.committed for r in stranded), [(r.round, r.peers, r.reason) for r in stranded]
    assert any("no record shows a holder" in r.reason for r in stranded), [r.reason for r in stranded]
    assert ("none", ["a", "b"]) in view.reached, view.reached
    committed = [r for r in seen["c"] if r.committed]
    assert committed and min(r.round for r in committed) > 3 and all(r.peers >= 2 for r in committed), \
        [(r.round, r.peers) for r in committed]


def test_a_gossiping_peer_whose_reads_lose_everyone_reaches_the_peers_it_gossiped_among_and_meets_them_again():
    """Gossip has no round members to reach: a peer whose DHT node became an island after a partition healed read
    nobody and gossiped alone for good (a chaos soak, seed 7: 2.75 minutes, until the run's end). a, b and c gossip;
    then a's reads show a alone. Its heartbeat reaches the peers its last reads showed, and a meets a partner again."""
    import threading
    import time
    from dataclasses import replace

    from test_gossip import CALM
    from test_swarm_inproc import Harness, _mlp, _run_threads, _train

    h = Harness(replace(CALM, heartbeat_interval=0.5))
    island = _Island(h.board, {"b", "c"})
    base = _mlp(5)
    together = threading.Barrier(3, timeout=20)
    isolated_at: list[int] = []
    reports: dict[str, list] = {}

    def worker(name: str) -> None:
        with _worker(h, island, base, name) as (model, opt, data, d):
            together.wait()
            k, deadline = 0, time.monotonic() + 30
            while time.monotonic() < deadline:
                if name == "a" and not isolated_at and sum(r.committed for r in d.reports) >= 2:
                    isolated_at.append(len(d.reports))
                    island.isolate()
                if name == "a" and isolated_at and len(isolated_at) == 1 and island.reached:
                    isolated_at.append(len(d.reports))  # the reach joined the island: rounds from here on
                if name == "a" and len(isolated_at) == 2 and any(r.committed for r in d.reports[isolated_at[1]:]):
                    break  # met a partner after the island was joined
                if name != "a" and reports.get("a") is not None:
                    break
                _train(model, opt, [data[k % len(data)]])
                k += 1
                time.sleep(0.005)
            reports[name] = list(d.reports)

    try:
        _run_threads([lambda: worker("a"), lambda: worker("b"), lambda: worker("c")], [together])
    finally:
        h.close()
    assert len(isolated_at) == 2, (island.reached, [(r.round, r.committed, r.reason) for r in reports["a"][-6:]])
    alone = reports["a"][isolated_at[0]:isolated_at[1]]
    after = reports["a"][isolated_at[1]:]
    assert island.reached[0] and set(island.reached[0]) <= {"b", "c"}, island.reached
    assert any(r.committed and r.peers >= 2 for r in after), [(r.round, r.reason) for r in after]
    assert all(not r.committed for r in alone[1:]), [(r.round, r.reason) for r in alone]  # the island: alone
