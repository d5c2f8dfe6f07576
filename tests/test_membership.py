"""Membership decisions (peers/membership.py), peer records (peers/records.py) and the pure helpers
of the round protocol (comms/spans.py). All deterministic: no network, no real clock."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.comms import RoundKey, span_bounds, view_id
from diloco.comms.spans import make_view
from diloco.peers import (
    InProcBoard,
    PeerRecord,
    expected_peers,
    banned_by_majority,
    parse_record,
    resync_source,
    round_key_for,
    started_without,
    voted_out,
    vouched,
)
from diloco.peers import plan_round
from diloco.peers import records as records_mod

pytestmark = pytest.mark.unit


def rec(peer: str, rnd: int = 0, *, status: str = "training", attempt: int = 0, digest: str = "d0",
        recent: tuple[tuple[int, str], ...] = ()) -> PeerRecord:
    return PeerRecord(peer=peer, status=status, round=rnd, attempt=attempt, digest=digest, recent=recent)


# ---------------------------------------------------------------------- plan_round


def test_a_round_asks_stragglers_and_catching_up_members_waits_for_downloaders_and_counts_goodbyes_as_left():
    """At round 3: a, b train (waited for); s straggled last round (asked, not waited for); m, a member of the last
    round, is catching up (joining: asked, not waited for); d downloads our state (waited for); a straggler that
    downloads keeps its grace; g left at round 2 and its record expired (its goodbye still counts as departed); a
    peer at round 1 is not expected; peers at our round that failed more attempts set the attempt."""
    records = [rec("me", 3), rec("a", 3, attempt=2), rec("b", 2), rec("s", 3), rec("m", 3, status="joining"),
               rec("old", 1)]
    plan = plan_round(records, "me", 3, 0, skip={"s"}, previous=("me", "a", "m", "g"),
                      goodbyes=[rec("g", 2, status="left")], fetching={"d", "s"})
    assert plan.key == RoundKey(3, 2)
    assert plan.ask == ["a", "b", "d", "m", "s"]
    assert plan.wait_for == {"a", "b", "d"}
    assert plan.left == ["g"]
    # nobody straggling, catching up or downloading: everyone asked is waited for
    calm = plan_round([rec("me", 3), rec("a", 3), rec("b", 3)], "me", 3, 0, previous=("me", "a", "b"))
    assert calm.ask == ["a", "b"] and calm.wait_for is None and calm.left == []


# ---------------------------------------------------------------------- started_without (--wait-for)


def test_the_swarm_started_without_us_once_another_peer_stepped_even_if_it_already_left():
    def r(peer: str, status: str = "training", step: int = 0, rnd: int = 0) -> PeerRecord:
        return PeerRecord(peer=peer, status=status, step=step, round=rnd)

    assert not started_without([r("me", step=5), r("a"), r("b", "standby")], "me")  # our own steps do not count
    assert started_without([r("me"), r("a", step=1)], "me")
    assert started_without([r("me"), r("a", "standby", rnd=2)], "me")
    # a short run may be over before a late peer looks: those that trained and left show it started
    assert started_without([r("me"), r("a", "left", step=3)], "me")
    assert not started_without([r("me"), r("a", "left")], "me")  # left before its first step: nothing started
    assert not started_without([r("me"), r("a", "joining", rnd=4)], "me")  # still catching up


# ---------------------------------------------------------------------- expected_peers


def test_expected_peers_are_training_peers_at_our_round_one_behind_or_ahead():
    records = [
        rec("me", 5),
        rec("same", 5),
        rec("behind1", 4),
        rec("behind2", 3),
        rec("ahead", 6),
        rec("joining", 5, status="joining"),
        rec("left", 5, status="left"),
        rec("a-first", 5),
    ]
    assert expected_peers(records, RoundKey(5, 2), "me") == ["a-first", "ahead", "behind1", "same"]


def test_expected_peers_excludes_self_even_if_listed_twice_and_is_sorted():
    records = [rec("me", 0), rec("zz", 0), rec("me", 0), rec("b", 0)]
    assert expected_peers(records, RoundKey(0), "me") == ["b", "zz"]


def test_expected_peers_at_round_zero_and_nobody_else():
    assert expected_peers([rec("me", 0)], RoundKey(0), "me") == []
    assert expected_peers([rec("me", 0), rec("x", 1)], RoundKey(0), "me") == ["x"]  # ahead: it tells us


# ---------------------------------------------------------------------- round_key_for


def test_round_key_for_adopts_max_attempt_of_peers_at_our_round():
    records = [rec("me", 3, attempt=0), rec("a", 3, attempt=2), rec("b", 3, attempt=1),
               rec("c", 4, attempt=9), rec("d", 2, attempt=7), rec("e", 3, attempt=8, status="joining")]
    assert round_key_for(records, 3, 0) == RoundKey(3, 2)
    assert round_key_for(records, 3, 5) == RoundKey(3, 5)  # our own attempt is higher
    assert round_key_for([], 7, 1) == RoundKey(7, 1)


# ---------------------------------------------------------------------- resync_source


def test_resync_none_without_other_training_peers():
    records = [rec("me", 0, digest="x"), rec("j", 5, status="joining", digest="y"),
               rec("l", 9, status="left", digest="z"), rec("nodigest", 9, digest="")]
    source, why = resync_source(records, "me", 0, "x")
    assert source is None and "no other" in why


def test_resync_none_when_we_are_ahead():
    records = [rec("me", 5, digest="mine"), rec("a", 4, digest="old"), rec("b", 3, digest="older")]
    source, why = resync_source(records, "me", 5, "mine")
    assert source is None and "ahead" in why


def test_resync_when_behind_uses_majority_digest_of_newest_round_lowest_peer():
    records = [
        rec("me", 2, digest="mine"),
        rec("p9", 4, digest="good"),
        rec("p3", 4, digest="good"),
        rec("p1", 4, digest="bad"),   # lowest id, but minority digest
        rec("p5", 4, digest="good"),
        rec("p0", 3, digest="good"),  # lower id, but an older round
    ]
    source, why = resync_source(records, "me", 2, "mine")
    assert source is not None and (source.peer, source.digest, source.round) == ("p3", "good", 4)
    assert "round 4" in why


def test_resync_when_behind_single_peer_ahead():
    source, _ = resync_source([rec("me", 0, digest="a"), rec("x", 1, digest="b")], "me", 0, "a")
    assert source is not None and source.peer == "x"


def test_resync_same_round_we_are_minority():
    records = [rec("me", 3, digest="mine"), rec("b", 3, digest="theirs"), rec("a", 3, digest="theirs")]
    source, why = resync_source(records, "me", 3, "mine")
    assert source is not None and source.peer == "a" and source.digest == "theirs"
    assert "minority" in why


def test_resync_same_round_we_are_majority():
    records = [rec("me", 3, digest="mine"), rec("b", 3, digest="mine"), rec("a", 3, digest="theirs")]
    source, why = resync_source(records, "me", 3, "mine")
    assert source is None and "majority" in why


@pytest.mark.parametrize("mine, theirs, expect_resync", [("bbbb", "aaaa", True), ("aaaa", "bbbb", False)])
def test_resync_tie_smaller_digest_wins(mine, theirs, expect_resync):
    records = [rec("me", 3, digest=mine), rec("other", 3, digest=theirs)]
    source, _ = resync_source(records, "me", 3, mine)
    if expect_resync:
        assert source is not None and source.digest == theirs
    else:
        assert source is None


def test_resync_tie_among_others_when_behind_smaller_digest_wins():
    records = [rec("me", 0, digest="m"), rec("p1", 2, digest="zz"), rec("p2", 2, digest="aa")]
    source, _ = resync_source(records, "me", 0, "m")
    assert source is not None and (source.peer, source.digest) == ("p2", "aa")


def test_resync_ignores_our_own_record():
    records = [rec("me", 9, digest="stale-self-record"), rec("a", 3, digest="mine")]
    source, _ = resync_source(records, "me", 3, "mine")
    assert source is None


# ---------------------------------------------------------------------- parse_record


VALID = {"peer": "p1", "status": "training", "round": 3, "attempt": 1, "digest": "abcd", "step": 40,
         "loss": 0.5, "addrs": ["/ip4/1.2.3.4/tcp/5/p2p/Qm"], "recent": [[2, "ab"], [3, "abcd"]],
         "banned": ["p9"]}


def test_parse_record_accepts_valid_and_round_trips_to_wire():
    r = parse_record("p1", dict(VALID))
    assert r == PeerRecord(peer="p1", status="training", round=3, attempt=1, digest="abcd", step=40, loss=0.5,
                           addrs=("/ip4/1.2.3.4/tcp/5/p2p/Qm",), recent=((2, "ab"), (3, "abcd")), banned=("p9",))
    assert parse_record("p1", r.to_wire()) == r


def test_a_record_names_its_data_port_and_the_members_it_reached_through_libp2p():
    r = parse_record("p1", {**VALID, "data": "10.0.0.5:4000", "libp2p": ["p7"]})
    assert (r.data, r.libp2p) == ("10.0.0.5:4000", ("p7",)) and parse_record("p1", r.to_wire()) == r
    assert parse_record("p1", {**VALID, "data": "[2001:db8::1]:4000"}).data == "[2001:db8::1]:4000"
    for bad in ("10.0.0.5", "host:0", "host:70000", ":4000", 5, "x" * 400 + ":1"):
        # a data address that is not one: the peer is called through libp2p; the record itself stays valid
        assert parse_record("p1", {**VALID, "data": bad}).data == ""
    assert parse_record("p1", {**VALID, "libp2p": "p7"}).libp2p == ()


def test_a_record_names_the_relays_it_waits_at_and_whether_it_is_one():
    r = parse_record("p1", {**VALID, "relay": True, "via": ["r1", "r2"], "relayed": ["p3"]})
    assert (r.relay, r.via, r.relayed) == (True, ("r1", "r2"), ("p3",)) and parse_record("p1", r.to_wire()) == r
    old = parse_record("p1", VALID)  # a peer of an older version: no relay, waits nowhere
    assert (old.relay, old.via, old.relayed) == (False, (), ())
    # malformed from the network: taken as none, the record stays valid (at most 4 relays are read)
    assert parse_record("p1", {**VALID, "relay": "yes", "via": "r1", "relayed": [5]}).via == ()
    assert parse_record("p1", {**VALID, "relay": 1}).relay is False
    assert parse_record("p1", {**VALID, "via": [f"r{i}" for i in range(9)]}).via == ("r0", "r1", "r2", "r3")


def test_parse_record_defaults_and_int_loss():
    r = parse_record("p2", {"status": "joining", "round": 0, "loss": 2})
    assert (r.peer, r.status, r.round, r.attempt, r.digest, r.step, r.addrs) == ("p2", "joining", 0, 0, "", 0, ())
    assert r.loss == 2.0 and isinstance(r.loss, float)


BAD_VALUES = {
    "not a dict": [("status", "training")],
    "none": None,
    "missing status": {k: v for k, v in VALID.items() if k != "status"},
    "missing round": {k: v for k, v in VALID.items() if k != "round"},
    "bad status": {**VALID, "status": "crashed"},
    "status not str": {**VALID, "status": 1},
    "round is str": {**VALID, "round": "3"},
    "round is float": {**VALID, "round": 3.0},
    "negative round": {**VALID, "round": -1},
    "negative attempt": {**VALID, "attempt": -2},
    "negative step": {**VALID, "step": -1},
    "bool round": {**VALID, "round": True},
    "bool attempt": {**VALID, "attempt": False},
    "bool step": {**VALID, "step": True},
    "nan loss": {**VALID, "loss": math.nan},
    "inf loss": {**VALID, "loss": math.inf},
    "string loss": {**VALID, "loss": "0.5"},
    "digest not str": {**VALID, "digest": 1234},
    "digest too long": {**VALID, "digest": "x" * 65},
    "too many addrs": {**VALID, "addrs": [f"/ip4/1.2.3.{i}/tcp/1" for i in range(17)]},
    "addrs not a list": {**VALID, "addrs": "/ip4/1.2.3.4/tcp/1"},
    "addr not str": {**VALID, "addrs": [1]},
    "addr too long": {**VALID, "addrs": ["/" + "a" * 600]},
    "peer mismatch": {**VALID, "peer": "someone-else"},
    "recent not a list": {**VALID, "recent": "3:abcd"},
    "recent too long": {**VALID, "recent": [[i, "d"] for i in range(9)]},
    "recent item not a pair": {**VALID, "recent": [[3, "abcd", 1]]},
    "recent negative round": {**VALID, "recent": [[-1, "abcd"]]},
    "recent bool round": {**VALID, "recent": [[True, "abcd"]]},
    "recent empty digest": {**VALID, "recent": [[3, ""]]},
    "recent digest too long": {**VALID, "recent": [[3, "x" * 65]]},
    "banned not a list": {**VALID, "banned": "p9"},
    "banned too long": {**VALID, "banned": [f"p{i}" for i in range(65)]},
    "banned id not str": {**VALID, "banned": [9]},
    "banned empty id": {**VALID, "banned": [""]},
}


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_parse_record_rejects_malformed(name):
    assert parse_record("p1", BAD_VALUES[name]) is None


def test_bandwidth_and_utilization_round_trip_and_bad_values_are_taken_as_unknown():
    """Fields only `diloco status` shows: a malformed one (a buggy or hostile writer) becomes unknown and
    the record stays (membership never depends on them); a record of an older peer has none."""
    r = parse_record("p1", {**VALID, "bytes_sent": 10**9, "bytes_received": 7, "utilization": 0.93})
    assert (r.bytes_sent, r.bytes_received, r.utilization) == (10**9, 7, 0.93)
    assert parse_record("p1", r.to_wire()) == r
    old = parse_record("p1", dict(VALID))
    assert (old.bytes_sent, old.bytes_received, old.utilization) == (0, 0, None)
    for bad in ({"bytes_sent": -1}, {"bytes_sent": 2**70}, {"bytes_sent": True}, {"bytes_received": 1.5},
                {"bytes_received": "9"}, {"utilization": 1.5}, {"utilization": -0.1}, {"utilization": math.nan},
                {"utilization": "0.9"}, {"utilization": True}, {"bytes_sent": [1] * 10**4}):
        got = parse_record("p1", {**VALID, **bad})
        assert got is not None and (got.bytes_sent, got.bytes_received, got.utilization) == (0, 0, None), bad
        assert got.round == 3 and got.digest == "abcd"  # the rest of the record is as sent


def test_a_published_step_time_round_trips_and_a_bad_one_is_taken_as_unknown():
    """`step_seconds` (adaptive rounds read it, within the weight bound): positive, finite, at most a day."""
    r = parse_record("p1", {**VALID, "step_seconds": 0.25})
    assert r.step_seconds == 0.25 and parse_record("p1", r.to_wire()) == r
    assert parse_record("p1", dict(VALID)).step_seconds is None
    for bad in (0, -0.1, math.nan, math.inf, 86401.0, "0.2", True, [0.1]):
        got = parse_record("p1", {**VALID, "step_seconds": bad})
        assert got is not None and got.step_seconds is None and got.round == 3, bad


def test_a_record_with_every_field_at_its_limit_stays_small():
    import msgpack

    big = PeerRecord(peer="p" * 52, status="training", round=2**62, attempt=2**62, digest="x" * 64, step=2**62,
                     loss=1e300, addrs=tuple("/" + "a" * 500 for _ in range(16)),
                     recent=tuple((2**62, "x" * 64) for _ in range(8)), banned=tuple("p" * 128 for _ in range(64)),
                     bytes_sent=2**62, bytes_received=2**62, utilization=1.0, step_seconds=86400.0)
    without = PeerRecord(**{**big.__dict__, "bytes_sent": 0, "bytes_received": 0, "utilization": None,
                            "step_seconds": None})
    added = len(msgpack.packb(big.to_wire())) - len(msgpack.packb(without.to_wire()))
    assert added <= 4 * 9  # the new fields cost at most 36 bytes of a record


def test_parse_record_limits_are_inclusive():
    assert parse_record("p1", {**VALID, "addrs": ["/a"] * 16}) is not None
    assert parse_record("p1", {**VALID, "digest": "x" * 64}) is not None
    assert parse_record("p1", {**VALID, "loss": None}) is not None


# ---------------------------------------------------------------------- InProcBoard


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_inproc_board_records_expire_after_ttl(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(records_mod, "time", clock)
    board = InProcBoard()

    async def scenario():
        await board.publish(rec("a", 1), ttl=2.0)
        await board.publish(rec("b", 1), ttl=5.0)
        seen = [sorted(r.peer for r in await board.read())]
        clock.now += 1.9
        seen.append(sorted(r.peer for r in await board.read()))
        clock.now += 0.2  # 2.1 s after a's publish: a expired, b not
        seen.append(sorted(r.peer for r in await board.read()))
        await board.publish(rec("a", 2), ttl=2.0)  # a heartbeat brings it back, with its new record
        again = {r.peer: r.round for r in await board.read()}
        clock.now += 3.0  # 5.1 s after b's only publish
        seen.append(sorted(r.peer for r in await board.read()))
        return seen, again

    seen, again = asyncio.run(scenario())
    assert seen == [["a", "b"], ["a", "b"], ["b"], []]
    assert again == {"a": 2, "b": 1}


def test_inproc_board_expire_and_malformed_records_are_dropped():
    board = InProcBoard()

    async def scenario():
        await board.publish(rec("a"), ttl=60)
        await board.publish(rec("b"), ttl=60)
        board.expire("a")
        board._records["evil"] = (float("inf"), {"status": "training", "round": -1})
        return sorted(r.peer for r in await board.read())

    assert asyncio.run(scenario()) == ["b"]


# ---------------------------------------------------------------------- spans


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 64))
def test_span_bounds_partition_exactly(n, parts):
    bounds = span_bounds(n, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (_, hi), (lo, _) in zip(bounds, bounds[1:]):
        assert hi == lo
    sizes = [hi - lo for lo, hi in bounds]
    assert all(s >= 0 for s in sizes)
    assert sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1


def test_span_bounds_examples_and_invalid_parts():
    assert span_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert span_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    for bad in (0, -1):
        with pytest.raises(ValueError):
            span_bounds(10, bad)


def test_make_view_sorts_and_deduplicates():
    assert make_view(["c", "a", "b", "a"]) == ("a", "b", "c")
    assert make_view([]) == ()


def test_view_id_depends_on_members_and_key_not_order():
    key = RoundKey(3, 0)
    base = view_id(key, make_view(["a", "b", "c"]))
    assert view_id(key, make_view(["c", "a", "b"])) == base
    assert view_id(key, make_view(["b", "c", "a", "a"])) == base
    others = {
        view_id(key, make_view(["a", "b"])),
        view_id(key, make_view(["a", "b", "d"])),
        view_id(key, make_view(["a", "b", "c", "d"])),
        view_id(RoundKey(3, 1), make_view(["a", "b", "c"])),
        view_id(RoundKey(4, 0), make_view(["a", "b", "c"])),
        view_id(key, make_view(["ab", "c"])),
    }
    assert base not in others
    assert len(others) == 6
    assert len(base) == 16 and int(base, 16) >= 0


def test_round_key_order_and_str():
    assert RoundKey(1, 5) < RoundKey(2, 0) < RoundKey(2, 1)
    assert str(RoundKey(4)) == "4" and str(RoundKey(4, 2)) == "4.2"


def test_a_source_that_served_bad_state_is_tried_last():
    records = [rec("me", 1, digest="old"), rec("a", 2, digest="new"), rec("b", 2, digest="new")]
    assert resync_source(records, "me", 1, "old")[0].peer == "a"
    assert resync_source(records, "me", 1, "old", exclude=["a"])[0].peer == "b"
    assert resync_source(records, "me", 1, "old", exclude=["a", "b"])[0].peer == "a"  # nobody else has it


# ---------------------------------------------------------------------- vouched


def test_a_served_state_is_vouched_for_by_the_records_that_advertise_its_round():
    a = rec("a", 7, digest="d7", recent=((5, "d5"), (6, "d6"), (7, "d7")))
    b = rec("b", 6, digest="d6")
    assert vouched([a, b], "me", 7, "d7")[0] is True  # the server's record, read after it moved on
    assert vouched([a, b], "me", 6, "d6")[0] is True  # an older state still in a's recent, and b's current
    assert vouched([rec("me", 8, digest="x", recent=((8, "x"),)), b], "me", 8, "x")[0] is None  # ours: no vote
    ok, why = vouched([b], "me", 7, "d7")
    assert ok is None and "round 7" in why  # nobody has published round 7 yet: ask again


def test_a_state_other_peers_contradict_is_refused():
    honest = [rec(p, 4, digest="good", recent=((4, "good"),)) for p in "ab"]
    liar = rec("c", 9, digest="other", recent=((4, "forged"), (9, "other")))
    ok, why = vouched([*honest, liar], "me", 4, "forged")
    assert ok is False and "2 advertise good" in why
    assert vouched([rec("a", 4, digest="x"), rec("b", 4, digest="y")], "me", 4, "x")[0] is False  # a tie is no proof
    assert vouched([*honest, liar], "me", 4, "good")[0] is True


def test_a_peer_votes_once_per_digest_however_often_its_record_lists_it():
    a = rec("a", 3, digest="x", recent=((3, "x"),))
    assert vouched([a, rec("b", 3, digest="y")], "me", 3, "y")[0] is False


# ---------------------------------------------------------------------- banned_by_majority


def _banning(peer: str, *banned: str, status: str = "training") -> PeerRecord:
    return PeerRecord(peer=peer, status=status, round=3, banned=banned)


def test_a_peer_most_others_banned_is_banned_for_a_newcomer_too():
    records = [_banning("new"), _banning("a", "x"), _banning("b", "x"), _banning("c"), _banning("x")]
    assert banned_by_majority(records, "new") == []  # 2 of 4 others: not a strict majority
    records.append(_banning("d", "x"))
    assert banned_by_majority(records, "new") == ["x"]  # 3 of 5


def test_one_peer_alone_bans_nobody_and_nobody_bans_us_or_itself():
    assert banned_by_majority([_banning("me"), _banning("a", "b"), _banning("b")], "me") == []  # 1 voter of 2
    assert banned_by_majority([_banning("me"), _banning("a", "b")], "me") == []  # needs two voters
    records = [_banning("me"), _banning("a", "me", "a"), _banning("b", "me", "b"), _banning("c", "me")]
    assert banned_by_majority(records, "me") == []
    # records of peers not training (left, catching up) do not vote
    records = [_banning("me"), _banning("a", "x", status="left"), _banning("b", "x", status="joining"),
               _banning("c", "x"), _banning("d", "x"), _banning("x")]
    assert banned_by_majority(records, "me") == ["x"]


def test_we_are_voted_out_only_by_a_majority_of_our_last_rounds_members():
    members = ("me", "a", "b", "c")
    assert voted_out({"a", "b"}, members, "me") == (2, 3)  # 2 of the 3 others: a strict majority
    assert voted_out({"a"}, ("me", "a"), "me") == (0, 1)  # one peer alone never bans
    assert voted_out({"a", "b"}, ("me", "a", "b", "c", "d"), "me") == (0, 4)  # 2 of 4: a tie is no majority
    # refusals from peers outside our last round (strangers, newcomers, forged ids) do not count
    assert voted_out({"x", "y", "z", "a"}, members, "me") == (0, 3)
    assert voted_out({"a", "b", "me"}, members, "me") == (2, 3)  # we never vote on ourselves
    assert voted_out({"a", "b"}, None, "me") == (0, 0)  # no committed round yet: nobody to ask
