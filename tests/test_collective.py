"""The round collective (comms/collective.py) driven directly over in-process transports.

All peers of a test live in one asyncio event loop (`asyncio.run` in the test); no wrapper, no
threads. Failures are injected by killing transports on the `InProcNetwork` and by wrapping
handlers in `InProcTransport.handlers`; hostile frames are built with `comms.messages.encode`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace

import pytest
import torch

from diloco.comms import Collective, CollectiveConfig, InProcNetwork, RoundKey, span_bounds, view_id
from diloco.comms import decide
from diloco.comms import messages as msg
from diloco.comms.spans import make_view, member_token
from diloco.compression import Reason, get_codec

pytestmark = pytest.mark.swarm

RUN = "coll"
DIGEST = "d" * 16
PEERS = ["p0", "p1", "p2", "p3"]
# Everyone shows up at once in these tests, so the gather never waits; only tests that are about a
# missing peer wait for gather_timeout, and only the dead-owner test waits for result_timeout.
FAST = CollectiveConfig(gather_timeout=0.5, reduce_timeout=0.5, result_timeout=1.0, call_timeout=1.0)
PATIENT = replace(FAST, reduce_timeout=8.0, result_timeout=10.0)  # deadlines a dead member's probes must beat by far
EVERYONE = PATIENT
"""For rounds where every member is there and delivers: the owners' and results' deadlines only bound them, so a
worker of the suite starved of its core for a moment (an exchange of in-process peers took 0.77 s once, against
FAST's 0.5 s reduce deadline: the owner averaged its own contribution alone) cannot change what a test sees."""


async def _collectives(net: InProcNetwork, ids, cfg: CollectiveConfig = EVERYONE) -> dict[str, Collective]:
    return {p: await Collective.create(net.transport(p), RUN, cfg) for p in ids}


def _deltas(ids, numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {p: torch.randn(numel, generator=g) for p in ids}


def _once_both_answered(net: InProcNetwork, peers: tuple[str, str], handler: str, caller: str, then) -> None:
    """Wrap `handler` at both `peers`: once each of them answered a call from `caller`, `then()`."""
    heard: set[str] = set()
    for p in peers:
        inner = net.lookup(p).handlers[handler]

        async def noted(who, data, p=p, inner=inner):
            reply = await inner(who, data)
            if who == caller:
                heard.add(p)
                if len(heard) == len(peers):
                    then()
            return reply
        net.lookup(p).handlers[handler] = noted


async def _round(cs: dict[str, Collective], key: RoundKey, expected, deltas, members=None):
    members = list(cs) if members is None else members
    outs = await asyncio.gather(*(cs[p].run_round(key, DIGEST, list(expected), deltas[p]) for p in members))
    return dict(zip(members, outs))


def _mean(deltas, ids) -> torch.Tensor:
    return torch.stack([deltas[p] for p in ids]).mean(0)


# ---------------------------------------------------------------------- everyone present


def test_four_peers_fp32_commit_the_mean_bit_identically():
    numel = 1001  # not divisible by 4: spans of 251, 250, 250, 250

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS)
        deltas = _deltas(PEERS, numel)
        return deltas, await _round(cs, RoundKey(0), PEERS, deltas), cs

    deltas, outs, cs = asyncio.run(main())
    mean = _mean(deltas, PEERS)
    first = outs["p0"].aggregate
    for p, o in outs.items():
        assert o.committed, o.reason
        assert o.reason == "committed"
        assert o.key == RoundKey(0)
        assert o.view == tuple(PEERS)
        assert o.contributors == [tuple(PEERS)] * 4
        assert o.aggregate.shape == (numel,) and o.aggregate.dtype == torch.float32
        assert torch.equal(o.aggregate, first)
        assert o.bytes_sent > 0 and o.bytes_received > 0
        assert not cs[p].rejections
        # where the round's time went: each step it took, in order, within the round's own time
        assert list(o.phases) == ["gather", "encode", "exchange", "decide"], o.phases
        assert all(t >= 0 for t in o.phases.values()) and sum(o.phases.values()) <= o.seconds
    assert torch.allclose(first, mean, rtol=0, atol=1e-6)
    # each peer ships 3/4 of its Δ to the other owners and its span's mean to 3 peers, in fp32
    assert all(o.bytes_sent >= 4 * numel * 3 // 4 for o in outs.values())


def test_each_contribution_and_result_is_measured_once(monkeypatch):
    """An owner measures a contribution's norm once, when it admits it, and its robust mean reuses that norm: over
    a round every peer's Δ is measured once as contributions (numel values a peer) and every span's result once
    on each peer, 8 × numel values for 4 peers, not 12 × numel as when the mean measured them again."""
    from diloco.comms import robust
    measured: list[int] = []
    plain = robust.norm

    def counted(part):
        measured.append(part.values.numel())
        return plain(part)
    monkeypatch.setattr(robust, "norm", counted)
    numel = 1001

    async def main():
        cs = await _collectives(InProcNetwork(), PEERS)
        deltas = _deltas(PEERS, numel)
        return deltas, await _round(cs, RoundKey(0), PEERS, deltas)

    deltas, outs = asyncio.run(main())
    assert all(o.committed for o in outs.values())
    assert torch.allclose(outs["p0"].aggregate, _mean(deltas, PEERS), rtol=0, atol=1e-6)
    assert sum(measured) == 2 * len(PEERS) * numel, measured


@pytest.mark.parametrize("compression", ["fp32", "topk:64/256"])
def test_contributions_count_by_their_weights_bit_identically_on_every_peer(compression):
    """Workers of unequal speed: p0..p3 trained 1, 2, 4 and 4 steps' worth; every span's mean is Σ wᵢ·Δᵢ / Σ wᵢ
    (per coordinate over those that sent it, for top-k), the same bits on every peer, and a result says what it
    was weighted by. Equal weights (the default) stay the plain mean."""
    numel, weights = 1001, {"p0": 1, "p1": 2, "p2": 4, "p3": 4}

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS, replace(FAST, compression=compression, result_timeout=5.0,
                                                     reduce_timeout=4.0))
        deltas = _deltas(PEERS, numel, seed=21)
        outs = await asyncio.gather(*(cs[p].run_round(RoundKey(0), DIGEST, PEERS, deltas[p], weight=weights[p])
                                      for p in PEERS))
        return deltas, dict(zip(PEERS, outs)), cs

    deltas, outs, cs = asyncio.run(main())
    first = outs["p0"].aggregate
    for p, o in outs.items():
        assert o.committed, o.reason
        assert torch.equal(o.aggregate, first) and not cs[p].rejections
    if compression == "fp32":
        expected = sum(weights[p] * deltas[p] for p in PEERS) / sum(weights.values())
        assert torch.allclose(first, expected, rtol=0, atol=1e-6)
        assert not torch.allclose(first, _mean(deltas, PEERS), rtol=0, atol=1e-3)  # not the plain mean
    else:  # each coordinate over the peers whose top-k held it, by their weights
        n = 256  # span 0: spans are aligned to top-k's chunks
        held = [(p, cs[p].pipeline.decode(cs[p].pipeline.encode(deltas[p][:n]), n)) for p in PEERS]
        total, mass = torch.zeros(n), torch.zeros(n)
        for p, part in held:
            total.index_add_(0, part.indices, part.values * weights[p])
            mass.index_add_(0, part.indices, torch.full_like(part.values, weights[p]))
        expected = torch.where(mass > 0, total / mass.clamp(min=1e-30), total)
        assert torch.allclose(first[:n], expected, rtol=0, atol=1e-6)


def test_a_weight_above_max_weight_times_the_lowest_is_refused_and_counted():
    """p3 claims 100 times the work of the slowest: each owner refuses its contributions (counted, logged, marked:
    a strike when the round commits) and averages the others by their weights. A weight that is no positive
    number is refused at the frame."""
    weights = {"p0": 1, "p1": 2, "p2": 2, "p3": 100}

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS, replace(FAST, result_timeout=5.0, reduce_timeout=4.0))
        deltas = _deltas(PEERS, 400, seed=22)
        outs = await asyncio.gather(*(cs[p].run_round(RoundKey(0), DIGEST, PEERS, deltas[p], weight=weights[p])
                                      for p in PEERS))
        x = net.transport("x")
        bad = msg.encode(msg.CONTRIB, run=RUN, sender="x", key=RoundKey(1), view="v", span=0, numel=1,
                         codec=cs["p0"].pipeline.name, meta={"weight": 0.5})
        refused = msg.read_ack(await x.call("p0", "diloco.contrib", bad, 1), run=RUN, caller="p0")
        return deltas, dict(zip(PEERS, outs)), cs, refused

    deltas, outs, cs, refused = asyncio.run(main())
    honest = ["p0", "p1", "p2"]
    expected = sum(weights[p] * deltas[p] for p in honest) / sum(weights[p] for p in honest)
    for p, o in outs.items():
        assert o.committed, o.reason
        assert torch.allclose(o.aggregate, expected, rtol=0, atol=1e-6)
        assert all(c == tuple(honest) for c in o.contributors), o.contributors
        assert o.offenders == ("p3",)  # every owner marked it: a strike
    assert all(c.robust_events["overweight"] == 1 for c in cs.values())  # every owner, p3 itself too
    assert refused["ok"] is False and refused["reason"] == "bad_header"


def test_fp16_wire_identical_across_peers_within_fp16_error():
    numel = 4099
    cfg = replace(EVERYONE, compression="fp16")

    async def main():
        net16, net32 = InProcNetwork(), InProcNetwork()
        deltas = _deltas(PEERS, numel, seed=1)
        o16 = await _round(await _collectives(net16, PEERS, cfg), RoundKey(0), PEERS, deltas)
        o32 = await _round(await _collectives(net32, PEERS), RoundKey(0), PEERS, deltas)
        return deltas, o16, o32

    deltas, o16, o32 = asyncio.run(main())
    mean = _mean(deltas, PEERS)
    first = o16["p0"].aggregate
    for o in o16.values():
        assert o.committed, o.reason
        assert torch.equal(o.aggregate, first)
    # the values went through fp16: every value is exactly representable in fp16 ...
    assert torch.equal(first.half().float(), first)
    assert not torch.equal(first, mean)
    # ... and within two fp16 roundings (contribution, then mean) of the fp32 mean: 2^-11 relative
    bound = 2 * 2.0 ** -11 * max(d.abs().max().item() for d in deltas.values()) + 1e-6
    assert (first - mean).abs().max().item() <= bound
    # and half the bytes of fp32 for the bodies
    assert sum(o.bytes_sent for o in o16.values()) < 0.7 * sum(o.bytes_sent for o in o32.values())


def test_consecutive_rounds_and_attempts_commit():
    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS[:3])
        results = []
        for i, key in enumerate([RoundKey(0), RoundKey(1, 3), RoundKey(2), RoundKey(3, 1)]):
            deltas = _deltas(PEERS[:3], 64, seed=10 + i)
            outs = await _round(cs, key, PEERS[:3], deltas)
            results.append((key, deltas, outs))
        return results

    for key, deltas, outs in asyncio.run(main()):
        for o in outs.values():
            assert o.committed and o.key == key
            assert torch.allclose(o.aggregate, _mean(deltas, PEERS[:3]), rtol=0, atol=1e-6)


def test_round_keys_must_grow():
    async def main():
        net = InProcNetwork()
        c = (await _collectives(net, ["solo"]))["solo"]
        out = await c.run_round(RoundKey(2), DIGEST, [], torch.ones(4))
        with pytest.raises(ValueError, match="older"):
            await c.run_round(RoundKey(1, 9), DIGEST, [], torch.ones(4))
        return out

    out = asyncio.run(main())
    assert out.committed and out.view == ("solo",) and torch.equal(out.aggregate, torch.ones(4))


def test_peers_with_different_digests_form_separate_views():
    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS)
        deltas = _deltas(PEERS, 40, seed=3)
        digest = {"p0": "A", "p1": "A", "p2": "B", "p3": "B"}
        outs = await asyncio.gather(*(cs[p].run_round(RoundKey(0), digest[p], PEERS, deltas[p]) for p in PEERS))
        return deltas, dict(zip(PEERS, outs))

    deltas, outs = asyncio.run(main())
    for group in (["p0", "p1"], ["p2", "p3"]):
        for p in group:
            assert outs[p].committed and outs[p].view == tuple(group)
            assert torch.allclose(outs[p].aggregate, _mean(deltas, group), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- a peer that never shows up


def test_expected_peer_that_never_gets_ready_is_left_out_after_gather_timeout():
    """p3 is up (its handlers answer) but never starts the round, e.g. hung in its inner steps: the
    others wait for it until gather_timeout, then commit among themselves."""
    present = PEERS[:3]

    async def main():
        net = InProcNetwork()
        # p3 exists but does not call run_round; the exchange's deadlines far beyond the gather's (PATIENT), so the
        # bound below tells "left out at the gather's deadline" from "waited for in the exchange" on a busy machine
        cs = await _collectives(net, PEERS, PATIENT)  # (1.68 s against FAST's 1.5 s bound once, a core busy)
        deltas = _deltas(PEERS, 99, seed=4)
        started = time.monotonic()
        outs = await _round(cs, RoundKey(0), PEERS, deltas, members=present)
        return deltas, outs, time.monotonic() - started, cs["p3"]

    deltas, outs, took, p3 = asyncio.run(main())
    assert PATIENT.gather_timeout * 0.9 <= took < PATIENT.reduce_timeout, took
    first = outs["p0"].aggregate
    for o in outs.values():
        assert o.committed, o.reason
        assert o.view == tuple(present)
        assert o.contributors == [tuple(present)] * 3
        assert torch.equal(o.aggregate, first)
    assert torch.allclose(first, _mean(deltas, present), rtol=0, atol=1e-6)
    assert not p3.rejections  # it took their ready messages without complaint


@pytest.mark.parametrize("absent", ["never_created", "killed_before_round"])
def test_expected_peer_unreachable_others_commit_without_it(absent):
    """p3 is expected (e.g. from a record that has not expired yet) but is not on the network:
    the others commit with a view of 3, by gather_timeout at the latest."""
    present = PEERS[:3]

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, present if absent == "never_created" else PEERS)
        if absent == "killed_before_round":
            net.kill("p3")
        deltas = _deltas(PEERS, 99, seed=4)
        started = time.monotonic()
        outs = await _round(cs, RoundKey(0), PEERS, deltas, members=present)
        return deltas, outs, time.monotonic() - started

    deltas, outs, took = asyncio.run(main())
    assert took < FAST.gather_timeout + 0.5 * FAST.result_timeout
    first = outs["p0"].aggregate
    for o in outs.values():
        assert o.committed, o.reason
        assert o.view == tuple(present)
        assert o.contributors == [tuple(present)] * 3
        assert torch.equal(o.aggregate, first)
    assert torch.allclose(first, _mean(deltas, present), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fate", ["went_away", "froze"])
def test_a_peer_that_answered_not_yet_and_then_went_away_or_froze_costs_a_grace_or_a_window_not_the_gather(fate):
    """x is expected and answers the others' ready with "not ready yet" (it has not started the round), then goes
    away for good, as a spot instance reclaimed mid-gather, or freezes (SIGSTOP): its own ready never comes. Gone:
    the others ask it again a tenth of gather_timeout later, find it unreachable, and close without it (the
    in-process flapping test failed that way under load). Frozen: they ask again a third of an answer window (2 s)
    apart; the question after the freeze goes unanswered, and once it has been on its way for the window they close
    without it: within a window and a half or so, not the two graces (4 s) of asking a grace apart. Either way, well
    before the gather's deadline."""
    gather, call = (3.0, 1.0) if fate == "went_away" else (20.0, 8.0)

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, ["p0", "p1", "x"], CollectiveConfig(gather_timeout=gather, reduce_timeout=0.5,
                                                                         result_timeout=1, call_timeout=call))
        answered = asyncio.Event()
        freezer = _Freezer(net, "x")
        on_ready = net.lookup("x").handlers["diloco.ready"]

        async def answer_then_note(caller, data):
            reply = await on_ready(caller, data)
            answered.set()
            return reply
        net.lookup("x").handlers["diloco.ready"] = answer_then_note
        deltas = _deltas(["p0", "p1"], 30, seed=9)
        started = time.monotonic()
        running = asyncio.gather(*(cs[p].run_round(RoundKey(2), DIGEST, ["p0", "p1", "x"], deltas[p])
                                   for p in ("p0", "p1")))
        await asyncio.wait_for(answered.wait(), 1)
        if fate == "went_away":
            net.kill("x")
        else:
            freezer.frozen = True
        outs = await running
        freezer.thaw()
        return outs, time.monotonic() - started

    outs, took = asyncio.run(main())
    assert all(o.committed and o.view == ("p0", "p1") for o in outs), [(o.reason, o.view) for o in outs]
    # gone: a grace (0.3 s) or two, and the round; frozen: a third of a window to ask again, and the window (2 s)
    assert took < (gather / 3 if fate == "went_away" else 4.0), took


@pytest.mark.parametrize("fate", ["killed", "restarted", "cut_off"])
def test_a_peer_whose_ready_came_early_and_that_then_died_is_not_in_the_view(fate):
    """x started round 1 first: its ready reached p0 and p1 before they began the round. Then x was SIGKILLed
    (found in a WAN chaos soak), or killed and restarted (a new process under its peer id), or cut off by a
    partition (or frozen: its calls hang; also found in a soak). p0 and p1 ask x when they begin: the call fails,
    is answered by another process, or goes unanswered through the answer window. A ready we hold from a process
    that cannot take part now is no member: they close (p0, p1) and commit, rather than closing a view with x in it
    and losing the attempt to its probes."""

    async def main():
        net = InProcNetwork()
        # cut off: a call to x hangs for the call timeout, which (as by default) is longer than the answer window
        cs = await _collectives(net, ["p0", "p1", "x"], replace(FAST, call_timeout=8.0) if fate == "cut_off" else FAST)
        got = asyncio.Event()
        _once_both_answered(net, ("p0", "p1"), "diloco.ready", "x", got.set)
        deltas = _deltas(["p0", "p1", "x"], 30, seed=5)
        early = asyncio.create_task(cs["x"].run_round(RoundKey(1), DIGEST, ["p0", "p1", "x"], deltas["x"]))
        await asyncio.wait_for(got.wait(), 2)
        early.cancel()
        if fate == "cut_off":
            freezer = _Freezer(net, "x")
            freezer.frozen = True
        else:
            net.kill("x")
        if fate == "restarted":  # a new process under the same peer id
            await Collective.create(net.transport("x"), RUN, FAST)
        outs = await asyncio.gather(*(cs[p].run_round(RoundKey(1), DIGEST, ["p0", "p1", "x"], deltas[p])
                                      for p in ("p0", "p1")))
        return outs

    started = time.monotonic()
    outs = asyncio.run(main())
    assert all(o.committed and o.view == ("p0", "p1") for o in outs), [(o.reason, o.view) for o in outs]
    assert time.monotonic() - started < 6.0  # an answer window (2 s) and the round, not a call timeout (8 s)


def test_a_hung_straggler_costs_the_grace_not_a_call_timeout():
    """p3 is a straggler (the others go on without waiting for it) whose record is still live, and it
    is frozen: its ready handler never answers. The others ask it, but do not wait out their call to
    it: they close after the stragglers' grace and commit among themselves, round after round."""
    present = PEERS[:3]
    cfg = replace(FAST, call_timeout=5.0)

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS, cfg)
        frozen = asyncio.Event()

        async def hung(caller, data):
            await frozen.wait()  # never set: SIGSTOPped
            return b""
        net.lookup("p3").handlers["diloco.ready"] = hung
        deltas = _deltas(PEERS, 99, seed=4)
        took, outs = [], {}
        for rnd in range(2):
            started = time.monotonic()
            outs = dict(zip(present, await asyncio.gather(*(
                cs[p].run_round(RoundKey(rnd), DIGEST, PEERS, deltas[p], wait_for=present) for p in present))))
            took.append(time.monotonic() - started)
        return outs, took

    outs, took = asyncio.run(main())
    assert all(o.committed and o.view == tuple(present) for o in outs.values()), outs
    assert max(took) < cfg.call_timeout / 2, took  # the grace (0.05 s) and the round, not the 5 s call


# ---------------------------------------------------------------------- an owner dies mid-round


def test_owner_killed_after_gather_nobody_commits_then_next_attempt_commits():
    """The survivors learn that the victim is gone within a probe's answer window (`diloco.comms.watch`), not at the
    result deadline, give the attempt up together, and commit the next one among themselves."""
    victim, survivors = "p2", ["p0", "p1", "p3"]
    key = RoundKey(5, 0)

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS, PATIENT)
        # Contributions are sent only after a peer closed its gather. Hold every contribution until
        # all 4 peers sent all of theirs (12: every gather closed, with a view of 4), then kill the
        # victim, as if SIGKILLed between gather and reduce, and let the contributions through.
        all_closed, sent = asyncio.Event(), Counter()
        killed = []

        def gate(p):
            inner = net.lookup(p).handlers["diloco.contrib"]

            async def handler(caller, data):
                sent[caller] += 1
                if sum(sent.values()) == 12:
                    all_closed.set()
                await asyncio.wait_for(all_closed.wait(), 5)
                if not killed:
                    killed.append(victim)
                    net.kill(victim)
                return await inner(caller, data)
            return handler

        for p in PEERS:
            net.lookup(p).handlers["diloco.contrib"] = gate(p)
        deltas = _deltas(PEERS, 203, seed=5)
        started = time.monotonic()
        outs = await _round(cs, key, PEERS, deltas)
        took = time.monotonic() - started
        sent_first = dict(sent)

        # the survivors retry the same round as the next attempt, among themselves
        deltas2 = _deltas(survivors, 203, seed=6)
        outs2 = await _round(cs, RoundKey(5, 1), survivors, deltas2, members=survivors)
        return sent_first, outs, took, deltas2, outs2

    sent, outs, took, deltas2, outs2 = asyncio.run(main())
    assert sent == {p: 3 for p in PEERS}  # every peer closed its gather with all 4 in view
    assert took < PATIENT.reduce_timeout / 2, took  # a window or two of probes (1 s each), not the deadlines
    survivor_outcomes = {(o.committed, o.reason, o.view, o.key) for p, o in outs.items() if p != victim}
    assert len(survivor_outcomes) == 1, survivor_outcomes  # all survivors report the same outcome
    committed, reason, view, k = survivor_outcomes.pop()
    assert not committed and k == key
    assert "will send no result" in reason and "unreachable" in reason and victim in reason  # the victim's span
    assert view == tuple(PEERS)
    assert all(o.aggregate is None for o in outs.values())
    assert not outs[victim].committed

    first = outs2["p0"].aggregate
    for o in outs2.values():
        assert o.committed, o.reason
        assert o.key == RoundKey(5, 1) and o.view == tuple(survivors)
        assert torch.equal(o.aggregate, first)
    assert torch.allclose(first, _mean(deltas2, survivors), rtol=0, atol=1e-6)


def test_an_owner_stops_waiting_for_a_contribution_its_member_says_it_could_not_deliver():
    """p1 cannot reach p0 with its contribution (the call fails: a dial backoff, a half-broken path), though both
    are alive and every other call goes through. p0's probe hears so from p1 and reduces span 0 without it, a window
    after the gather rather than at the 8 s reduce deadline; everyone commits, span 0 averaged without p1."""
    cfg = replace(FAST, reduce_timeout=8.0, result_timeout=10.0, call_timeout=4.0)

    async def main():
        net = InProcNetwork()
        no_contrib_to_p0 = lambda target, name: target == "p0" and name == "diloco.contrib"  # noqa: E731
        cs = {p: await Collective.create(net.transport(p, no_contrib_to_p0 if p == "p1" else None), RUN, cfg)
              for p in PEERS}
        deltas = _deltas(PEERS, 400, seed=23)
        started = time.monotonic()
        outs = await _round(cs, RoundKey(0), PEERS, deltas)
        return deltas, outs, time.monotonic() - started

    deltas, outs, took = asyncio.run(main())
    for o in outs.values():
        assert o.committed, o.reason
        assert o.contributors[0] == ("p0", "p2", "p3") and all(c == tuple(PEERS) for c in o.contributors[1:])
    assert torch.allclose(outs["p0"].aggregate[:100], _mean(deltas, ["p0", "p2", "p3"])[:100], rtol=0, atol=1e-6)
    assert took < cfg.reduce_timeout / 2, took  # a window's sleep and the probe (2 s), not the 8 s reduce deadline


def test_a_member_frozen_mid_round_is_given_up_within_a_probe_window_and_the_next_gather_goes_on_without_it():
    """p3 freezes (SIGSTOP) once every contribution to its span is in: its result never goes out, and it answers
    nothing. The others' probes go unanswered for a window (2 s here), so they give the attempt up long before
    the result deadline; in the next attempt their ready to p3 (which they heard from before) goes unanswered for
    a window too, and they close and commit without it instead of waiting out the call timeout; in the round after,
    they do not wait a window for it again."""
    present = PEERS[:3]
    cfg = replace(FAST, reduce_timeout=10.0, result_timeout=12.0, call_timeout=8.0)
    assert cfg.answer_timeout == 2.0

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS, cfg)
        freezer, got = _Freezer(net, "p3"), []
        on_contrib = net.lookup("p3").handlers["diloco.contrib"]

        async def count_then_freeze(caller, data):
            reply = await on_contrib(caller, data)
            got.append(caller)
            if len(got) == 3:
                freezer.frozen = True
            return reply
        net.lookup("p3").handlers["diloco.contrib"] = count_then_freeze
        deltas = _deltas(PEERS, 99, seed=11)
        started = time.monotonic()
        frozen_round = asyncio.create_task(cs["p3"].run_round(RoundKey(4, 0), DIGEST, PEERS, deltas["p3"]))
        first = await asyncio.gather(*(cs[p].run_round(RoundKey(4, 0), DIGEST, PEERS, deltas[p]) for p in present))
        took0, started = time.monotonic() - started, time.monotonic()
        again = await asyncio.gather(*(cs[p].run_round(RoundKey(4, 1), DIGEST, PEERS, deltas[p]) for p in present))
        took1, started = time.monotonic() - started, time.monotonic()
        # still frozen, still in their records: the next round does not wait a window for it again
        later = await asyncio.gather(*(cs[p].run_round(RoundKey(5, 0), DIGEST, PEERS, deltas[p]) for p in present))
        took2 = time.monotonic() - started
        frozen_round.cancel()  # what a thawed peer does next is test_frozen_after_every_result_...'s subject
        freezer.thaw()
        return first, again + later, took0, took1, took2

    first, again, took0, took1, took2 = asyncio.run(main())
    assert all(not o.committed and "p3 will send no result" in o.reason and "silent" in o.reason for o in first), \
        [o.reason for o in first]
    assert took0 < cfg.reduce_timeout * 0.7, took0  # a window's sleep and a window's probe: ~4 s, not 10-12 s
    assert all(o.committed and o.view == tuple(present) for o in again), [(o.reason, o.view) for o in again]
    assert took1 < cfg.call_timeout * 0.6, took1  # a window (2 s), not the 8 s call timeout
    assert took2 < cfg.answer_timeout / 2, took2  # a twentieth of the window, and the round


def test_a_frozen_straggler_gets_no_grace_once_found_silent():
    """p3 freezes between rounds. The first round after waits an answer window for its ready and commits without
    it; from then on p3 is a straggler (the engine asks it, but waits only for the last round's members), and a
    straggler found silent lately is not given the stragglers' grace either: the rounds go on at once rather than a
    grace apart for as long as its record lives (a 20 s SIGSTOP in a real swarm cost a grace every round)."""
    present = PEERS[:3]
    cfg = replace(FAST, gather_timeout=20.0, reduce_timeout=10.0, result_timeout=12.0, call_timeout=8.0)
    assert cfg.answer_timeout == 2.0 and cfg.gather_timeout / 10 == 2.0  # the window, and the stragglers' grace

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS, cfg)
        deltas = _deltas(PEERS, 99, seed=12)
        warm = await _round(cs, RoundKey(1), PEERS, deltas)  # everyone heard from p3
        freezer = _Freezer(net, "p3")
        freezer.frozen = True
        took = []
        outs = []
        for rnd, wait_for in ((2, PEERS), (3, present), (4, present)):
            started = time.monotonic()
            outs += await asyncio.gather(*(cs[p].run_round(RoundKey(rnd), DIGEST, PEERS, deltas[p], wait_for=wait_for)
                                           for p in present))
            took.append(time.monotonic() - started)
        freezer.thaw()
        return warm, outs, took

    warm, outs, took = asyncio.run(main())
    assert all(o.committed for o in warm.values())
    assert all(o.committed and o.view == tuple(present) for o in outs), [(o.reason, o.view) for o in outs]
    assert 1.5 < took[0] < 4, took  # the window, once
    assert took[1] < 1 and took[2] < 1, took  # no grace (2 s) for the silent straggler


# ---------------------------------------------------------------------- late peers


def test_a_ready_refused_while_catching_up_is_answered_by_the_reply_to_ours():
    """p1 is still at round 0 when p0 starts round 2 (it is downloading the swarm's state), so it
    refuses p0's ready as too far ahead; a moment later it jumps to round 2 and sends its own ready.
    p0's reply to it says p0 is ready too, so p1 does not wait out the gather timeout for a ready
    that will never come again: both commit at once (the CI failure of the hung-peer test)."""
    gather = 5.0

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, ["p0", "p1"], CollectiveConfig(gather_timeout=gather, reduce_timeout=1,
                                                                   result_timeout=2, call_timeout=1))
        deltas = _deltas(["p0", "p1"], 40, seed=3)
        key = RoundKey(2)
        first = asyncio.create_task(cs["p0"].run_round(key, DIGEST, ["p1"], deltas["p0"]))
        while not cs["p1"].rejections:  # p0's ready reached p1 before p1 caught up: refused
            await asyncio.sleep(0.01)
        cs["p1"].advance_to(key)  # p1 downloaded round 2's state
        started = time.monotonic()
        second = await cs["p1"].run_round(key, DIGEST, ["p0"], deltas["p1"])
        return await first, second, time.monotonic() - started, cs

    out0, out1, took, cs = asyncio.run(main())
    assert cs["p1"].rejections == Counter({Reason.WRONG_ROUND.value: 1})
    assert out0.committed and out1.committed, (out0.reason, out1.reason)
    assert out0.view == out1.view == ("p0", "p1")
    assert torch.equal(out0.aggregate, out1.aggregate)
    assert took < gather / 2, f"p1 waited {took:.1f}s for a ready it had refused"


def test_named_peers_are_those_we_expect_and_whom_they_expect():
    from diloco.comms.rounds import RoundState

    rs = RoundState(lists={"b": frozenset({"me", "c"}), "c": frozenset({"d"}), "x": frozenset({"y"})})
    assert rs.named("me") == set()  # we have not started the round: we expect nobody yet
    rs.expected = ("b", "me")
    assert rs.named("me") == {"b", "c", "d"}  # x told us whom it expects, but nobody expects x
    # we wait for b; of the peers we learned of, for those a named peer waits for (c's d), not for its
    # stragglers (b asks c but does not wait for it: c gets only the grace from us too)
    rs.waits = {"b": frozenset({"me"}), "c": frozenset({"d"})}
    assert rs.waited("me") == {"b", "d"}
    rs.wait_for = frozenset()  # b is our straggler
    assert rs.waited("me") == {"d"}
    assert msg.unpack_names(memoryview(msg.pack_names({"b", "c"}, {"b"}))) == ({"b", "c"}, {"b"})


def test_views_agree_when_only_some_records_show_a_newcomer():
    """x just joined: p0's records show it, p1's do not yet, and x's ready reaches p1 late. p1 learns
    from p0's ready that p0 expects x, so it asks x and waits for it too instead of closing (p0, p1)
    while p0 closes (p0, p1, x): both views agree and all three commit the same round."""

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, ["p0", "p1", "x"], CollectiveConfig(gather_timeout=3, reduce_timeout=1,
                                                                         result_timeout=2, call_timeout=1))
        p1 = cs["p1"].transport
        on_ready = p1.handlers["diloco.ready"]

        async def slow_from_x(caller, data):
            if caller == "x":
                await asyncio.sleep(0.5)
            return await on_ready(caller, data)

        p1.handlers["diloco.ready"] = slow_from_x
        deltas = _deltas(["p0", "p1", "x"], 30, seed=5)
        key = RoundKey(4)
        return await asyncio.gather(cs["p0"].run_round(key, DIGEST, ["p1", "x"], deltas["p0"]),
                                    cs["p1"].run_round(key, DIGEST, ["p0"], deltas["p1"]),
                                    cs["x"].run_round(key, DIGEST, ["p0", "p1"], deltas["x"]))

    outs = asyncio.run(main())
    assert all(o.committed for o in outs), [o.reason for o in outs]
    assert {o.view for o in outs} == {("p0", "p1", "x")}
    assert all(torch.equal(o.aggregate, outs[0].aggregate) for o in outs)


def test_members_that_closed_different_views_give_up_at_once_not_at_the_result_deadline():
    """p1 and p2 cannot reach each other's ready handlers (their other calls go through): p0 closes
    (p0, p1, p2), p1 closes (p0, p1) and p2 (p0, p2) at the gather deadline. No view can complete, since
    a member that closed another view never sends a result for ours; each member learns so from the first
    frame refused as of the wrong view (or received of another view) and gives up then (in ~10 ms), not after
    the 30 s result deadline. The calls' deadline is far above what they take: with 1 s, a test process starved of
    the CPU for a second (a busy suite) saw a call time out, and each such call costs its member a window."""

    async def main():
        net = InProcNetwork()
        cfg = CollectiveConfig(gather_timeout=1, reduce_timeout=20, result_timeout=30, call_timeout=5)
        cut = {("p1", "p2"), ("p2", "p1")}
        cs = {p: await Collective.create(
            net.transport(p, drop=lambda target, handler, p=p: handler == "diloco.ready" and (p, target) in cut),
            RUN, cfg) for p in ("p0", "p1", "p2")}
        deltas = _deltas(list(cs), 60, seed=9)
        began = time.monotonic()
        outs = await _round(cs, RoundKey(2), list(cs), deltas)
        return outs, time.monotonic() - began

    outs, seconds = asyncio.run(main())
    assert not any(o.committed for o in outs.values()), {p: o.reason for p, o in outs.items()}
    assert len({o.view for o in outs.values()}) == 3, {p: o.view for p, o in outs.items()}
    assert outs["p0"].view == ("p0", "p1", "p2")
    # each learns it from a frame of another view, or from a probe's answer that a member gave ours up
    assert all("closed another view" in o.reason or "no longer runs this attempt" in o.reason
               for o in outs.values()), {p: o.reason for p, o in outs.items()}
    assert seconds < 10, seconds  # the calls, not the 20 s reduce nor the 30 s result deadline


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
def test_a_peer_that_abstained_then_gathers_the_same_round_forks_nothing_and_costs_no_deadline(delay):
    """The interleaving of a region member that goes standby -> representative within one gather: p3 answers
    every other member's ready with `abstains` (on standby: not waited for), then `delay` s later leaves standby
    and gathers the same round key itself. Its ready races with the others closing their views (before, among or
    after them). Whatever the order: every member that commits commits one value (one view's mean), p3 either
    commits it with them or is told it is late, nobody waits out the 10 s result deadline, and the next round has
    all four in one view. (Seen: with no delay p3's ready reaches p2 before it closes and p0, p1 after, so p2
    closes another view than theirs; all three give attempt 0 up at once and commit attempt 1 without p3, which
    learnt it is late; with 50 ms or more the three commit attempt 0 and p3 hears it is late.)"""

    async def main():
        net = InProcNetwork()
        cfg = replace(PATIENT, gather_timeout=2.0)
        cs = await _collectives(net, PEERS, cfg)
        cs["p3"].abstaining = True
        flipped = asyncio.Event()
        heard: set[str] = set()
        inner = net.lookup("p3").handlers["diloco.ready"]

        async def abstain_then_flip(who, data):
            reply = await inner(who, data)
            heard.add(who)
            if heard >= {"p0", "p1", "p2"} and not flipped.is_set():
                flipped.set()
            return reply
        net.lookup("p3").handlers["diloco.ready"] = abstain_then_flip
        deltas = _deltas(PEERS, 90, seed=11)

        async def member(p: str) -> list:
            outs, key = [], RoundKey(0)
            while len(outs) < 4:
                out = await cs[p].run_round(key, DIGEST, [q for q in PEERS if q != p], deltas[p])
                outs.append(out)
                if out.committed or "late" in out.reason:
                    return outs
                key = RoundKey(0, key.attempt + 1)
            return outs

        async def p3() -> list:
            await asyncio.wait_for(flipped.wait(), 5)
            await asyncio.sleep(delay)
            cs["p3"].abstaining = False
            return await member("p3")

        began = time.monotonic()
        first = dict(zip(PEERS, await asyncio.gather(*(member(p) for p in PEERS[:3]), p3())))
        seconds = time.monotonic() - began
        nxt = await _round(cs, RoundKey(1), PEERS, deltas)
        return first, seconds, nxt

    first, seconds, nxt = asyncio.run(main())
    last = {p: outs[-1] for p, outs in first.items()}
    committed = {p: o for p, o in last.items() if o.committed}
    assert set(committed) >= {"p0", "p1", "p2"}, {p: [o.reason for o in outs] for p, outs in first.items()}
    assert len({o.value_id for o in committed.values()}) == 1
    assert all(torch.equal(o.aggregate, committed["p0"].aggregate) for o in committed.values())
    view = committed["p0"].view
    assert torch.allclose(committed["p0"].aggregate, _mean(_deltas(PEERS, 90, seed=11), view), atol=1e-6)
    assert "p3" in committed or "p3" not in view, (view, last["p3"].reason)
    assert seconds < 5, (seconds, {p: [o.reason for o in outs] for p, outs in first.items()})
    assert all(o.committed and o.view == tuple(PEERS) for o in nxt.values()), {p: o.reason for p, o in nxt.items()}


def test_a_change_is_never_lost_to_a_waiter_whose_wait_had_not_begun_when_another_one_checked():
    """The cause of the test above's one 20 s run in ~300 on a busy machine: waiters shared one asyncio.Event and each
    cleared it before waiting, so a handler's `set()` that came after waiter A checked its condition but before A's
    wait began was undone by waiter B's clear, and A slept to its deadline. Now each waits on the change current when
    it checked (`Changes`), which nobody clears. The interleaving, built by hand: A takes its change, a handler sets,
    B checks and takes the next one, A still wakes at once."""
    from diloco.comms.rounds import RoundState, wait_until

    async def main():
        rs = RoundState()
        seen = rs.changed.current()  # A checked its condition (false) and is about to wait
        rs.changed.set()  # a handler moved the state on
        rs.changed.current()  # B checks in between (it used to clear the event here)
        started = time.monotonic()
        await asyncio.wait_for(seen.wait(), 5)
        woke = time.monotonic() - started
        flag: list[bool] = []
        asyncio.get_running_loop().call_later(0.05, lambda: (flag.append(True), rs.changed.set()))
        done = await wait_until(rs, lambda: bool(flag), time.monotonic() + 5)
        return woke, done, time.monotonic() - started

    woke, done, took = asyncio.run(main())
    # at once, not at the 5 s deadline (bounds a loaded machine's scheduler cannot reach by itself)
    assert woke < 1.0 and done and took < 2.0, (woke, done, took)


def test_a_peer_nobody_expects_is_left_out_by_everyone():
    """x sends ready to p0 and p1, but neither's records show it: both leave it out (without waiting
    for it) and commit; x, whose view differs, commits nothing."""
    gather = 3.0

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, ["p0", "p1", "x"], CollectiveConfig(gather_timeout=gather, reduce_timeout=0.5,
                                                                         result_timeout=1, call_timeout=1))
        deltas = _deltas(["p0", "p1", "x"], 30, seed=6)
        key = RoundKey(4)
        for c in cs.values():
            c.advance_to(key)
        started = time.monotonic()
        x = asyncio.create_task(cs["x"].run_round(key, DIGEST, ["p0", "p1"], deltas["x"]))
        await asyncio.sleep(0.05)  # x's ready is in before the others start
        steady = await asyncio.gather(cs["p0"].run_round(key, DIGEST, ["p1"], deltas["p0"]),
                                      cs["p1"].run_round(key, DIGEST, ["p0"], deltas["p1"]))
        return steady, time.monotonic() - started, await x

    (o0, o1), took, ox = asyncio.run(main())
    assert o0.committed and o1.committed and o0.view == o1.view == ("p0", "p1")
    assert took < gather / 2
    assert not ox.committed


def test_a_ready_with_a_malformed_peer_list_is_rejected():
    async def main():
        net = InProcNetwork()
        a = (await _collectives(net, ["a"]))["a"]
        b = net.transport("b")
        replies = []
        for body in (b"\xff\xfe", b"ok\n\nok", b"\n".join([b"p"] * 5000), ("z" * 129).encode()):
            frame = msg.encode(msg.READY, run=RUN, sender="b", key=RoundKey(0), meta={"digest": DIGEST}, body=body)
            replies.append(msg.read_ack(await b.call("a", "diloco.ready", frame, 1), run=RUN, caller="a"))
        return replies, a.rejections

    replies, rejections = asyncio.run(main())
    assert all(r["ok"] is False and r["reason"] == "bad_header" for r in replies), replies
    assert rejections == Counter({"bad_header": 4})


def test_late_peer_while_others_are_mid_round_gives_up_at_once():
    """Three peers closed round 0 without p3 and are still reducing when p3 arrives: p3 learns
    from their ready replies that the round closed without it and gives up at once ("late")."""
    first3, late = PEERS[:3], "p3"

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS, CollectiveConfig(gather_timeout=3, reduce_timeout=2, result_timeout=3,
                                                            call_timeout=3))
        all_closed, release, sent = asyncio.Event(), asyncio.Event(), Counter()

        def gate(p):
            inner = net.lookup(p).handlers["diloco.contrib"]

            async def handler(caller, data):
                sent[caller] += 1
                if sum(sent.values()) == 6:  # each of the 3 sent its 2 contributions: all closed
                    all_closed.set()
                await asyncio.wait_for(release.wait(), 5)
                return await inner(caller, data)
            return handler

        for p in first3:
            net.lookup(p).handlers["diloco.contrib"] = gate(p)
        deltas = _deltas(PEERS, 30, seed=7)
        running = asyncio.gather(*(cs[p].run_round(RoundKey(0), DIGEST, first3, deltas[p]) for p in first3))
        await asyncio.wait_for(all_closed.wait(), 5)
        started = time.monotonic()
        late_out = await cs[late].run_round(RoundKey(0), DIGEST, PEERS, deltas[late])
        late_took = time.monotonic() - started
        release.set()
        outs = dict(zip(first3, await running))
        return deltas, late_out, late_took, outs

    deltas, late_out, late_took, outs = asyncio.run(main())
    assert not late_out.committed
    assert late_out.reason.startswith("late"), late_out.reason
    assert "3 peer(s)" in late_out.reason
    assert late_out.aggregate is None
    assert late_took < 1.5  # half of gather_timeout=3: a loaded machine's stall, not the deadline
    for o in outs.values():
        assert o.committed and o.view == tuple(first3)
        assert torch.allclose(o.aggregate, _mean(deltas, first3), rtol=0, atol=1e-6)


def test_late_peer_after_others_finished_is_told_at_once():
    """Three peers finished round 0; p3 starts round 0 afterwards. The finished peers answer its
    ready with "closed, not in view", so p3 gives up at once with reason "late" (and resyncs in
    the wrapper) instead of waiting out its gather deadline and committing a view of its own."""
    first3, late = PEERS[:3], "p3"

    cfg = replace(EVERYONE, gather_timeout=5.0)  # a deadline no stall of a loaded machine comes near

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS, cfg)
        deltas = _deltas(PEERS, 30, seed=8)
        outs = await _round(cs, RoundKey(0), first3, deltas, members=first3)
        started = time.monotonic()
        late_out = await cs[late].run_round(RoundKey(0), DIGEST, PEERS, deltas[late])
        return deltas, outs, late_out, time.monotonic() - started, cs

    deltas, outs, late_out, took, cs = asyncio.run(main())
    for o in outs.values():
        assert o.committed and o.view == tuple(first3)
        assert torch.allclose(o.aggregate, _mean(deltas, first3), rtol=0, atol=1e-6)
    assert not late_out.committed and late_out.reason.startswith("late")
    assert late_out.aggregate is None
    assert took < 0.5 * cfg.gather_timeout
    for p in first3:  # a late ready is not an offence
        assert cs[p].rejections == Counter()


def test_a_stragglers_news_that_the_round_is_over_ends_the_gather_when_it_arrives():
    """p1 and p2 committed round 0 without p0. For p0 they are stragglers (asked, not waited for),
    slow to answer, and p0 also waits for p3, which never gets ready. p0 gives up ("late") as soon as
    their answers say the round is committed, not at its gather deadline."""
    cfg = replace(FAST, gather_timeout=3.0)

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS, cfg)
        deltas = _deltas(PEERS, 30, seed=9)
        done = await _round(cs, RoundKey(0), ["p1", "p2"], deltas, members=["p1", "p2"])
        for p in ("p1", "p2"):
            inner = net.lookup(p).handlers["diloco.ready"]

            async def slow(caller, data, inner=inner):
                await asyncio.sleep(0.1)
                return await inner(caller, data)
            net.lookup(p).handlers["diloco.ready"] = slow
        started = time.monotonic()
        out = await cs["p0"].run_round(RoundKey(0), DIGEST, PEERS, deltas["p0"], wait_for=["p3"])
        return done, out, time.monotonic() - started

    done, out, took = asyncio.run(main())
    assert all(o.committed for o in done.values())
    assert not out.committed and out.reason.startswith("late") and "committed round 0" in out.reason, out.reason
    assert took < cfg.gather_timeout / 3, took


# ---------------------------------------------------------------------- hostile and wrong frames


def test_rejected_frames_are_counted_and_never_reach_the_aggregate():
    """Peer a runs a round with view (a, b); b is a puppet driven by the test. Every bad frame is
    answered ok=False with its Reason, counted in a.rejections, and left out of a's aggregate."""
    key, numel = RoundKey(2, 0), 10
    view = make_view(["a", "b"])
    vid = view_id(key, view)
    (lo0, hi0), (lo1, hi1) = span_bounds(numel, 2)
    codec = get_codec("fp32")

    async def main():
        net = InProcNetwork()
        a = (await _collectives(net, ["a"], CollectiveConfig(gather_timeout=3, reduce_timeout=2,
                                                             result_timeout=3, call_timeout=1)))["a"]
        nonlocal vid  # the view names a's incarnation; the puppet b tells none (0: unknown)
        vid = view_id(key, view, incarnations={"a": a.incarnation})
        b, c = net.transport("b"), net.transport("c")
        got_from_a: dict[str, list] = {"contrib": [], "result": []}
        a_closed = asyncio.Event()

        async def b_contrib(caller, data):  # a's contribution to b's span: a closed its gather
            header, body, _ = msg.decode(data, run=RUN, kind=msg.CONTRIB, caller=caller, max_body=1 << 20)
            got_from_a["contrib"].append((header.view, header.span, codec.decode(body, header.numel)))
            a_closed.set()
            return msg.ack(run=RUN, sender="b")

        async def b_result(caller, data):
            header, body, _ = msg.decode(data, run=RUN, kind=msg.RESULT, caller=caller, max_body=1 << 20)
            got_from_a["result"].append((header.view, header.span, header.meta["contributors"],
                                         codec.decode(body, header.numel)))
            return msg.ack(run=RUN, sender="b")

        async def b_vote(caller, data):  # b holds every result too: it accepted the value
            return msg.ack(run=RUN, sender="b", accepted=True)

        async def b_ready(caller, data):  # b is ready too (a peer a cannot ask is no member of its view)
            return msg.ack(run=RUN, sender="b", closed=False, in_view=False, ready=DIGEST)

        await b.register("diloco.ready", b_ready)
        await b.register("diloco.contrib", b_contrib)
        await b.register("diloco.result", b_result)
        await b.register("diloco.vote", b_vote)

        delta_a = torch.arange(numel, dtype=torch.float32)
        run = asyncio.create_task(a.run_round(key, DIGEST, ["a", "b"], delta_a))
        ready = msg.encode(msg.READY, run=RUN, sender="b", key=key, meta={"digest": DIGEST})
        assert msg.read_ack(await b.call("a", "diloco.ready", ready, 1), run=RUN, caller="a")["ok"]
        await asyncio.wait_for(a_closed.wait(), 2)

        def contrib(sender, values, *, k=key, v=vid, span=0):
            return msg.encode(msg.CONTRIB, run=RUN, sender=sender, key=k, view=v, span=span, codec="fp32",
                              numel=values.numel(), body=codec.encode(values))

        good = torch.full((hi0 - lo0,), 100.0)
        steps = [
            # (transport, frame, expected reason or None for accepted)
            # another view (from a member it would also end a's attempt: it shows the member closed another
            # view, test_members_that_closed_different_views_give_up_at_once_not_at_the_result_deadline)
            (c, contrib("c", torch.full((hi0 - lo0,), 7.0), v="0" * 16), Reason.WRONG_VIEW),
            (c, contrib("c", torch.full((hi0 - lo0,), 7.0)), Reason.NOT_MEMBER),          # not in the view
            (c, contrib("b", torch.full((hi0 - lo0,), 7.0)), Reason.NOT_MEMBER),          # claims to be b
            (b, contrib("b", torch.full((hi0 - lo0,), float("nan"))), Reason.NON_FINITE),
            (b, contrib("b", torch.full((hi0 - lo0,), 7.0), k=RoundKey(1, 4)), Reason.WRONG_ROUND),  # stale
            (b, contrib("b", torch.full((hi0 - lo0,), 7.0), k=RoundKey(9, 0)), Reason.WRONG_ROUND),  # far ahead
            (b, contrib("b", torch.full((hi1 - lo1,), 7.0), span=1), Reason.WRONG_SPAN),  # span a does not own
            (b, contrib("b", good), Reason.DUPLICATE),  # one contribution a round: the refused one counted
            (b, contrib("b", torch.full((hi0 - lo0,), -50.0)), Reason.DUPLICATE),
        ]
        replies = []
        for transport, frame, _ in steps:
            reply = await transport.call("a", "diloco.contrib", frame, 1)
            replies.append(msg.read_ack(reply, run=RUN, caller="a"))
        rejections_before_result = Counter(a.rejections)

        # b's span result, as the owner of span 1 it would be
        r1 = torch.linspace(-1, 1, hi1 - lo1)
        result = msg.encode(msg.RESULT, run=RUN, sender="b", key=key, view=vid, span=1, codec="fp32",
                            numel=r1.numel(), meta={"contributors": [0, 1], "result": "mean"}, body=codec.encode(r1))
        inf_result = msg.encode(msg.RESULT, run=RUN, sender="b", key=key, view=vid, span=1, codec="fp32",
                                numel=r1.numel(), meta={"contributors": [0, 1], "result": "mean"},
                                body=codec.encode(torch.full_like(r1, float("inf"))))
        bad_inf = msg.read_ack(await b.call("a", "diloco.result", inf_result, 1), run=RUN, caller="a")
        ok_result = msg.read_ack(await b.call("a", "diloco.result", result, 1), run=RUN, caller="a")
        out = await asyncio.wait_for(run, 5)
        return (steps, replies, rejections_before_result, bad_inf, ok_result, out, Counter(a.rejections),
                delta_a, good, r1, got_from_a)

    (steps, replies, rej_mid, bad_inf, ok_result, out, rejections, delta_a, good, r1,
     got_from_a) = asyncio.run(main())

    for (_, _, reason), meta in zip(steps, replies):
        if reason is None:
            assert meta["ok"] is True
        else:
            assert meta["ok"] is False and meta["reason"] == reason.value, (reason, meta)
    assert rej_mid == Counter({"wrong_view": 1, "not_member": 2, "non_finite": 1, "wrong_round": 2,
                               "wrong_span": 1, "duplicate": 2})
    assert bad_inf["ok"] is False and bad_inf["reason"] == "non_finite"
    assert ok_result["ok"] is True
    assert rejections == rej_mid + Counter({"non_finite": 1})

    # a committed with exactly the accepted frames: span 0 = a's part alone (b's was refused, and marked)
    assert out.committed, out.reason
    assert out.view == view
    expected0 = delta_a[lo0:hi0]
    assert torch.equal(out.aggregate, torch.cat([expected0, r1]))
    assert out.contributors == [("a",), view]
    # and a sent b its contribution for span 1 and the same mean for span 0
    assert [(v, s) for v, s, _ in got_from_a["contrib"]] == [(vid, 1)]
    assert torch.equal(got_from_a["contrib"][0][2], delta_a[lo1:hi1])
    assert len(got_from_a["result"]) == 1
    rv, rs, contributors, values = got_from_a["result"][0]
    assert (rv, rs, contributors) == (vid, 0, [0])
    assert torch.equal(values, expected0)


def test_frames_of_another_run_or_kind_are_rejected():
    async def main():
        net = InProcNetwork()
        a = (await _collectives(net, ["a"]))["a"]
        x = net.transport("x")
        replies = {}
        other_run = msg.encode(msg.READY, run="other-run", sender="x", key=RoundKey(0), meta={"digest": DIGEST})
        replies["wrong_run"] = await x.call("a", "diloco.ready", other_run, 1)
        wrong_kind = msg.encode(msg.RESULT, run=RUN, sender="x", key=RoundKey(0), meta={"digest": DIGEST})
        replies["wrong_kind"] = await x.call("a", "diloco.ready", wrong_kind, 1)
        replies["bad_magic"] = await x.call("a", "diloco.contrib", b"not a frame at all", 1)
        no_digest = msg.encode(msg.READY, run=RUN, sender="x", key=RoundKey(0))
        replies["bad_header"] = await x.call("a", "diloco.ready", no_digest, 1)
        # a probe is a bodiless frame of its own kind, answered without a side effect
        replies["oversized"] = await x.call("a", "diloco.probe", msg.encode(msg.PROBE, run=RUN, sender="x",
                                                                           key=RoundKey(0), body=b"x"), 1)
        replies["wrong_kind"] = await x.call("a", "diloco.probe", no_digest, 1)
        probe = msg.encode(msg.PROBE, run=RUN, sender="x", key=RoundKey(0), view="v")
        answered = msg.read_ack(await x.call("a", "diloco.probe", probe, 1), run=RUN, caller="a")
        assert answered["ok"] and answered["running"] is False and not a.rounds  # a runs nothing, and keeps nothing
        return {k: msg.read_ack(v, run=RUN, caller="a") for k, v in replies.items()}, Counter(a.rejections)

    replies, rejections = asyncio.run(main())
    for reason, meta in replies.items():
        assert meta["ok"] is False and meta["reason"] == reason
    assert rejections == Counter({"wrong_run": 1, "wrong_kind": 2, "bad_magic": 1, "bad_header": 1, "oversized": 1})


# ---------------------------------------------------------------------- deciding (step 4): no fork


def _quorum_of(members):
    """The swarm's rule (`peers.quorum`) with `members` as the last round's membership."""
    from diloco.peers import quorum
    return lambda view: quorum(view, members, [], 1)


class _Freezer:
    """SIGSTOP for an in-process peer: once `frozen`, its outgoing calls are lost and calls to it hang
    (callers time out), until `thaw()`."""

    def __init__(self, net: InProcNetwork, peer: str) -> None:
        self.frozen, self._thawed = False, asyncio.Event()
        transport = net.lookup(peer)
        lose = transport.drop
        transport.drop = lambda target, name: self.frozen or bool(lose and lose(target, name))
        for name, handler in list(transport.handlers.items()):
            transport.handlers[name] = self._hold(handler)

    def _hold(self, handler):
        async def held(caller, data):
            if self.frozen:
                await self._thawed.wait()
            return await handler(caller, data)
        return held

    def thaw(self) -> None:
        self.frozen = False
        self._thawed.set()


def test_frozen_after_every_result_a_peer_cannot_commit_what_the_others_abandoned():
    """The interleaving that forked a real swarm: p holds every result of attempt 0, but its own span's
    result reached nobody, and it freezes (SIGSTOP) right then. a and b miss p's span, give attempt 0
    up and commit attempt 1 without p. Without the decide step p committed attempt 0 on its own: two
    states for one round. Now p accepts the value, learns nothing from anyone while frozen, stays in
    doubt, applies nothing; thawed, its next attempt learns that the round was committed."""
    members = ["a", "b", "p"]
    cfg = replace(FAST, gather_timeout=0.4, result_timeout=0.6, call_timeout=0.4)
    admit = _quorum_of(members)

    async def main():
        net = InProcNetwork()
        results_to_others_lost = lambda target, name: name == "diloco.result"  # noqa: E731
        cs = {p: await Collective.create(net.transport(p, results_to_others_lost if p == "p" else None), RUN, cfg)
              for p in members}
        freezer = _Freezer(net, "p")
        got: list[str] = []
        on_result = net.lookup("p").handlers["diloco.result"]

        async def count_then_freeze(caller, data):
            reply = await on_result(caller, data)
            got.append(caller)
            if len(got) == 2:  # a's and b's results are in: p holds every result now
                freezer.frozen = True
            return reply
        net.lookup("p").handlers["diloco.result"] = count_then_freeze

        deltas = _deltas(members, 30, seed=7)
        key0 = RoundKey(5, 0)
        first = await asyncio.gather(*(cs[x].run_round(key0, DIGEST, members, deltas[x], admit=admit)
                                       for x in members))
        outs0 = dict(zip(members, first))
        # a and b retry without waiting for p (a straggler now); p is still frozen
        fresh = _deltas(members, 30, seed=8)
        retry = await asyncio.gather(*(cs[x].run_round(RoundKey(5, 1), DIGEST, members, fresh[x], admit=admit,
                                                       wait_for=["a", "b"]) for x in ("a", "b")))
        outs1 = dict(zip(("a", "b"), retry))
        freezer.thaw()
        woke = await cs["p"].run_round(RoundKey(5, 1), DIGEST, members, fresh["p"], admit=admit)
        return outs0, outs1, woke, fresh

    outs0, outs1, woke, fresh = asyncio.run(main())
    assert not outs0["a"].committed and not outs0["b"].committed  # p's span never reached them
    assert outs1["a"].committed and outs1["b"].committed, (outs1["a"].reason, outs1["b"].reason)
    assert torch.equal(outs1["a"].aggregate, outs1["b"].aggregate)
    assert torch.allclose(outs1["a"].aggregate, _mean(fresh, ["a", "b"]), rtol=0, atol=1e-6)
    # the peer that held every result of the abandoned attempt never committed it ...
    assert not outs0["p"].committed and outs0["p"].in_doubt, outs0["p"].reason
    # ... and, awake, it learns the round is over (it downloads the swarm's state next)
    assert not woke.committed and woke.reason.startswith("late"), woke.reason


def test_members_that_accepted_a_value_go_on_in_doubt_once_only_a_frozen_member_could_make_a_quorum():
    """Found in a chaos soak (5 workers, a SIGSTOP): p's span result reached a and b, then p froze; c and d missed
    it, found p silent and gave the attempt up. a and b accepted the value and voted: 2 of 5 accepted, c and d
    moved past, p's vote unknown. Only p could still make a quorum, so a and b waited, in the decide step, until p
    woke (18 s in the soak; here the decide deadline). Now a vote unanswered through the answer window counts as
    silent: a and b go on in doubt within a window or so, and the next attempt of the four commits the value they
    accepted (carried), without p."""
    members = ["a", "b", "c", "d", "p"]
    cfg = replace(FAST, reduce_timeout=8.0, result_timeout=10.0, call_timeout=10.0)  # a 2 s answer window
    admit = _quorum_of(members)

    async def main():
        net = InProcNetwork()
        lost = {("p", "c", "diloco.result"), ("p", "d", "diloco.result"), ("c", "p", "diloco.result")}
        cs = {x: await Collective.create(net.transport(x, lambda t, n, x=x: (x, t, n) in lost), RUN, cfg)
              for x in members}
        freezer = _Freezer(net, "p")
        _once_both_answered(net, ("a", "b"), "diloco.result", "p", lambda: setattr(freezer, "frozen", True))
        deltas = _deltas(members, 30, seed=11)
        started = time.monotonic()
        runs = {x: asyncio.create_task(cs[x].run_round(RoundKey(4, 0), DIGEST, members, deltas[x], admit=admit))
                for x in members}
        first = {x: await runs[x] for x in ("a", "b", "c", "d")}
        took = time.monotonic() - started
        fresh = _deltas(members, 30, seed=12)
        four = ["a", "b", "c", "d"]
        second = dict(zip(four, await asyncio.gather(*(
            cs[x].run_round(RoundKey(4, 1), DIGEST, members, fresh[x], admit=admit, wait_for=four) for x in four))))
        freezer.thaw()
        runs["p"].cancel()
        return first, second, took, deltas

    first, second, took, deltas = asyncio.run(main())
    assert all(first[x].in_doubt for x in ("a", "b")), [first[x].reason for x in ("a", "b")]
    assert not any(first[x].committed or first[x].in_doubt for x in ("c", "d")), [first[x].reason for x in "cd"]
    assert took < cfg.result_timeout, took  # a window or so after c and d moved past, not the decide deadline
    for x in ("a", "b", "c", "d"):
        assert second[x].committed and second[x].reason == "committed the value of attempt 0", second[x].reason
        assert torch.allclose(second[x].aggregate, _mean(deltas, members), rtol=0, atol=1e-6)  # p's Δ included


@pytest.mark.parametrize("span_values", [None, 4], ids=["one_span_each", "four_spans_each"])
def test_a_value_a_quorum_accepted_is_carried_when_its_committer_dies(monkeypatch, span_values):
    """a and p accept attempt 0's value and a commits it (it got p's vote); p never hears back from a,
    and b misses a result, so neither of them knows. a dies. p and b are a quorum without it: their
    attempt 1 must commit a's value, not a fresh one (that would be a fork with a's state). p reports
    the value it accepted, the view carries it, b fetches it from p, and both commit it (also when the
    value has several spans per member)."""
    if span_values is not None:
        from diloco.comms import spans
        monkeypatch.setattr(spans, "SPAN_VALUES", span_values)
    members = ["a", "b", "p"]
    cfg = replace(FAST, gather_timeout=0.4, result_timeout=0.6, call_timeout=0.4, compression="fp32+ef:1")
    admit = _quorum_of(members)

    async def main():
        net = InProcNetwork()
        lost = {("p", "b", "diloco.result"), ("a", "p", "diloco.vote")}
        cs = {x: await Collective.create(net.transport(x, lambda t, n, x=x: (x, t, n) in lost), RUN, cfg)
              for x in members}
        on_vote, silent = net.lookup("a").handlers["diloco.vote"], asyncio.Event()

        async def takes_votes_answers_none(caller, data):  # a counts p's vote; p never hears back
            await on_vote(caller, data)
            await silent.wait()
        net.lookup("a").handlers["diloco.vote"] = takes_votes_answers_none

        deltas = _deltas(members, 30, seed=9)
        first = dict(zip(members, await asyncio.gather(*(
            cs[x].run_round(RoundKey(3, 0), DIGEST, members, deltas[x], admit=admit) for x in members))))
        net.kill("a")
        fresh = _deltas(members, 30, seed=10)
        second = dict(zip(("b", "p"), await asyncio.gather(*(
            cs[x].run_round(RoundKey(3, 1), DIGEST, members, fresh[x], admit=admit, wait_for=["b", "p"])
            for x in ("b", "p")))))
        return first, second, deltas

    first, second, deltas = asyncio.run(main())
    assert first["a"].committed, first["a"].reason
    assert torch.allclose(first["a"].aggregate, _mean(deltas, members), rtol=0, atol=1e-6)
    assert not first["p"].committed and first["p"].in_doubt, first["p"].reason
    assert not first["b"].committed and not first["b"].in_doubt
    for x in ("b", "p"):
        out = second[x]
        assert out.committed, out.reason
        assert out.reason == "committed the value of attempt 0"
        assert torch.equal(out.aggregate, first["a"].aggregate)  # one state for round 3, a's
        assert out.view == tuple(members) and out.value_id == first["a"].value_id  # the next quorum's base too
        assert list(out.phases) == ["gather", "fetch", "decide"], out.phases  # carried: its value, not a fresh one
    # b's own attempt-0 contribution counts as delivered (it is in the value), error feedback sees it
    assert torch.count_nonzero(second["b"].sent) > 0


def test_a_served_value_that_does_not_hash_to_its_id_is_refused():
    """A member asked for a carried value must serve the one named: members and frames are checked
    against the value id and every frame's view, span and size."""
    members = ["a", "b"]

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, members)
        seen: dict[str, bytes] = {}  # each owner's result frame, as the other member received it
        for x in members:
            inner = net.lookup(x).handlers["diloco.result"]

            async def keep(caller, data, inner=inner):
                seen[caller] = data
                return await inner(caller, data)
            net.lookup(x).handlers["diloco.result"] = keep
        deltas = _deltas(members, 20, seed=11)
        await _round(cs, RoundKey(1), members, deltas)  # a value to take apart
        incs = {p: cs[p].incarnation for p in members}
        vid = view_id(RoundKey(1), tuple(members), incarnations=incs)
        named = "\n".join(member_token(p, incs[p]) for p in members).encode()
        frames = [seen["a"], seen["b"]]
        good = msg.pack_bundle([(0, named), (1, frames[0]), (2, frames[1])])
        swapped = msg.pack_bundle([(0, named), (1, frames[1]), (2, frames[0])])
        other = msg.pack_bundle([(0, b"a\nc"), (1, frames[0]), (2, frames[1])])
        # the same peer ids, but not the processes that were ready (a restart's): another view
        restarted = msg.pack_bundle([(0, "\n".join(members).encode()), (1, frames[0]), (2, frames[1])])
        served = lambda body: msg.encode(msg.VALUE, run=RUN, sender="b", key=RoundKey(1), view=vid,  # noqa: E731
                                         body=body)
        ok = decide.read_value(cs["a"], "b", served(good), 1, vid, 20, 0)
        refused = []
        for body in (swapped, other, restarted):
            try:
                decide.read_value(cs["a"], "b", served(body), 1, vid, 20, 0)
            except Exception as e:  # noqa: BLE001
                refused.append(type(e).__name__ + ": " + str(e))
        return ok, refused

    ok, refused = asyncio.run(main())
    assert ok.view == ("a", "b") and len(ok.results) == 2
    assert len(refused) == 3 and all(r.startswith("PayloadRejected") for r in refused), refused


# ---------------------------------------------------------------------- frames at size


def test_a_large_share_is_cut_into_several_spans_per_member(monkeypatch):
    """When a member's share of Δ exceeds SPAN_VALUES, every member owns several spans (span s belongs to
    member s mod N), so no frame grows with the model; the round commits the same mean, and a value
    carried into a later attempt keeps its spans."""
    from diloco.comms import spans

    monkeypatch.setattr(spans, "SPAN_VALUES", 100)
    ids, numel = PEERS[:3], 1000  # a share of 334 values: 4 spans each, 12 in all
    sizes: list[int] = []

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, ids)
        for x in ids:
            inner = net.lookup(x).handlers["diloco.contrib"]

            async def measure(caller, data, inner=inner):
                sizes.append(msg.decode(data, run=RUN, kind=msg.CONTRIB, caller=caller, max_body=1 << 20)[0].numel)
                return await inner(caller, data)
            net.lookup(x).handlers["diloco.contrib"] = measure
        deltas = _deltas(ids, numel, seed=12)
        return deltas, await _round(cs, RoundKey(0), ids, deltas)

    deltas, outs = asyncio.run(main())
    assert spans.spans_for(numel, 3) == 12
    first = outs["p0"].aggregate
    for o in outs.values():
        assert o.committed, o.reason
        assert len(o.contributors) == 12 and o.contributors == [tuple(ids)] * 12
        assert torch.equal(o.aggregate, first)
    assert torch.allclose(first, _mean(deltas, ids), rtol=0, atol=1e-6)
    assert max(sizes) <= 100 and len(sizes) == 3 * 8  # each member sends the 8 spans it does not own


def test_an_owner_restarted_under_its_peer_id_mid_round_is_a_new_member_not_the_one_in_the_view():
    """p2 owns a span; it sends its result to p0, then dies (SIGKILL) before p1 and p3 got theirs, and comes back at
    once under the same peer id (`--identity`, `--resume`) from the state the round started from. The new process
    joins the same attempt, but it is a new incarnation: it never received the contributions sent to the old one,
    and a result it computed now would differ from the one p0 holds. Views name each member's incarnation, so the
    survivors give the attempt up within a probe window of the restart (not at the reduce deadline, after which the
    new process would send p1 and p3 another result for p2's span than p0's: two states for one round), and the
    next attempt commits with all four on one value."""
    victim, survivors = "p2", ["p0", "p1", "p3"]
    key = RoundKey(5, 0)

    async def main():
        net = InProcNetwork()
        cs = await _collectives(net, PEERS, PATIENT)
        p0_has_it, dead = asyncio.Event(), asyncio.Event()

        def result_gate(p):
            inner = net.lookup(p).handlers["diloco.result"]

            async def handler(caller, data):
                if caller == victim and not dead.is_set():
                    if p == "p0":
                        reply = await inner(caller, data)
                        p0_has_it.set()
                        return reply
                    await asyncio.wait_for(p0_has_it.wait(), 5)
                    dead.set()
                    net.kill(victim)  # between two of its result sends
                    raise ConnectionResetError("the victim died mid-call")
                return await inner(caller, data)
            return handler

        for p in survivors:
            net.lookup(p).handlers["diloco.result"] = result_gate(p)
        deltas = _deltas(PEERS, 203, seed=5)
        started = time.monotonic()
        first = {p: asyncio.create_task(cs[p].run_round(key, DIGEST, PEERS, deltas[p])) for p in PEERS}
        await asyncio.wait_for(dead.wait(), 5)
        first[victim].cancel()
        # the restart: a new process with the same peer id and the round's starting state, another Δ
        reborn = await Collective.create(net.transport(victim), RUN, PATIENT)
        again = asyncio.create_task(reborn.run_round(key, DIGEST, PEERS, _deltas([victim], 203, seed=9)[victim]))
        outs = {p: await first[p] for p in survivors}
        took = time.monotonic() - started
        reborn_out = await again
        # the next attempt, with the restarted process in it
        cs[victim] = reborn
        deltas2 = _deltas(PEERS, 203, seed=6)
        outs2 = await _round(cs, RoundKey(5, 1), PEERS, deltas2)
        return outs, reborn_out, took, outs2

    outs, reborn_out, took, outs2 = asyncio.run(main())
    values = {tuple(o.aggregate.tolist()) for o in [*outs.values(), reborn_out] if o.committed}
    assert len(values) <= 1, "two values committed for one round"
    assert not any(o.committed for o in [*outs.values(), reborn_out]), \
        {p: o.reason for p, o in [*outs.items(), ("p2 restarted", reborn_out)]}
    assert all("restarted since it joined this attempt" in outs[p].reason for p in ("p1", "p3")), outs
    assert outs["p0"].reason.startswith("abandoned"), outs["p0"].reason  # it held every result: it asked again
    assert took < PATIENT.reduce_timeout / 2, took  # a window or two of probes (1 s each), not the deadlines
    assert all(o.committed and o.view == tuple(PEERS) for o in outs2.values()), {p: o.reason for p, o in outs2.items()}
    assert len({tuple(o.aggregate.tolist()) for o in outs2.values()}) == 1
