"""Gossip (diloco/gossip.py, docs/GOSSIP.md): rounds within small groups drawn from the round number, no
all-reduce, a state per peer.

Pure decisions first (groups, the outer gradient, whom a joiner downloads, which round to run, settings), then
in-process swarms of real `Swarm`s and `DiLoCo` workers (four peers that meet in changing pairs and stay close
together; a crashed partner; a joiner). Real processes: tests/test_multiproc.py."""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import replace
from itertools import combinations

import pytest
import torch
from test_swarm_inproc import CFG, PATIENT, _batches, _mlp, _run_threads, _worker_on

import diloco
from diloco import DiLoCo
from diloco.comms import InProcNetwork, PeerId, RoundKey
from diloco.comms.loop import LoopThread
from diloco.config import ConfigError
from diloco.comms.faults import FaultPlan
from diloco.gossip import gossip_gradient, history_scale, whole_norms
from diloco.peers.membership import FINAL_TAG, gossip_plan, group_of, group_tag, groups, round_to_run
from diloco.member import Member
from diloco.peers import InProcBoard, PeerRecord
from diloco.peers.membership import gossip_source

H = 3
GOSSIP = replace(CFG, topology="gossip")
CALM = replace(PATIENT, topology="gossip")
"""For runs whose every pair must meet and whose final average must take all four: no deadline may decide a round
(a loaded machine's stall passes CFG's 1-3 s)."""
PEERS = [PeerId(f"p{i}") for i in range(7)]


# ---------------------------------------------------------------------------------------------- pure decisions

def test_groups_cover_every_peer_once_and_fold_a_remainder_into_the_last_group():
    for n in range(2, 8):
        cut = groups(PEERS[:n], 5, "run", 2)
        assert sorted(p for g in cut for p in g) == sorted(PEERS[:n])
        assert sorted(len(g) for g in cut) == [2] * (n // 2 - 1) + [2 + n % 2], (n, cut)
    assert groups(PEERS[:1], 5, "run", 2) == [(PEERS[0],)]
    assert sorted(len(g) for g in groups(PEERS, 5, "run", 3)) == [3, 4]
    with pytest.raises(ValueError, match="at least 2"):
        groups(PEERS, 5, "run", 1)


def test_every_peer_draws_the_same_groups_and_they_change_from_round_to_round():
    shuffled = list(reversed(PEERS[:6]))
    assert groups(PEERS[:6], 9, "run", 2) == groups(shuffled, 9, "run", 2)
    assert all(group_of(p, [q for q in PEERS[:6] if q != p], 9, "run", 2) ==
               next(g for g in groups(PEERS[:6], 9, "run", 2) if p in g) for p in PEERS[:6])
    # over a few rounds a peer meets several partners (information spreads), and run ids draw differently
    partners = {q for r in range(12) for q in group_of(PEERS[0], PEERS[1:6], r, "run", 2) if q != PEERS[0]}
    assert len(partners) >= 4, partners
    assert any(groups(PEERS[:6], r, "run", 2) != groups(PEERS[:6], r, "other", 2) for r in range(4))


def test_a_group_tag_names_the_round_and_the_members_only():
    a, b, c = PEERS[:3]
    assert group_tag(3, (a, b)) == group_tag(3, (b, a))
    assert len({group_tag(3, (a, b)), group_tag(4, (a, b)), group_tag(3, (a, c))}) == 3


def test_the_gossip_gradient_of_one_group_of_equal_states_is_diloco_s_mean_pseudo_gradient():
    torch.manual_seed(0)
    theta = torch.randn(10)
    locals_ = [theta - torch.randn(10) * 0.1 for _ in range(3)]
    mean_delta = torch.stack([theta - x for x in locals_]).mean(0)
    assert torch.allclose(gossip_gradient(theta, torch.stack(locals_).mean(0)), mean_delta, atol=1e-6)
    # different states: the mean pseudo-gradient plus the pull toward the group's mean θ
    thetas = [torch.randn(10) for _ in range(2)]
    locs = [t - torch.randn(10) * 0.1 for t in thetas]
    g0 = gossip_gradient(thetas[0], (locs[0] + locs[1]) / 2)
    expected = ((thetas[0] - locs[0]) + (thetas[1] - locs[1])) / 2 + (thetas[0] - (thetas[0] + thetas[1]) / 2)
    assert torch.allclose(g0, expected, atol=1e-6)


def test_an_outer_gradient_far_above_our_recent_ones_is_scaled_down_to_clip_times_their_median():
    assert history_scale(100.0, [1.0, 2.0, 3.0], clip=4.0) == pytest.approx(8.0 / 100.0)
    assert history_scale(7.0, [1.0, 2.0, 3.0], clip=4.0) == 1.0
    assert history_scale(100.0, [1.0, 2.0], clip=4.0) == 1.0  # too few rounds remembered to judge, no Δ of our own
    assert history_scale(100.0, [1.0, 2.0, 3.0], clip=0.0) == 1.0  # off
    assert history_scale(100.0, [1.0, 2.0, 3.0], clip=0.0, own=1.0) == 1.0


def test_our_own_pseudo_gradient_is_a_usual_round_at_the_least():
    """Norms that grow from round to round (the inner lr's warm-up: 0.17, 0.44, 0.65, 0.81 in the four real peers'
    test) leave the history's median behind; our own Δ this round keeps up, and no partner can inflate it."""
    assert history_scale(1.4, [0.17, 0.32, 0.44], clip=4.0) < 1.0  # the median alone: an honest round scaled down
    assert history_scale(1.4, [0.17, 0.32, 0.44], clip=4.0, own=0.9) == 1.0
    assert history_scale(100.0, [0.17, 0.32, 0.44], clip=4.0, own=0.9) == pytest.approx(3.6 / 100.0)
    assert history_scale(100.0, [], clip=4.0, own=1.0) == pytest.approx(4.0 / 100.0)  # the first rounds are guarded
    assert history_scale(100.0, [9.0, 9.0, 9.0], clip=4.0, own=1.0) == pytest.approx(36.0 / 100.0)  # the larger


def test_the_whole_models_recent_norms_are_the_fragments_newest_together():
    # fragment 0's norms 3, 4 (newest last) and fragment 1's 4, 3: the newest whole-model norm is √(4² + 3²) = 5
    assert whole_norms([[1.0, 3.0, 4.0], [4.0, 3.0]]) == [5.0, 5.0]
    assert whole_norms([[2.0, 7.0]]) == [7.0, 2.0]
    assert whole_norms([[1.0], []]) == []


def _rec(peer: str, rnd: int, status: str = "training") -> PeerRecord:
    return PeerRecord(peer=PeerId(peer), status=status, round=rnd, digest=f"d-{peer}")


def test_a_joiner_downloads_the_newest_peer_and_a_peer_behind_jumps_to_the_newest_round():
    records = [_rec("b", 7), _rec("a", 7), _rec("c", 5), _rec("z", 9, "left")]
    source, why = gossip_source(records, PeerId("me"), 0)
    assert source is not None and source.peer == "a" and "round 7" in why
    assert gossip_source(records, PeerId("me"), 0, exclude=[PeerId("a")])[0].peer == "b"  # type: ignore[union-attr]
    assert gossip_source(records, PeerId("me"), 7)[0] is None
    assert gossip_source([], PeerId("me"), 0)[0] is None
    assert round_to_run(records, PeerId("c"), 5) == 6  # two behind: to the round before the newest (left peers
    assert round_to_run(records, PeerId("me"), 6) == 6  # do not count); one behind: our own, our partner may be there
    assert round_to_run(records, PeerId("me"), 8) == 8


def test_a_slots_plan_names_its_round_group_and_tag_or_why_it_runs_none():
    """`gossip_plan`, what a gossip slot runs: our group from the live peers we did not ban, at the round to run; the
    final average at the newest round with every live peer; no round alone, nor of another fragment's round."""
    records = [_rec("b", 7), _rec("a", 7), _rec("c", 7), _rec("z", 9, "left")]
    me = PeerId("me")
    plan = gossip_plan([*records, _rec("me", 7)], (), me=me, my_round=7, run_id="run", size=2)
    group = group_of(me, [PeerId(p) for p in "bac"], 7, "run", 2)
    assert plan.key == RoundKey(7) and not plan.skip and plan.tag == group_tag(7, group)
    assert sorted([*plan.others, me]) == sorted(group)
    final = gossip_plan(records, [PeerId("c")], me=me, my_round=6, run_id="run", size=2, everyone=True)
    assert final.key == RoundKey(7) and final.tag == FINAL_TAG and sorted(final.others) == ["a", "b"]
    assert gossip_plan(records, [PeerId(p) for p in "abc"], me=me, my_round=7, run_id="run", size=2).skip == \
        "no other peer to gossip with"
    behind = gossip_plan(records, (), me=me, my_round=5, run_id="run", size=2, fragments=2)  # round 6: fragment 0's
    assert behind.key == RoundKey(6) and behind.skip.startswith("behind") and not behind.others


def test_gossip_settings_are_checked_with_reasons():
    with pytest.raises(ConfigError, match="fp32"):
        diloco.SwarmConfig(topology="gossip", round=diloco.CollectiveConfig(compression="int8"))
    with pytest.raises(ConfigError, match="two topologies"):
        diloco.SwarmConfig(topology="gossip", region="eu")
    with pytest.raises(ConfigError, match="gossip_group"):
        diloco.SwarmConfig(topology="gossip", gossip_group=1)
    with pytest.raises(ConfigError, match="topology"):
        diloco.SwarmConfig(topology="ring")
    with pytest.raises(ConfigError, match="--overlap and --outer-overlap do not work with gossip"):
        _worker_on(GOSSIP, streaming=diloco.StreamingConfig(fragments=2, overlap=1))


# ---------------------------------------------------------------------------------------------- in-process swarms

class _Lab:
    """Gossiping peers on one in-process network, each a `DiLoCo` worker in a thread (or alone: no swarm)."""

    def __init__(self, peers: list[str], alone: bool = False, faults: dict[str, FaultPlan] | None = None,
                 cfg: diloco.SwarmConfig = GOSSIP) -> None:
        self.net, self.board, self.loop = InProcNetwork(), InProcBoard(), LoopThread()
        plans = faults or {}
        self.swarms = {} if alone else {p: diloco.Swarm.in_process(self.net, self.board, p, cfg, self.loop,
                                                                   **({"faults": plans[p]} if p in plans else {}))
                                        for p in peers}
        self.peers = peers
        self.workers: dict[str, DiLoCo] = {}
        self.joined_at: dict[str, int] = {}
        self.base = _mlp(5)

    def add(self, peer: str) -> None:
        self.swarms[peer] = diloco.Swarm.in_process(self.net, self.board, peer, GOSSIP, self.loop,
                                                    bootstrapped=True)

    def worker(self, peer: str, rounds: int, barrier: threading.Barrier | None = None, *,
               stop: threading.Event | None = None, finish: bool = False, **settings: object):
        def run() -> None:
            model = copy.deepcopy(self.base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            data = _batches(int(peer[1:]) + 100, 16)
            with DiLoCo(model, opt, swarm=self.swarms.get(peer), **{"inner_steps": H, **settings}) as d:
                self.workers[peer] = d
                self.joined_at[peer] = d.round
                if barrier is not None:
                    barrier.wait()
                k, deadline = 0, time.monotonic() + 90
                while d.round < rounds and time.monotonic() < deadline and not (stop and stop.is_set()):
                    x, y = data[k % len(data)]
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                    k += 1
                    time.sleep(0.01)
                if finish:
                    d.finish()
        return run

    def close(self) -> None:
        for s in self.swarms.values():
            s.close()
        self.loop.stop()

    def spread(self) -> float:
        """The largest distance between two peers' global states."""
        flat = {p: torch.cat([t.reshape(-1) for t in d.state.params]) for p, d in self.workers.items()}
        return max(float((flat[a] - flat[b]).norm()) for a, b in combinations(sorted(flat), 2))


def _run(lab: _Lab, rounds: int, finish: bool = False, **settings: object) -> None:
    barrier = threading.Barrier(len(lab.peers), timeout=20)
    try:
        _run_threads([lab.worker(p, rounds, barrier, finish=finish, **settings) for p in lab.peers], [barrier])
    finally:
        lab.close()


def test_four_peers_meet_in_changing_pairs_and_stay_closer_together_than_peers_alone():
    peers = ["p1", "p2", "p3", "p4"]
    lab, alone = _Lab(peers, cfg=CALM), _Lab(peers, alone=True)
    _run(lab, 8)
    _run(alone, 8)
    w = lab.workers
    assert all(d.round >= 8 for d in w.values())
    # most rounds met their pair (two members each), and over the run each peer met more than one partner
    met = {p: [r for r in d.reports if r.committed] for p, d in w.items()}
    assert all(len(m) >= 5 and all(r.peers == 2 for r in m) for m in met.values()), \
        {p: [(r.round, r.reason) for r in d.reports] for p, d in w.items()}
    assert all(len(d.gossip.partners) >= 2 for d in w.values()), {p: d.gossip.partners for p, d in w.items()}
    assert all(d.gossip.clipped == 0 for d in w.values())  # honest rounds are never far above the recent ones
    # no global state: each peer holds its own (and publishes its own digest) ...
    assert len({d.digest for d in w.values()}) == 4
    # ... but averaging pulls them together: far closer than the same peers training alone
    assert lab.spread() < 0.5 * alone.spread(), (lab.spread(), alone.spread())


def test_the_run_ends_on_one_model_the_average_of_every_peers_state():
    """`finish()` (a launched run's end calls it): one average of all four peers' states, taken by every peer: one
    model, the mean of the states they held, in every peer's model and θ; each keeps its own outer state."""
    peers = ["p1", "p2", "p3", "p4"]
    lab = _Lab(peers, cfg=CALM)
    before: dict[str, list[torch.Tensor]] = {}
    real_finish = DiLoCo.finish

    def finish(d: DiLoCo) -> None:  # the states as they were when each peer's loop ended
        before[d.member.swarm.peer_id] = [t.clone() for t in d.state.params]
        real_finish(d)

    DiLoCo.finish = finish  # type: ignore[method-assign]
    try:
        _run(lab, 4, finish=True)
    finally:
        DiLoCo.finish = real_finish  # type: ignore[method-assign]
    w = lab.workers
    assert all(d.gossip.final == 4 for d in w.values()), {p: d.gossip.final for p, d in w.items()}
    assert all(d.gossip.clipped == 0 for d in w.values())  # honest states: the average is not scaled down
    assert len({d.topology.final_digest(d.member) for d in w.values()}) == 1
    mean = [torch.stack(ts).mean(0) for ts in zip(*before.values())]
    for d in w.values():
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(d.state.params, mean))
        assert all(torch.equal(p.detach(), t) for p, t in zip(d.model.parameters(), d.state.params))
    assert len({d.digest for d in w.values()}) == 4  # the outer optimizers' states stay each peer's own


def test_streaming_fragments_gossip_one_fragment_a_round_in_turn_and_the_run_ends_on_one_model():
    """Gossip with two fragments (each round one fragment's, in turn, a slot every H/2 steps): a round moves only its
    fragment of θ, the two fragments take turns, most rounds meet their pair, and the run still ends on one model."""
    peers = ["p1", "p2", "p3", "p4"]
    lab = _Lab(peers, cfg=CALM)
    moved: dict[str, list[tuple[int, int, list[bool]]]] = {p: [] for p in peers}
    real_step_to = Member.step_to

    def step_to(m, gradient, rnd, lr_scale, params=None, alpha=0.0):  # which parameters each round's step moved
        before = [t.clone() for t in m.holding.params]
        real_step_to(m, gradient, rnd, lr_scale, params, alpha)
        moved[m.swarm.peer_id].append((rnd, -1 if params is None else params[0],
                                       [not torch.equal(a, b) for a, b in zip(before, m.holding.params)]))

    Member.step_to = step_to  # type: ignore[method-assign]
    try:
        _run(lab, 8, finish=True, inner_steps=4, streaming=diloco.StreamingConfig(fragments=2))
    finally:
        Member.step_to = real_step_to  # type: ignore[method-assign]
    w = lab.workers
    assert all(len(d.fragments) == 2 and d.round >= 8 for d in w.values())
    fragments = {f.params[0]: set(f.params) for f in next(iter(w.values())).fragments}
    for p, steps in moved.items():
        assert {first for _, first, _ in steps} == set(fragments), steps  # both fragments took rounds
        for rnd, first, changed in steps:  # round r is fragment r − 1 mod 2's (r: the round its step makes)
            assert fragments[first] == {i for i, c in enumerate(changed) if c}, (p, rnd, first, changed)
            assert sorted(fragments)[(rnd - 1) % 2] == first, (p, rnd, first)
    met = {p: [r for r in d.reports if r.committed] for p, d in w.items()}
    assert all(len(m) >= 5 and {r.fragment for r in m} == {0, 1} for m in met.values()), \
        {p: [(r.round, r.fragment, r.reason) for r in d.reports] for p, d in w.items()}
    assert all(d.gossip.final == 4 and d.gossip.clipped == 0 for d in w.values())
    assert len({d.topology.final_digest(d.member) for d in w.values()}) == 1


def test_a_crashed_partner_costs_a_solo_round_and_the_others_go_on_and_a_joiner_takes_a_peers_state():
    peers = ["p1", "p2", "p3", "p4"]
    lab = _Lab(peers)
    barrier = threading.Barrier(4, timeout=20)
    stop_p4 = threading.Event()
    errors: list[BaseException] = []

    def conductor() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ("p4" in lab.workers and lab.workers["p4"].round >= 3):
            time.sleep(0.02)
        lab.swarms["p4"].crash()  # SIGKILL-like: calls to it fail from now on
        stop_p4.set()
        lab.add("p5")  # a new peer joins the gossip while the others train
        try:
            lab.worker("p5", 14)()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    try:
        _run_threads([*(lab.worker(p, 14, barrier) for p in peers[:3]), lab.worker("p4", 99, barrier, stop=stop_p4),
                      conductor], [barrier])
    finally:
        lab.close()
    assert not errors, errors
    w = lab.workers
    assert all(w[p].round >= 14 for p in [*peers[:3], "p5"])
    # a peer drawn with the crashed one ran alone until its record expired, and while the peers' records disagreed
    # on who is there (the joiner) some groups did not meet; the others kept meeting throughout
    assert all(w[p].gossip.met >= 3 for p in peers[:3]), {p: (w[p].gossip.met, w[p].gossip.solo) for p in peers[:3]}
    # the joiner started from one peer's state (a later round than 0), not its own initialization, and gossiped; its
    # first pick may be the crashed p4 (its record outlives it, and it is at the newest round): that download fails
    # once, and p4 is tried last from then on
    assert lab.joined_at["p5"] >= 3 and w["p5"].catch_up.failures <= 1, w["p5"].catch_up.bad_sources
    assert w["p5"].gossip.met >= 2, [(r.round, r.reason) for r in w["p5"].reports]


def test_a_partner_that_sends_absurd_parameters_moves_its_partners_only_as_far_as_a_few_usual_rounds():
    """p4 holds the secret and goes bad from round 3: it sends its local parameters × 50 (admitted: finite, RMS
    under max_update_rms). A pair's median cannot tell which of two is wrong; each honest partner's own history
    can: its step that round is scaled down to clip (4) × its recent rounds'. The honest peers stay within a
    few times their clean size, the run's final average of all four included (scaled down as any round); with
    clipping off, the same run throws them far out."""
    peers, honest = ["p1", "p2", "p3", "p4"], ["p1", "p2", "p3"]

    def run(clip: float) -> dict[str, DiLoCo]:
        plan = FaultPlan("poison@3")
        plan.poison_factor = 50.0
        lab = _Lab(peers, faults={"p4": plan}, cfg=CALM.with_round(robust=diloco.RobustConfig(clip=clip)))
        _run(lab, 10, finish=True)
        return lab.workers

    def size(w: DiLoCo) -> float:
        return float(torch.cat([t.reshape(-1) for t in w.state.params]).norm())

    clean = _Lab(peers, cfg=CALM)
    _run(clean, 10)
    usual = max(size(clean.workers[p]) for p in honest)
    guarded, open_ = run(4.0), run(0.0)
    victims = [p for p in honest if "p4" in guarded[p].gossip.partners]
    assert victims and all(guarded[p].gossip.clipped >= 1 for p in victims), \
        {p: (guarded[p].gossip.partners, guarded[p].gossip.clipped) for p in honest}
    assert all(guarded[p].gossip.final == 4 for p in honest)  # the final average with p4 happened, scaled down
    assert all(size(guarded[p]) < 5 * usual for p in honest), ([size(guarded[p]) for p in honest], usual)
    assert max(size(open_[p]) for p in honest) > 20 * usual, ([size(open_[p]) for p in honest], usual)
