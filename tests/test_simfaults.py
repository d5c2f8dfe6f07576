"""Fault plans in `diloco simulate` (issue 5 item 7): the plan format and its checks (pure), the
projection's slow / degrade / loss / per-link terms (pure), and plans played out on simulated swarms:
every action fires exactly once, the survivors agree on one state, and a plan replays identically."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from cli_util import invoke, refuse_to_start

from diloco import CollectiveConfig, RobustConfig
from diloco.config import ConfigError, SwarmConfig
from diloco.sim.faults import Fault, check_plan, load_plan, parse_fault, random_plan
from diloco.sim.simulate import Link, NetworkModel, parse_link, project, simulate
from diloco.job.train import JobConfig

JOB = JobConfig(rounds=8, inner_steps=2, d_model=32, n_layer=1, batch_size=4, eval_batches=1, corpus_bytes=1 << 20)
SWARM = SwarmConfig(run_id="simfaults", round=CollectiveConfig(compression="e3m0", call_timeout=2.0),
                    heartbeat_interval=0.1, heartbeat_ttl=5.0)

EVERY_ACTION = [
    {"round": 1, "action": "kill", "peer": 3},
    {"round": 1, "action": "slow", "peer": 1, "factor": 3},
    {"round": 2, "action": "degrade", "peer": 0, "bandwidth_mbit": 5, "latency_ms": 100},
    {"round": 3, "action": "restart", "peer": 3},
    {"round": 4, "action": "partition", "peers": [2], "rounds": 2},
]


# ---------------------------------------------------------------------- the plan (pure)


def test_a_plan_entry_is_parsed_and_round_trips():
    f = parse_fault({"round": 2, "action": "degrade", "peer": 1, "latency_ms": 80}, 0, 4)
    assert f == Fault(2, "degrade", 1, latency_ms=80.0)
    assert parse_fault(f.as_dict(), 0, 4) == f
    p = parse_fault({"round": 5, "action": "partition", "peers": [3, 1]}, 0, 4)
    assert p.peers == (1, 3) and p.rounds == 2 and str(p) == "partition workers [1, 3] at round 5"


@pytest.mark.parametrize("item, needle", [
    ({"round": 1, "action": "explode", "peer": 0}, "not one of kill, restart"),
    ({"round": 1, "action": "kill"}, "'peer' must be an integer"),
    ({"round": -1, "action": "kill", "peer": 0}, "'round' must be an integer >= 0"),
    ({"round": 1, "action": "kill", "peer": 9}, "peer 9 does not exist (workers are 0..3)"),
    ({"round": 1, "action": "kill", "peer": 0, "factor": 2}, "kill takes ['action', 'peer', 'round'], not ['factor']"),
    ({"round": 1, "action": "slow", "peer": 0, "factor": 0}, "'factor' must be a number > 0"),
    ({"round": 1, "action": "degrade", "peer": 0}, "degrade needs bandwidth_mbit, latency_ms or loss"),
    ({"round": 1, "action": "degrade", "peer": 0, "loss": 1.0}, "'loss' must be in [0, 1)"),
    ({"round": 1, "action": "partition", "peers": [1, 1]}, "distinct worker indices"),
    ("kill 1", "expected an object"),
])
def test_a_bad_plan_entry_says_what_is_wrong(item, needle):
    with pytest.raises(ConfigError) as e:
        parse_fault(item, 3, 4)
    assert needle in str(e.value) and "fault #3" in str(e.value)


@pytest.mark.parametrize("plan, needle", [
    ([Fault(1, "kill", 0), Fault(2, "kill", 0)], "worker 0 is not running then"),
    ([Fault(1, "restart", 0)], "worker 0 is running then; kill it first"),
    ([Fault(1, "kill", 0), Fault(2, "slow", 0)], "worker 0 is not running then"),
    ([Fault(1, "partition", peers=(0, 1))], "fewer than half of the 4 running workers"),
    ([Fault(1, "kill", 3), Fault(2, "partition", peers=(0, 1))], "fewer than half of the 3 running workers"),
    ([Fault(1, "partition", peers=(0,), rounds=3), Fault(3, "kill", 1)], "falls within partition"),
    ([Fault(1, "kill", i) for i in range(4)], "kills the last running worker"),
])
def test_a_plan_that_cannot_play_out_is_refused(plan, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        check_plan(plan, 4)


def test_check_plan_accepts_every_action_in_order():
    check_plan([parse_fault(x, i, 4) for i, x in enumerate(EVERY_ACTION)], 4)
    check_plan([Fault(1, "partition", peers=(0,), rounds=2), Fault(3, "kill", 1)], 4)  # after the heal


def test_random_plans_are_valid_and_seeded():
    a = random_plan(7, 5, 20, 6)
    assert a == random_plan(7, 5, 20, 6) != random_plan(8, 5, 20, 6)
    assert len(a) == 6 and all(1 <= f.round <= 18 for f in a)
    check_plan(a, 5)
    for seed in range(30):
        check_plan(random_plan(seed, 3, 6, 4), 3)


def test_a_plan_file_is_read_and_checked(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"faults": EVERY_ACTION}))
    assert [f.action for f in load_plan(path, 4)] == ["kill", "slow", "degrade", "restart", "partition"]
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        load_plan(path, 4)
    with pytest.raises(ConfigError, match="does not exist"):
        load_plan(tmp_path / "none.json", 4)


# ---------------------------------------------------------------------- the projection (pure)


def test_loss_caps_tcp_throughput_by_the_mathis_bound():
    link = Link(bandwidth_mbit=1000, latency_ms=50, loss=0.01)
    mathis = 1460 * 8 / 0.1 * 1.22 / math.sqrt(0.01) / 1e6  # MSS / RTT · 1.22 / √p ≈ 1.43 Mbit/s
    assert link.throughput_mbit == pytest.approx(mathis)
    assert Link(bandwidth_mbit=1, latency_ms=50, loss=0.01).throughput_mbit == 1  # the link is the tighter cap
    assert Link(bandwidth_mbit=10, latency_ms=0, loss=0.01).throughput_mbit == 10
    assert link.seconds(1_000_000, 0) == pytest.approx(0.3 + 8 / mathis)  # 6 latencies of 50 ms


def test_the_slowest_link_of_a_round_sets_its_exchange_time():
    net = NetworkModel(bandwidth_mbit=8, latency_ms=0, step_seconds=1, links=((1, Link(1, 0)),))
    p = project([{0: (1_000_000, 0), 1: (1_000_000, 0)}], steps_per_round=1, overlap=0, workers=2, net=net,
                step_seconds=1)
    assert p.comm_seconds == pytest.approx(8.0)  # worker 1's 1 Mbit/s, not the default 8
    assert parse_link("1=1:0") == (1, Link(1, 0)) and parse_link("2=5:30:0.02") == (2, Link(5, 30, 0.02))
    for bad in ("1=5", "x=5:30", "1=5:30:0.1:9", "1=0:30"):
        with pytest.raises(ConfigError):
            parse_link(bad)


def test_slow_and_degrade_apply_from_the_round_after_they_fire():
    net = NetworkModel(bandwidth_mbit=8, latency_ms=0, step_seconds=1)
    rounds = [{0: (0, 0), 1: (0, 0)}] * 3
    slow = project(rounds, steps_per_round=2, overlap=0, workers=2, net=net, step_seconds=1,
                   faults=[Fault(1, "slow", 1, factor=4)])
    assert slow.wall_seconds == pytest.approx(2 + 8 + 8)  # round 1 at full speed, rounds 2-3 at worker 1's pace
    assert slow.compute_seconds == pytest.approx((6, 2 + 8 + 8))
    moved = [{0: (1_000_000, 0), 1: (0, 0)}] * 2
    degraded = project(moved, steps_per_round=1, overlap=0, workers=2, net=net, step_seconds=1,
                       faults=[Fault(1, "degrade", 0, bandwidth_mbit=1)])
    assert degraded.comm_seconds == pytest.approx(1 + 8)
    gone = project([{0: (0, 0), 1: (0, 0)}, {0: (0, 0)}], steps_per_round=1, overlap=0, workers=2, net=net,
                   step_seconds=1)
    assert gone.compute_seconds == pytest.approx((2, 1))  # a dead worker computes nothing


# ---------------------------------------------------------------------- plans played out


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_every_action_fires_exactly_once_and_the_survivors_agree():
    plan = [parse_fault(x, i, 4) for i, x in enumerate(EVERY_ACTION)]
    a = simulate(JOB, 4, swarm=SWARM, faults=plan, timeout=240)
    assert sorted(f["plan_index"] for f in a["faults_fired"]) == [0, 1, 2, 3, 4]
    assert [f["action"] for f in a["faults_fired"]] == ["kill", "slow", "degrade", "restart", "partition"]
    assert a["finished"] == 4 and len(a["digests"]) == 1 and a["round"] == JOB.rounds
    w = {x["worker"]: x for x in a["workers_seen"]}
    assert w[3]["incarnations"] == 2  # restarted (it caught up by download: it finished with the same digest)
    assert w[2]["refused"] >= 1 and w[2]["resyncs"] >= 1  # cut off: refused a round, resynced after the heal
    assert w[0]["refused"] == 0 and w[1]["refused"] == 0
    assert [len(r["digests"]) for r in a["rounds"]] == [1] * JOB.rounds  # no round forked
    b = simulate(JOB, 4, swarm=SWARM, faults=plan, timeout=240)
    assert b["faults_fired"] == a["faults_fired"]
    first = next((k for k, (x, y) in enumerate(zip(a["rounds"], b["rounds"])) if x != y), None)  # a plan replays exactly:
    assert first is None and b["digests"] == a["digests"], (a["rounds"][first:], b["rounds"][first:],  # round by round
                                                           a["workers_seen"], b["workers_seen"])


@pytest.mark.swarm
@pytest.mark.timeout(200)
def test_a_killed_worker_leaves_the_others_training():
    out = simulate(JOB, 3, swarm=SWARM, faults=[Fault(2, "kill", 1)], timeout=150)
    assert out["finished"] == 2 and len(out["digests"]) == 1 and out["round"] == JOB.rounds
    assert [f["action"] for f in out["faults_fired"]] == ["kill"]


def test_simulate_refuses_a_fault_after_the_last_round():
    with pytest.raises(ConfigError, match="the run ends at round 8"):
        simulate(JOB, 3, swarm=SWARM, faults=[Fault(8, "kill", 1)])


@pytest.mark.timeout(180)
def test_the_cli_reads_a_plan_and_says_what_fired(tmp_path, monkeypatch):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"round": 1, "action": "kill", "peer": 2}]}))
    tiny = ["--rounds", "3", "-H", "2", "--d-model", "32", "--layers", "1", "--batch-size", "4", "--workers", "3"]
    out = invoke(["simulate", *tiny, "--faults", str(plan), "--link", "0=20:80", "--loss", "0.001"])  # in this process
    assert out.exit_code == 0, (out.stderr[-2000:], out.exception)
    assert "fault fired: {'round': 1, 'action': 'kill', 'peer': 2, 'plan_index': 0}" in out.stdout
    refuse_to_start(monkeypatch, "diloco.sim.simulate.simulate")  # a bad plan is refused before it (in this process)
    bad = invoke(["simulate", *tiny, "--faults", "random:x"])
    assert bad.exit_code == 2 and "random:N needs a count" in bad.stderr, (bad.output, bad.exception)


# ---------------------------------------------------------------------- a poisoning worker

POISON_JOB = JobConfig(rounds=6, inner_steps=8, d_model=32, n_layer=1, batch_size=4, eval_batches=4,
                       corpus_bytes=1 << 20)
POISON = [Fault(1, "poison", 7, factor=1e4)]


@pytest.mark.swarm
@pytest.mark.timeout(600)
def test_one_of_eight_workers_poisoning_every_round_is_banned_and_training_goes_on():
    """A poisoning worker on the real training loop: worker 7 multiplies its pseudo-gradient by 1e4 from
    round 1 on. With robust aggregation (the default) it is clipped, then banned (and, seeing that in
    the others' records, stops), and worker 0's final loss is within 2% of the fault-free run's; with
    it off (the control) the model is wrecked."""
    swarm = replace(SWARM, run_id="poison").with_round(compression="fp32")
    clean = simulate(POISON_JOB, 8, swarm=swarm, timeout=500)
    defended = simulate(POISON_JOB, 8, swarm=swarm, faults=POISON, timeout=500)
    assert [f["action"] for f in defended["faults_fired"]] == ["poison"]
    assert defended["banned"] and defended["robust"].get("clipped", 0) >= 1
    assert defended["finished"] == 7 and len(defended["digests"]) == 1  # the poisoner learnt it was banned, stopped
    assert defended["eval_loss"] <= 1.02 * clean["eval_loss"], (defended["eval_loss"], clean["eval_loss"])
    # Three rounds show the wreck: the poison lands in round 1's aggregate; after it every worker's Δ is non-finite,
    # no round commits, and a longer run only spins on to the job's safety net of 4× its steps (12 CPU-s, not 3).
    undefended = simulate(replace(POISON_JOB, rounds=3), 8, swarm=swarm.with_round(robust=RobustConfig(clip=0, ban_after=0)),
                          faults=POISON, timeout=500)
    assert not undefended["banned"]
    assert not math.isfinite(undefended["eval_loss"]) or undefended["eval_loss"] > 1.5 * clean["eval_loss"], \
        (undefended["eval_loss"], clean["eval_loss"])


def test_a_poison_entry_is_parsed_and_never_drawn_at_random():
    assert parse_fault({"round": 2, "action": "poison", "peer": 1}, 0, 4) == Fault(2, "poison", 1, factor=1e4)
    with pytest.raises(ConfigError, match="other than 1"):
        parse_fault({"round": 2, "action": "poison", "peer": 1, "factor": 1}, 0, 4)
    assert all(f.action != "poison" for seed in range(50) for f in random_plan(seed, 4, 10, 5))
    # it stops once banned, at a round the plan cannot know: nothing may be planned for it afterwards
    for later in (Fault(5, "kill", 1), Fault(5, "slow", 1, factor=2.0), Fault(5, "partition", peers=(1,), rounds=2)):
        with pytest.raises(ConfigError, match="poison"):
            check_plan([Fault(2, "poison", 1, factor=1e4), later], 4)
    check_plan([Fault(2, "poison", 1, factor=1e4), Fault(5, "kill", 2)], 4)  # others are fine
