"""`diloco simulate`: the projection model (pure), determinism, and the simulator as a real swarm.

The simulated run equals a real swarm of hivemind peers bit for bit: see
test_multiproc.py::test_two_runs_of_the_same_swarm_reach_the_same_state.
"""

from __future__ import annotations

import pytest

from cli_util import invoke, refuse_to_start

from diloco import CollectiveConfig
from diloco.config import ConfigError, SwarmConfig
from diloco.sim.faults import random_plan
from diloco.sim.simulate import NetworkModel, project, simulate, step_seconds
from diloco.bench.convergence import data_parallel
from diloco.job.train import JobConfig, run_job

TINY = JobConfig(rounds=2, inner_steps=4, d_model=32, n_layer=1, batch_size=4, eval_batches=1, corpus_bytes=1 << 20)


# ---------------------------------------------------------------------- the projection (pure)


def test_projection_is_the_closed_form_on_a_synthetic_run():
    """4 rounds of 10 steps at 0.1 s, 1 MB out and 0.5 MB in per round on 8 Mbit/s, 10 ms links:
    a round takes 6 × 10 ms (three round trips) + 1 MB × 8 / 8 Mbit/s = 1.06 s."""
    net = NetworkModel(bandwidth_mbit=8, latency_ms=10, step_seconds=0.1)
    rounds = [(1_000_000, 500_000)] * 4
    plain = project(rounds, steps_per_round=10, overlap=0, workers=2, net=net, step_seconds=99.0)
    assert plain.comm_seconds == pytest.approx(4 * 1.06)
    assert plain.blocked_seconds == pytest.approx(4 * 1.06)  # nothing overlaps: every exchange blocks
    assert plain.wall_seconds == pytest.approx(4 * (1.0 + 1.06))
    assert plain.utilization == pytest.approx((4.0 / 8.24, 4.0 / 8.24))
    # τ = 5 steps (0.5 s) hide half of each exchange; τ = 11 steps hide all of it
    assert project(rounds, steps_per_round=10, overlap=5, workers=2, net=net, step_seconds=1).blocked_seconds == \
        pytest.approx(4 * 0.56)
    hidden = project(rounds, steps_per_round=10, overlap=11, workers=2, net=net, step_seconds=1)
    assert hidden.blocked_seconds == 0 and hidden.utilization == pytest.approx((1.0, 1.0))
    # what a round takes on the workers' machines (`--round-overhead-ms`) adds to every round's time on the link,
    # and τ steps hide it as they hide the link's
    busy = NetworkModel(bandwidth_mbit=8, latency_ms=10, step_seconds=0.1, round_overhead_ms=140)
    assert project(rounds, steps_per_round=10, overlap=0, workers=2, net=busy, step_seconds=1).wall_seconds == \
        pytest.approx(4 * (1.0 + 1.2))
    assert project(rounds, steps_per_round=10, overlap=11, workers=2, net=busy, step_seconds=1).blocked_seconds == \
        pytest.approx(4 * 0.1)


def test_projection_moves_at_the_slowest_workers_pace():
    net = NetworkModel(bandwidth_mbit=1000, latency_ms=0, step_seconds=0.1, speeds=(1.0, 0.5))
    p = project([(0, 0)] * 3, steps_per_round=10, overlap=0, workers=2, net=net, step_seconds=1)
    assert p.wall_seconds == pytest.approx(3 * 10 * 0.2)
    assert p.utilization == pytest.approx((0.5, 1.0))  # the fast worker waits half the time


def test_network_model_rejects_impossible_links():
    for bad in (dict(bandwidth_mbit=0), dict(latency_ms=-1), dict(step_seconds=0), dict(speeds=(1.0, 0.0)),
                dict(round_overhead_ms=-1)):
        with pytest.raises(ConfigError):
            NetworkModel(**bad)
    with pytest.raises(ConfigError, match="speeds lists 1 workers"):
        project([(1, 1)], steps_per_round=1, overlap=0, workers=2, net=NetworkModel(speeds=(1.0,)), step_seconds=1)


# ---------------------------------------------------------------------- the simulator


@pytest.mark.swarm
def test_simulation_is_deterministic_under_its_seed():
    cfg = SwarmConfig(run_id="sim", round=CollectiveConfig(compression="e3m0"))
    a = simulate(TINY, 3, swarm=cfg)
    b = simulate(TINY, 3, swarm=cfg)
    other = simulate(JobConfig(**{**TINY.__dict__, "seed": 1}), 3, swarm=cfg)
    assert len(a["digests"]) == 1 and a["digests"] == b["digests"] != other["digests"]
    assert a["round"] == TINY.rounds and a["bytes_sent"] > 0
    assert 0 < a["projection"]["min_utilization"] <= 1


@pytest.mark.swarm
def test_one_simulated_worker_is_local_training():
    """M=1 through the whole round protocol (fp32) ends where the wrapper without a swarm does."""
    sim = simulate(TINY, 1, swarm=SwarmConfig(run_id="sim1", round=CollectiveConfig(compression="fp32")))
    local = run_job(JobConfig(**{**TINY.__dict__, "shard": 0}), None)
    assert sim["digests"] == [local["digest"]]


@pytest.mark.swarm
def test_simulation_reports_progress_to_the_last_step():
    seen = []
    simulate(TINY, 2, swarm=SwarmConfig(run_id="simp"), progress=lambda *p: seen.append(p))
    total = 2 * TINY.rounds * TINY.inner_steps
    assert seen[0][1] == total and seen[-1] == (total, total, "round 2/2, 2 workers")
    assert [p[0] for p in seen] == sorted(p[0] for p in seen)


@pytest.mark.swarm
def test_simulate_cli_shows_progress_lines_on_stderr_off_a_terminal_and_none_with_quiet():
    from typer.testing import CliRunner

    from diloco.cli.main import app

    args = ["simulate", "--workers", "2", "--rounds", "2", "-H", "2", "--d-model", "16", "--layers", "1",
            "--batch-size", "2"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    lines = out.stderr.splitlines()
    assert lines and all(ln.startswith("simulate") for ln in lines), lines
    assert lines[-1].startswith("simulate: done in") and lines[-1].endswith("(round 2/2, 2 workers)")
    assert "held-out loss" in out.stdout and "simulate:" not in out.stdout  # results on stdout, progress not
    quiet = CliRunner().invoke(app, [*args, "--quiet"])
    assert quiet.exit_code == 0 and quiet.stderr == "" and "held-out loss" in quiet.stdout


@pytest.mark.swarm
def test_simulate_runs_gossip_each_worker_meeting_its_group_every_round():
    """`diloco simulate --topology gossip`: the same workers (the wrapper, the round protocol) in groups of two,
    each stepping a state of its own (docs/GOSSIP.md): every worker met its group. One round for four workers (a
    pair that finished a later round and left while the other pair drew its groups would leave that pair to wait
    out the gather timeout, by design: docs/GOSSIP.md); two workers, one group, run two rounds below."""
    job = JobConfig(**{**TINY.__dict__, "rounds": 1})
    sim = simulate(job, 4, swarm=SwarmConfig(run_id="simg", round=CollectiveConfig(compression="fp32"), topology="gossip"))
    assert sim["topology"] == "gossip" and sim["finished"] == 4 and sim["round"] == 1
    assert sim["gossip_met"] == [1, 1, 1, 1], sim["workers_seen"]
    assert len(sim["digests"]) == 2  # a state per pair (same start, same mean), not one global state
    out = invoke(["simulate", "--workers", "2", "--rounds", "2", "-H", "2", "--d-model", "16", "--layers", "1",
                  "--batch-size", "2", "--topology", "gossip", "--compression", "fp32", "--quiet"])
    assert out.exit_code == 0 and "states (gossip: each worker steps its own)" in out.stdout, out.output
    with pytest.raises(ConfigError, match="not supported with gossip yet"):
        simulate(job, 2, swarm=SwarmConfig(run_id="simg", round=CollectiveConfig(compression="fp32"), topology="gossip"),
                 faults=random_plan(0, 2, 3, 1))


def test_simulate_cli_rejects_bad_flags_before_running(monkeypatch):
    refuse_to_start(monkeypatch, "diloco.sim.simulate.simulate")
    for args, needle in ((["--workers", "2", "--speeds", "1,x"], "--speeds"),
                         (["--workers", "2", "--speeds", "1,1,1"], "one speed per worker"),
                         (["--bandwidth-mbit", "0"], "bandwidth_mbit"),
                         (["-H", "10", "--fragments", "3"], "divisible"),
                         (["--topology", "gossip", "--compression", "e3m0"], "use --compression fp32")):
        out = invoke(["simulate", *args])
        assert out.exit_code == 2 and needle in out.stderr, (args, out.output, out.exception)


def test_step_time_is_compute_outside_sync_scaled_by_the_core_share():
    finals = [{"usage": {"wall_seconds": 10.0, "sync_seconds": 2.0, "steps": 8}},
              {"usage": {"wall_seconds": 12.0, "sync_seconds": 0.0, "steps": 8}}]
    # each worker had one of two cores: no scaling; with one core, each ran half the time
    assert step_seconds(finals, cores=2) == pytest.approx((1.0 + 1.5) / 2)
    assert step_seconds(finals, cores=1) == pytest.approx((1.0 + 1.5) / 2 / 2)


@pytest.mark.swarm
def test_data_parallel_through_the_swarm_is_data_parallel_training():
    """`JobConfig(data_parallel=True)`: a round per step averages the workers' gradients and AdamW steps the
    global model on the same warmup + cosine schedule, so two simulated workers end where one model trained on
    both workers' batches does (`diloco bench convergence`'s baseline)."""
    job = JobConfig(rounds=12, inner_steps=1, d_model=32, n_layer=1, batch_size=4, eval_batches=2,
                    corpus_bytes=1 << 20, data_parallel=True, lr=4e-3, warmup=3, schedule="cosine")
    sim = simulate(job, 2, swarm=SwarmConfig(run_id="dp", round=CollectiveConfig(compression="fp32")))
    one_model = data_parallel(JobConfig(**{**job.__dict__, "data_parallel": False}), 2, 12)
    assert len(sim["digests"]) == 1 and sim["round"] == 12
    assert sim["eval_loss"] == pytest.approx(one_model["eval_loss"], rel=1e-5)
    # the schedule matters: the same run at a constant lr ends elsewhere
    constant = data_parallel(JobConfig(**{**job.__dict__, "data_parallel": False, "schedule": "constant"}), 2, 12)
    assert abs(constant["eval_loss"] - one_model["eval_loss"]) > 1e-3


@pytest.mark.parametrize("bad, says", [
    (dict(inner_steps=4), "--inner-steps 1"),
    (dict(inner_steps=1, outer_lr=0.5), "leave --outer-lr"),
    (dict(inner_steps=1, outer_warmup=3), "leave --outer-lr"),
])
def test_data_parallel_rejects_diloco_knobs_saying_which(bad, says):
    with pytest.raises(ConfigError, match=says):
        JobConfig(data_parallel=True, **bad)


def test_the_projection_takes_each_rounds_own_steps_under_an_h_schedule():
    net = NetworkModel(bandwidth_mbit=8, latency_ms=10, step_seconds=0.1)
    rounds = [(1_000_000, 500_000)] * 3
    varied = project(rounds, steps_per_round=[10, 10, 2], overlap=0, workers=2, net=net, step_seconds=1)
    assert varied.compute_seconds == pytest.approx((2.2, 2.2)) and varied.wall_seconds == pytest.approx(2.2 + 3 * 1.06)


def test_the_projection_of_rounds_by_time_takes_each_workers_own_steps():
    """Rounds by time: each worker's steps a round, by worker; a round's compute lasts as long as its slowest
    member's steps, so workers whose steps fill the same time are all busy."""
    net = NetworkModel(bandwidth_mbit=1000, latency_ms=0, step_seconds=0.1, speeds=(1.0, 0.5, 0.25))
    by_time = project([(0, 0)] * 2, steps_per_round=[{0: 40, 1: 20, 2: 10}] * 2, overlap=0, workers=3, net=net,
                      step_seconds=1)
    assert by_time.wall_seconds == pytest.approx(8.0) and by_time.utilization == pytest.approx((1.0, 1.0, 1.0))
    fixed = project([(0, 0)] * 2, steps_per_round=40, overlap=0, workers=3, net=net, step_seconds=1)
    assert fixed.wall_seconds == pytest.approx(32.0) and fixed.utilization == pytest.approx((0.25, 0.5, 1.0))
    # τ = 5 steps hide the exchange at the fastest worker's pace by time (it needs the result first): 0.5 s of 1.06 s
    slow_link = NetworkModel(bandwidth_mbit=8, latency_ms=10, step_seconds=0.1, speeds=(1.0, 0.5, 0.25))
    hidden = project([(1_000_000, 500_000)], steps_per_round=[{0: 40, 1: 20, 2: 10}], overlap=5, workers=3,
                     net=slow_link, step_seconds=1)
    assert hidden.blocked_seconds == pytest.approx(1.06 - 0.5)


@pytest.mark.swarm
def test_simulate_runs_rounds_by_time_each_worker_stepping_at_its_speed():
    """`diloco simulate --round-seconds 0.8 --step-seconds 0.1 --speeds 1,0.5,0.25`: in simulated time the workers
    take 8, 4 and 2 steps a round, their pseudo-gradients weighted by them, one digest; the projection has every
    worker busy, where the same run with fixed H leaves the fast ones waiting for the slowest."""
    job = JobConfig(**{**TINY.__dict__, "round_seconds": 0.8, "rounds": 3})
    net = NetworkModel(bandwidth_mbit=1000, latency_ms=1, step_seconds=0.1, speeds=(1.0, 0.5, 0.25))
    out = simulate(job, 3, swarm=SwarmConfig(run_id="simt", round=CollectiveConfig(compression="fp32")), net=net)
    p = out["projection"]
    assert len(out["digests"]) == 1 and out["round"] == 3
    assert p["steps_per_round"] == {"0": 8.0, "1": 4.0, "2": 2.0}
    assert p["min_utilization"] > 0.9, p
    fixed = simulate(JobConfig(**{**TINY.__dict__, "inner_steps": 8, "rounds": 3}), 3,
                     swarm=SwarmConfig(run_id="simf", round=CollectiveConfig(compression="fp32")), net=net)["projection"]
    assert fixed["min_utilization"] < 0.3 and fixed["wall_seconds"] > 3 * p["wall_seconds"], fixed
    with pytest.raises(ConfigError, match="--step-seconds"):
        simulate(job, 2, net=NetworkModel())


def test_simulate_runs_adaptive_rounds_h_steps_of_the_fastest_worker():
    """`diloco simulate --adaptive -H 8 --step-seconds 0.1 --speeds 1,0.5,0.25`: a round lasts 8 steps of the fastest
    worker (0.8 simulated seconds), so the workers take 8, 4 and 2 steps a round from the first round on (the
    simulated records are always fresh), one digest."""
    job = JobConfig(**{**TINY.__dict__, "adaptive": True, "inner_steps": 8, "rounds": 3})
    net = NetworkModel(bandwidth_mbit=1000, latency_ms=1, step_seconds=0.1, speeds=(1.0, 0.5, 0.25))
    out = simulate(job, 3, swarm=SwarmConfig(run_id="sima", round=CollectiveConfig(compression="fp32")), net=net)
    assert len(out["digests"]) == 1 and out["round"] == 3
    assert out["projection"]["steps_per_round"] == {"0": 8.0, "1": 4.0, "2": 2.0}
    with pytest.raises(ConfigError, match="--step-seconds"):
        simulate(job, 2, net=NetworkModel())


# ---------------------------------------------------------------------- regions (docs/REGIONS.md)

MB = 1_000_000


def test_the_regions_projection_runs_regions_in_parallel_and_charges_merges_to_the_links_between():
    """Two regions; eu's inside link is 10× faster than the 8 Mbit/s links between regions (us has none of its
    own). Compute is 1 s a round; 1 MB takes 0.1 s inside eu and 1 s elsewhere."""
    from diloco.sim.simulate import Link, RegionRun, project_regions

    net = NetworkModel(bandwidth_mbit=8.0, latency_ms=0.0, region_links=(("eu", Link(80.0, 0.0)),))
    both = {0: (MB, MB), 1: (MB, MB)}
    runs = {"eu": RegionRun((0, 1), {1: both, 2: both, 4: both}, {3: {0: (MB, MB)}}, {3: {1: (0, MB)}}),
            "us": RegionRun((2, 3), {1: {2: (MB, MB), 3: (MB, MB)}, 2: {2: (MB, MB), 3: (MB, MB)},
                                     4: {2: (MB, MB), 3: (MB, MB)}}, {3: {2: (2 * MB, 2 * MB)}}, {3: {3: (0, MB)}})}
    p = project_regions(runs, steps_per_round=10, workers=4, net=net, step_seconds=0.1)
    # before the merge: eu 2 × 1.1 s, us 2 × 2 s (the slower region sets the pace); after: eu 1.1, us 2.0;
    # the merge: us's representative's 2 MB between regions (2 s); downloads: us's 1 MB inside us (1 s)
    assert p["wall_seconds"] == pytest.approx(4.0 + 2.0 + 2.0 + 1.0)
    assert (p["merges"], p["merge_seconds"], p["download_seconds"]) == (1, 2.0, 1.0)
    assert p["utilization"] == [pytest.approx(3 / 9, abs=1e-4)] * 4


@pytest.mark.swarm
def test_simulate_runs_regions_and_projects_them_onto_links_inside_and_between():
    from diloco.sim.simulate import Link

    job = JobConfig(**{**TINY.__dict__, "rounds": 6})  # region rounds: a merge after every 2, each counted as one
    net = NetworkModel(bandwidth_mbit=10.0, latency_ms=50.0, step_seconds=0.01,
                       region_links=(("eu", Link(1000.0, 1.0)), ("us", Link(1000.0, 1.0))))
    s = simulate(job, 4, swarm=SwarmConfig(run_id="simr", merge_every=2), net=net, regions=("eu", "eu", "us", "us"))
    p = s["projection"]
    assert s["regions"] == ["eu", "eu", "us", "us"] and len(s["digests"]) <= 2  # one state per region
    assert p["merges"] >= 1 and p["merge_seconds"] > 4 * 0.05 * p["merges"]  # merges pay the slow link's latency
    flat = simulate(job, 4, swarm=SwarmConfig(run_id="simf"), net=NetworkModel(bandwidth_mbit=10.0, latency_ms=50.0,
                                                                                step_seconds=0.01))
    assert p["wall_seconds"] < flat["projection"]["wall_seconds"], (p, flat["projection"])


def test_simulate_with_regions_refuses_what_it_cannot_do_saying_why(monkeypatch):
    for regions, kw, says in ((("eu", "us"), {}, "one per worker"), (("eu", "eu", "eu"), {}, "at least two"),
                              (("eu", "eu", "us"), {"net": NetworkModel(region_links=(("ap", NetworkModel().link(0)),))},
                               "which no worker is in")):
        with pytest.raises(ConfigError, match=says):
            simulate(TINY, 3, regions=regions, **kw)
    refuse_to_start(monkeypatch, "diloco.sim.simulate.simulate")
    out = invoke(["simulate", "--region-link", "eu:10"])
    assert out.exit_code == 2 and "NAME=MBIT:MS" in out.stderr, (out.output, out.exception)
