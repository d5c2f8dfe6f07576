"""Swarm credentials (comms/auth.py): who may call a peer, and that nothing stale is accepted.

Every test has a spy handler that records what reaches it: a refused call must leave it untouched
(0 bytes of an unauthorized request reach any decode). In-process tests drive `InProcTransport`s
with guards; the P2P tests use real hivemind daemons on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import re
import time

import pytest

from diloco.comms import InProcNetwork, PeerId
from diloco.comms import hello as hs
from diloco.comms.auth import (HEAD_SIZE, HELLO, OVERHEAD, WINDOW, AuthRefused, Guard, derive, new_secret, _Window)
from diloco.comms.transport import TransportError
from diloco.config import ConfigError, SwarmConfig

SECRET = "s" * 32
RUN = "auth-test"


class Spy:
    """A handler that records every request it is handed."""

    def __init__(self) -> None:
        self.got: list[bytes] = []

    async def __call__(self, caller: PeerId, data: bytes) -> bytes:
        self.got.append(bytes(data))
        return b"pong:" + data


async def _pair(*, secret_b: str | None = SECRET, run_b: str = RUN, me_b: str = "b", allow=None):
    """Peer a (guarded, spy on "x") and caller b (guarded as configured; secret None: no guard)."""
    net = InProcNetwork()
    a, b = net.transport("a"), net.transport("b")
    a.guard = Guard(SECRET, RUN, PeerId("a"), allow)
    if secret_b is not None:
        b.guard = Guard(secret_b, run_b, PeerId(me_b))
    spy = Spy()
    await a.register("x", spy)
    return net, a, b, spy


# ---------------------------------------------------------------------- the pure parts


@pytest.mark.unit
def test_keys_differ_per_purpose_and_secret():
    keys = {derive(b"a" * 16, "run/r1"), derive(b"a" * 16, "run/r2"), derive(b"a" * 16, "swarm"),
            derive(b"a" * 16, "dht/r1"), derive(b"b" * 16, "run/r1")}
    assert len(keys) == 5 and all(len(k) == 32 for k in keys)
    assert len(new_secret()) >= 40 and new_secret() != new_secret()


@pytest.mark.unit
def test_window_refuses_repeats_and_counters_older_than_the_window():
    w = _Window()
    assert w.fresh(5) and w.fresh(3) and w.fresh(WINDOW + 10)
    assert not w.fresh(5) and not w.fresh(WINDOW + 10)
    assert not w.fresh(9)  # 9 <= highest - WINDOW: too old to tell, refused
    assert w.fresh(WINDOW + 11) and w.fresh(WINDOW + 9)
    for c in range(WINDOW + 12, 4 * WINDOW):
        assert w.fresh(c)
    assert len(w.seen) <= 2 * WINDOW + 1  # bounded memory


@pytest.mark.unit
@pytest.mark.unit
def test_a_secret_file_may_be_named_by_a_string(tmp_path):
    """`diloco.credentials.resolve` takes a path as a str too (a script's, not only the CLI's Path)."""
    from diloco.credentials import resolve

    made, where = resolve(str(tmp_path / "s.secret"), run_id="r", create=True)
    assert where == f"created {tmp_path / 's.secret'}"
    assert resolve(str(tmp_path / "s.secret"), run_id="r", create=False) == (made, str(tmp_path / "s.secret"))


def test_config_keeps_the_secret_out_of_its_repr_and_checks_it():
    cfg = SwarmConfig(secret=SECRET)
    assert SECRET not in repr(cfg) and SECRET not in repr(cfg.guard("me"))
    with pytest.raises(ConfigError, match="at least 16"):
        SwarmConfig(secret="short")
    for bad in ("", "12D3KooWtypo", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"):  # a typo; an RSA id
        with pytest.raises(ConfigError, match="allow_peers must be Ed25519 libp2p peer ids"):
            SwarmConfig(secret=SECRET, allow_peers=(bad,))
    from diloco.comms.identity import Identity
    SwarmConfig(secret=SECRET, allow_peers=(Identity.generate().peer_id,))
    assert SwarmConfig().guard("me") is None  # open (in-process) swarm


@pytest.mark.unit
def test_hello_names_the_first_differing_field_and_ignores_an_unknown_schema():
    ours = hs.hello("run", "abc")
    assert hs.mismatch(ours, hs.unpack(hs.pack(hs.hello("run", "abc")))) is None
    assert hs.mismatch(ours, hs.hello("other", "abc")) == "run_id"
    assert hs.mismatch(ours, hs.hello("run", "xyz")) == "schema"
    assert hs.mismatch(ours, hs.hello("run", "")) is None  # the other side has no model yet
    assert hs.mismatch(ours, {**ours, "protocol": ours["protocol"] + 1}) == "protocol"
    for bad in (b"", b"\xc1", hs.pack({"protocol": "1", "run_id": "r", "schema": ""}), b"x" * 2000):
        with pytest.raises(ValueError):
            hs.unpack(bad)
    assert hs.unpack(hs.pack(hs.hello("run", "abc", now=5.0)))["time"] == 5.0
    for bad_time in ("5", True, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="time"):
            hs.unpack(hs.pack({**hs.hello("run", ""), "time": bad_time}))
    err = hs.HandshakeError("secret", SECRET, SECRET, "peer")
    assert SECRET not in str(err) and "secret differs" in str(err)


# ---------------------------------------------------------------------- in-process: who gets in


@pytest.mark.swarm
def test_authorized_call_reaches_the_handler_once_and_its_reply_is_authentic():
    async def main():
        net, a, b, spy = await _pair()
        r1 = await b.call(PeerId("a"), "x", b"hello", 1)
        r2 = await b.call(PeerId("a"), "x", b"again", 1)
        return r1, r2, spy.got, a.guard.refused, a.counter.received, b.counter.sent

    r1, r2, got, refused, received, sent = asyncio.run(main())
    assert (r1, r2) == (b"pong:hello", b"pong:again") and got == [b"hello", b"again"]
    # first contact: b did not know a's session yet, so one signed "use this session" reply and a retry
    assert dict(refused) == {"stale_session": 1}
    assert received == sent == 3 * OVERHEAD + 2 * len(b"hello") + len(b"again")


@pytest.mark.swarm
@pytest.mark.parametrize("case", ["no key", "wrong key", "wrong run", "forged sender id"])
def test_unauthorized_callers_never_reach_the_handler(case):
    kw = {"no key": dict(secret_b=None), "wrong key": dict(secret_b="w" * 32),
          "wrong run": dict(run_b="another-run"), "forged sender id": dict(me_b="a-member")}[case]

    async def main():
        net, a, b, spy = await _pair(**kw)
        try:
            reply = await b.call(PeerId("a"), "x", b"payload" * 100, 1)
        except AuthRefused as e:
            reply = e.reason
        return reply, spy.got, dict(a.guard.refused)

    reply, got, refused = asyncio.run(main())
    assert got == []
    if case == "no key":  # a caller without a guard gets the bare refusal envelope back
        assert isinstance(reply, bytes) and len(reply) == HEAD_SIZE and reply[:4] == b"DLA1"
        assert refused == {"unauthorized": 1}
    else:
        assert reply == "unauthorized" and refused == {"unauthorized": 1}


@pytest.mark.swarm
def test_allowlist_refuses_others_before_anything_is_checked():
    async def main():
        net, a, b, spy = await _pair(allow=frozenset({"c"}))
        with pytest.raises(AuthRefused, match="not_allowed"):
            await b.call(PeerId("a"), "x", b"hi", 1)
        with pytest.raises(TransportError, match="allowlist"):  # nor does a call anyone off its list
            await a.call(PeerId("b"), "x", b"hi", 1)
        return spy.got, dict(a.guard.refused)

    got, refused = asyncio.run(main())
    assert got == [] and refused == {"not_allowed": 1}


@pytest.mark.swarm
def test_a_refused_handshake_names_the_setting_only_when_a_setting_was_refused():
    """A joiner's hello refused as unauthorized names the secret, as not allowed the allowlist; a refusal that says
    nothing about its settings (a replay, a malformed call) is raised as the refusal it is, not as an allowlist."""
    from diloco.connect import hello

    cfg = SwarmConfig(run_id=RUN, secret=SECRET)

    async def field_of(**pair) -> str:
        net, a, b, spy = await _pair(**pair)
        await a.register(HELLO, spy)
        with pytest.raises(hs.HandshakeError) as e:
            await hello(b, PeerId("a"), cfg, "")
        assert spy.got == []
        return e.value.field

    assert asyncio.run(field_of(secret_b="t" * 32)) == "secret"
    assert asyncio.run(field_of(allow=frozenset({"c"}))) == "allowlist"

    class Refusing:
        def __init__(self, reason: str) -> None:
            self.reason = reason

        async def call(self, peer, name, data, timeout):
            raise AuthRefused(self.reason, peer)

    for reason in ("replay", "malformed"):
        with pytest.raises(AuthRefused, match=reason):
            asyncio.run(hello(Refusing(reason), PeerId("a"), cfg, ""))  # type: ignore[arg-type]


@pytest.mark.unit
def test_the_schema_handshake_asks_again_while_no_peer_answered_and_then_names_the_field():
    """A joiner's schema handshake whose first pass nobody answered (a loaded machine: the peer answered its join
    moments before) asks again, and a mismatch in a later answer is raised naming the field; a peer that never
    answers is skipped after `HANDSHAKE_TRIES` passes (the frame checks still refuse a mismatched schema), and one
    answer is enough (the silent others are skipped at once, as before)."""
    import time

    from diloco.comms.transport import TransportError
    from diloco.connect import HANDSHAKE_TRIES, handshake

    cfg = SwarmConfig(run_id=RUN, secret=SECRET)

    class Peers:
        def __init__(self, silent: dict[str, int], model: str = "their-model") -> None:
            self.silent, self.model, self.calls = silent, model, []  # peer -> passes it does not answer (-1: never)

        async def call(self, peer, name, data, timeout):
            self.calls.append(str(peer))
            left = self.silent.get(str(peer), 0)
            if left:
                self.silent[str(peer)] = left - 1
                raise TransportError(f"call {name!r} to {peer} timed out")
            return hs.pack({**hs.hello(RUN, self.model, time.time()),
                            "field": "schema" if self.model != "our-model" else ""})

    late = Peers({"a": 1})
    with pytest.raises(hs.HandshakeError) as e:
        asyncio.run(handshake(late, [PeerId("a")], cfg, "our-model"))  # type: ignore[arg-type]
    assert e.value.field == "schema" and late.calls == ["a", "a"]
    never = Peers({"a": -1})
    asyncio.run(handshake(never, [PeerId("a")], cfg, "our-model"))  # type: ignore[arg-type]
    assert never.calls == ["a"] * HANDSHAKE_TRIES
    one = Peers({"a": -1}, model="our-model")
    asyncio.run(handshake(one, [PeerId("a"), PeerId("b")], cfg, "our-model"))  # type: ignore[arg-type]
    assert sorted(one.calls) == ["a", "b"]  # b agreed: no second pass for a


@pytest.mark.swarm
def test_a_joiner_whose_handshake_nobody_answered_asks_its_first_rounds_peers_and_stops_on_a_mismatch():
    """A joiner whose schema handshake went unanswered in every pass (the peer it dialed is gone) does not train on
    alone into refused frames: its round asks that round's peers first, and another schema raises `HandshakeError`
    out of the round, naming the field; the same schema clears the question and the round commits with them."""
    import torch

    import diloco
    from diloco.comms import RoundKey
    from diloco.comms.loop import LoopThread
    from diloco.peers import InProcBoard

    cfg = SwarmConfig(run_id=RUN, secret=SECRET, heartbeat_interval=0.1, heartbeat_ttl=5).with_round(
        gather_timeout=20, reduce_timeout=10, result_timeout=15, call_timeout=10)
    net, board, loop = InProcNetwork(), InProcBoard(), LoopThread()
    made: list[diloco.Swarm] = []

    def peer(name: str, schema: str, *, dialed: str | None = None) -> diloco.Swarm:
        s = diloco.Swarm.in_process(net, board, name, cfg, loop, bootstrapped=dialed is not None)
        made.append(s)
        if dialed is not None:
            s.bootstrap_peers = [PeerId(dialed)]  # the peer it joined through: not on the network any more
        s.handshake(schema)
        s.update(status="training", round=0)
        return s

    def run(s: diloco.Swarm, rnd: int):  # type: ignore[no-untyped-def]
        return s.exchange_async(rnd, 0, "d" * 64, torch.zeros(4))

    try:
        member = peer("member", "their-model")
        wrong = peer("wrong", "our-model", dialed="gone")
        assert wrong.unverified and not member.unverified
        with pytest.raises(hs.HandshakeError) as e:
            wrong.finish_exchange(run(wrong, 0), RoundKey(0))
        assert e.value.field == "schema" and wrong.unverified
        assert member.collective.rejections["wrong_schema"] == 1  # its hello, counted; no frame of it was sent
        wrong.close()
        right = peer("right", "their-model", dialed="gone")
        assert right.unverified
        ours, theirs = run(right, 0), run(member, 0)
        outcome = right.finish_exchange(ours, RoundKey(0))
        assert outcome.committed and sorted(outcome.view) == ["member", "right"], outcome
        assert member.finish_exchange(theirs, RoundKey(0)).committed and not right.unverified
    finally:
        for s in made:
            s.close()
        loop.stop()


@pytest.mark.unit
def test_a_join_refused_for_another_reason_says_it_was_let_in_by_no_one_not_that_no_one_answered(monkeypatch):
    import diloco.connect as connect

    def refused(*_args, **_kwargs):
        raise AuthRefused("replay", PeerId("12D3KooWpeer"))

    monkeypatch.setattr(connect, "_open", refused)
    monkeypatch.setattr(connect, "JOIN_PAUSE", 0.0)
    with pytest.raises(connect.SwarmError) as e:
        connect.join(["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWpeer"], SwarmConfig(run_id=RUN, secret=SECRET))
    said = str(e.value)
    assert "no bootstrap address let us in" in said and "refused the call: replay" in said, said
    assert "answers nothing" not in said  # it answered


# ---------------------------------------------------------------------- replays


async def _record(b, peer: str, name: str, body: bytes) -> list[bytes]:
    """Call `peer` through b's guard and return every request envelope b put on the wire."""
    sent: list[bytes] = []

    async def send(data: bytes) -> bytes:
        sent.append(data)
        return await b._send(PeerId(peer), name, data, 1)

    await b.guard.call(name, PeerId(peer), body, send)
    return sent


@pytest.mark.swarm
def test_a_replayed_request_is_refused_and_reaches_the_handler_once():
    async def main():
        net, a, b, spy = await _pair()
        sent = await _record(b, "a", "x", b"contribution")
        replay = await b._send(PeerId("a"), "x", sent[-1], 1)  # the exact bytes again
        return replay, spy.got, dict(a.guard.refused)

    replay, got, refused = asyncio.run(main())
    assert got == [b"contribution"]
    assert replay[:4] == b"DLA1" and len(replay) == HEAD_SIZE and refused["replay"] == 1


@pytest.mark.swarm
def test_a_request_recorded_before_the_receiver_restarted_is_refused_after_it():
    async def main():
        net, a, b, spy = await _pair()
        sent = await _record(b, "a", "x", b"round 5 contribution")
        net.kill("a")  # a restarts: same peer id, new process (new session), empty memory
        a2 = net.transport("a")
        a2.guard = Guard(SECRET, RUN, PeerId("a"))
        spy2 = Spy()
        await a2.register("x", spy2)
        replay = await b._send(PeerId("a"), "x", sent[-1], 1)
        # the replay got a signed "use this session" reply, not the handler; a fresh call still works
        fresh = await b.call(PeerId("a"), "x", b"round 6 contribution", 1)
        return replay, spy2.got, fresh, dict(a2.guard.refused)

    replay, got, fresh, refused = asyncio.run(main())
    assert got == [b"round 6 contribution"] and fresh == b"pong:round 6 contribution"
    assert replay[4] == 3  # SESSION
    assert refused["stale_session"] == 2  # the replay, then b's first (cached-session) fresh call


@pytest.mark.swarm
def test_tampered_bytes_anywhere_in_a_request_are_refused():
    async def main():
        net, a, b, spy = await _pair()
        sent = await _record(b, "a", "x", b"A" * 200)
        refusals = 0
        for pos in (0, 5, 20, 45, HEAD_SIZE + 3, HEAD_SIZE + 150, len(sent[-1]) - 1):
            bad = bytearray(sent[-1])
            bad[pos] ^= 0x40
            reply = await b._send(PeerId("a"), "x", bytes(bad), 1)
            refusals += reply[4] == 4  # REFUSED
        return refusals, spy.got

    refusals, got = asyncio.run(main())
    assert refusals == 7 and got == [b"A" * 200]


# ---------------------------------------------------------------------- the round protocol under guards


@pytest.mark.swarm
def test_guarded_swarm_commits_and_frames_of_other_rounds_are_still_refused():
    """Authentication sits under the frame checks: an authentic frame of a past or far-future round
    is still refused (wrong_round), never aggregated."""
    import torch

    from diloco.comms import Collective, CollectiveConfig, RoundKey
    from diloco.comms import messages as msg

    # every peer delivers: the owners' and results' deadlines only bound the round (a suite worker starved of its core
    # for a moment must not make an owner average without a contribution, as one did in tests/test_collective.py)
    cfg = CollectiveConfig(gather_timeout=0.5, reduce_timeout=10.0, result_timeout=20.0, call_timeout=1.0)

    async def main():
        net = InProcNetwork()
        ts = {p: net.transport(p) for p in ("p0", "p1", "p2")}
        for p, t in ts.items():
            t.guard = Guard(SECRET, RUN, PeerId(p))
        cs = {p: await Collective.create(t, RUN, cfg) for p, t in ts.items()}
        deltas = {p: torch.full((30,), float(i)) for i, p in enumerate(cs)}
        outs = await asyncio.gather(*(cs[p].run_round(RoundKey(3), "d" * 8, list(cs), deltas[p]) for p in cs))
        replies = []
        for k in (RoundKey(1), RoundKey(9)):
            frame = msg.encode(msg.CONTRIB, run=RUN, sender="p1", key=k, view="v" * 16, span=0, codec="fp32",
                               numel=10, body=bytes(40))
            replies.append(msg.read_ack(await ts["p1"].call(PeerId("p0"), "diloco.contrib", frame, 1), run=RUN,
                                        caller="p0"))
        return outs, replies, cs["p0"].rejections

    outs, replies, rejections = asyncio.run(main())
    assert all(o.committed for o in outs)
    assert all(torch.equal(o.aggregate, torch.full((30,), 1.0)) for o in outs)
    assert [r["reason"] for r in replies] == ["wrong_round", "wrong_round"] and rejections["wrong_round"] == 2


# ---------------------------------------------------------------------- real daemons


@pytest.mark.multiproc
def test_p2p_refuses_an_unauthorized_caller_after_the_head_without_reading_its_body():
    """A caller with the wrong key declaring a 64 MB request: refused after 56 bytes, body never read,
    handler never called; an authorized caller on the same daemon is served. The caller's next refusal
    is held (the tarpit) while others are served at once; once it has the key it is served at once."""
    from diloco.comms.p2p import P2PTransport
    from diloco.comms.tarpit import Tarpit, TarpitConfig

    hold = 2.0

    async def timed(coro):
        t0 = time.perf_counter()
        try:
            return await coro, time.perf_counter() - t0
        except TransportError as e:
            return e, time.perf_counter() - t0

    async def main():
        a = await P2PTransport.create()
        good = await P2PTransport.create(initial_peers=await a.visible_addresses())
        bad = await P2PTransport.create(initial_peers=await a.visible_addresses())
        try:
            a.guard = Guard(SECRET, RUN, a.peer_id)
            a.guard.tarpit = Tarpit(TarpitConfig(hold=hold))
            good.guard = Guard(SECRET, RUN, good.peer_id)
            bad.guard = Guard("w" * 32, RUN, bad.peer_id)
            spy = Spy()
            await a.register("x", spy)
            reply = await good.call(a.peer_id, "x", b"ok", 10)
            # the refusal closes the stream under the unfinished upload: the caller sees a reset or the refusal
            first, first_s = await timed(bad.call(a.peer_id, "x", os.urandom(64 << 20), 30))
            # again, small (it reads the refusal), while an authorized call is made during the hold
            (second, second_s), (during, during_s) = await asyncio.gather(
                timed(bad.call(a.peer_id, "x", b"hi", 30)), timed(good.call(a.peer_id, "x", b"during", 10)))
            bytes_read = a.counter.per_peer[bad.peer_id][1]
            bad.guard = Guard(SECRET, RUN, bad.peer_id)  # it gets the secret: same peer id, served at once
            fixed, fixed_s = await timed(bad.call(a.peer_id, "x", b"fixed", 10))
            return dict(reply=reply, got=spy.got, bytes_read=bytes_read, refused=dict(a.guard.refused),
                        first=first, first_s=first_s, second=second, second_s=second_s, during=during,
                        during_s=during_s, fixed=fixed, fixed_s=fixed_s, held=a.guard.tarpit.held_total)
        finally:
            for t in (a, good, bad):
                await t.close()

    r = asyncio.run(main())
    assert r["reply"] == b"pong:ok" and sorted(r["got"]) == [b"during", b"fixed", b"ok"]
    assert r["refused"]["unauthorized"] == 2
    assert r["bytes_read"] == 2 * (8 + HEAD_SIZE)  # length prefix and head: nothing more
    assert isinstance(r["first"], TransportError) and r["first_s"] < hold
    assert isinstance(r["second"], AuthRefused) and "unauthorized" in str(r["second"]) and r["second_s"] >= hold
    assert r["held"] == 1
    assert r["during"] == b"pong:during" and r["during_s"] < hold
    assert r["fixed"] == b"pong:fixed" and r["fixed_s"] < hold


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_cli_join_refused_at_handshake_exits_nonzero_naming_the_field(tmp_path, monkeypatch):
    """A running `diloco start`; `diloco join` with a wrong secret, run id or model, or from a machine
    whose clock is 400 s off (beyond the 300 s a joiner may be off and adopt the swarm's time), exits 1 naming the field (and the secret is never printed); without
    any secret it exits 2 saying how to pass one.
    The running peer trains on, and counted the refusals. The joiners refused at the handshake, before they train (a
    wrong secret or run id), are the real command in this process (`cli_util.invoke`, each with its own daemon); those
    refused later or with a skewed clock are processes of their own."""
    import json
    import subprocess
    import sys

    from cli_util import invoke
    from multiproc_util import TINY, Peers

    group = Peers(tmp_path, "hs-run")
    try:
        group.spawn(0, ["start", "--rounds", "1000", "-H", "10", *TINY])
        addr = group.address(0)
        base = [sys.executable, "-m", "diloco", "join", addr, "--rounds", "1", "-H", "2"]
        cases = [
            ("secret", [*TINY, "--run-id", "hs-run"], {"DILOCO_SECRET": "w" * 32}, 1, "the swarm secret differs"),
            ("run_id", [*TINY, "--run-id", "hs-other"], {}, 1, "run_id differs"),
            ("schema", [*TINY[:1], "48", *TINY[2:], "--run-id", "hs-run"], {}, 1, "schema differs"),
            ("clock", [*TINY, "--run-id", "hs-run"], {}, 1, "its clock is "),  # this machine runs 400 s fast
        ]
        skewed = [sys.executable, "-c", "import time; t = time.time; time.time = lambda: t() + 400; "
                  "from diloco.cli.main import main; main()", *base[3:]]
        seconds = {}
        monkeypatch.chdir(tmp_path)  # where a secret file of the run would be looked for: there is none
        for name, args, env, code, needle in cases:
            environ = {"DILOCO_SECRET": group.secret, **env}
            t0 = time.monotonic()
            if name in ("secret", "run_id"):  # a `subprocess.CompletedProcess` of the command run in this process
                ran = invoke([*base[3:], *args], env=environ)
                assert ran.exception is None or isinstance(ran.exception, SystemExit), (name, ran.exception)
                proc = subprocess.CompletedProcess(base, ran.exit_code, ran.stdout, ran.stderr)
            else:
                proc = subprocess.run([*(skewed if name == "clock" else base), *args], capture_output=True, text=True,
                                      timeout=90, env={**os.environ, **environ}, cwd=tmp_path)
            seconds[name] = round(time.monotonic() - t0, 1)
            assert proc.returncode == code, (name, proc.stderr[-2000:])
            assert needle in proc.stderr, (name, proc.stderr[-2000:])
            if name == "clock":  # 400 s, give or take half the handshake's round trip (long on a busy machine)
                said = re.search(r"its clock is ([0-9.]+) s behind", proc.stderr)
                assert said is not None and abs(float(said.group(1)) - 400) < 5, proc.stderr[-2000:]
            assert group.secret not in proc.stdout + proc.stderr and "w" * 32 not in proc.stderr
        print("seconds from launch to exit:", json.dumps(seconds))
        # no secret at all: refused before any network I/O
        none = invoke(["join", addr, "--rounds", "1", "-H", "2", *TINY, "--run-id", "hs-run"],
                      env={"DILOCO_SECRET": None})
        assert none.exit_code == 2 and "--secret-file" in none.stderr, none.stderr
        assert group.procs[0].poll() is None  # the swarm's peer is unharmed
        log = (tmp_path / "peer0.log").read_text(errors="replace")
        assert "event=handshake_refused" in log and "field=run_id" in log and "field=schema" in log
        assert group.secret not in log
    finally:
        group.kill_all()


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_flood_bench_reads_only_heads_from_flooders_and_nothing_reaches_the_rounds():
    """`diloco bench flood` in small: every flooding call is refused after its 64 bytes (length prefix
    and head), none reaches the round protocol, and the swarm commits every round meanwhile. Every
    refusal but each flooder's first at each peer is held by the tarpit."""
    from diloco.bench.flood import FloodSetup, run

    ticks: list[tuple] = []
    report = run(FloodSetup(peers=2, numel=4096, rounds=3, flooders=1, concurrency=2, body_kib=64, pin=False),
                 progress=lambda _: None, tick=lambda *t: ticks.append(t))
    assert ticks[-1] == (3 + 3 * 3, 12, "quiet again")  # every round, warm-up included, was shown
    assert report["refused_unauthorized"] > 0
    assert report["bytes_read_from_flooders"] == (8 + HEAD_SIZE) * report["refused_unauthorized"]
    assert report["rejections_reaching_collective"] == 0
    assert report["refused_unauthorized"] - report["refusals_held"] == 1 * 2  # flooders x peers: first offences
    assert report["median_round_s"]["flooded"] > 0
    assert report["flooded_rounds_failed"] == []
    assert report["daemon_rss_peak_mib"]["quiet"] > 1 and report["daemon_rss_peak_mib"]["flooded"] > 1  # read from /proc


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stalled", [0, 40])
def test_flood_bench_at_the_data_port_refuses_every_stranger_while_the_rounds_go_direct(stalled):
    """`diloco bench flood --target data` in small: the rounds go on the direct data plane (none through libp2p),
    and a flooder at the peers' data ports either makes calls (each a handshake proving another swarm's key, then
    junk: every one refused as unauthorized, none reaching the round protocol) or holds silent connections (cut
    at the handshake deadline); every round commits meanwhile."""
    from diloco.bench.flood import FloodSetup, markdown, run

    report = run(FloodSetup(peers=2, numel=4096, rounds=3, flooders=1, concurrency=2, body_kib=16, pin=False,
                            stalled=stalled, target="data"), progress=lambda _: None)
    assert report["flooded_rounds_failed"] == [] and report["rejections_reaching_collective"] == 0
    assert report["rounds_via_libp2p"] == 0
    if stalled:
        assert report["stalled_opened"] == 2 * stalled
        assert sum(report["streams_cut"].values()) > 0, report  # slow_head after HELLO_TIMEOUT, or the caps
        assert "connections to the data port" in markdown(report)
    else:
        # a call still in flight when the flooder stopped may have been refused after it counted it, or not at all
        assert report["flood_calls"] > 0 and abs(report["refused_unauthorized"] - report["flood_calls"]) <= 2 * 2
        assert set(report["refused"]) == {"data_unauthorized"}, report["refused"]
        assert "at the data port" in markdown(report)


@pytest.mark.unit
def test_the_clock_offset_is_bounded_by_the_round_trip_and_a_skewed_peer_is_named():
    # their clock read 1000.0 while ours went from 900.0 to 900.4: they are 99.8 s ahead, ± 0.2 s
    assert hs.clock_offset(900.0, 900.4, 1000.0) == pytest.approx((99.8, 0.2))
    assert hs.clock_offset(900.0, 900.0, 880.0) == (-20.0, 0.0)
    err = hs.ClockSkew(-400.0, 0.05, hs.MAX_CLOCK_SKEW, "12D3KooWpeer")
    assert err.field == "clock" and isinstance(err, hs.HandshakeError)
    assert "its clock is 400.0 s behind this machine's (±0.05 s); a joining peer's clock must be within 300 s" in str(err)
    assert "NTP" in str(err)


@pytest.mark.unit
def test_every_rejection_and_refusal_reason_has_a_troubleshooting_row():
    """docs/TROUBLESHOOTING.md's tables name every reason a frame is rejected, a call refused or a
    directory record dropped (an operator who sees one in a log finds what it means and what to do)."""
    from pathlib import Path

    from diloco.comms.auth import REASONS
    from diloco.comms.streamgate import CUTS
    from diloco.compression import Reason
    from diloco.peers.signing import REASONS as RECORD_REASONS

    readme = (Path(__file__).resolve().parents[1] / "docs" / "TROUBLESHOOTING.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ")]
    missing = [r for r in [*(x.value for x in Reason), *REASONS.values(), "stale_session", *CUTS]
               if not any(f"`{r}`" in row or f"reason={r}" in row for row in rows)]
    record_rows = [row for row in rows if "record_refused" in row]
    missing += [r for r in [*RECORD_REASONS, "not_allowed", "malformed_record"] if not any(f"`{r}`" in row or f"reason={r}" in row
                                                                            for row in record_rows)]
    assert not missing, f"no troubleshooting row names {missing}"
