"""The race on a slow link (`diloco bench race`): the finish-line arithmetic (pure), the setup's checks, and
the harness end to end with real peers across an emulated link.

The race's figures live in docs/BENCHMARKS.md; the end-to-end test checks that data-parallel and DiLoCo run
through real swarms on one lab and are timed against data-parallel's final loss, not how fast this machine is.
"""

from __future__ import annotations

import pytest

from diloco.bench.race import RaceSetup, curve, markdown_table, racers, run, standings, time_to


def _round(step, seconds, sent, loss=None):
    row = dict(event="round", step=step, train_seconds=seconds, bytes_sent=sent, committed=True)
    return row if loss is None else {**row, "eval_loss": loss}


def test_a_curve_is_the_evaluated_rounds_and_the_final_evaluation():
    lines = [_round(10, 1.0, 100, 3.0), _round(20, 2.0, 100), _round(30, 3.5, 100, 2.5),
             dict(event="final", steps=40, train_seconds=4.0, eval_loss=2.4, bytes_sent=400)]
    assert curve(lines) == [dict(seconds=1.0, step=10, eval_loss=3.0, bytes_sent=100),
                            dict(seconds=3.5, step=30, eval_loss=2.5, bytes_sent=300),
                            dict(seconds=4.0, step=40, eval_loss=2.4, bytes_sent=400)]
    # a last round evaluated at the final step is not counted twice
    ends_on_eval = lines[:3] + [_round(40, 4.0, 100, 2.4), lines[3]]
    assert curve(ends_on_eval)[-1] == dict(seconds=4.0, step=40, eval_loss=2.4, bytes_sent=400)
    assert len(curve(ends_on_eval)) == 3


def test_the_finish_line_is_data_parallels_final_loss_and_speedup_is_its_time_over_yours():
    dp = dict(name="data-parallel", eval_loss=2.0, curve=[dict(seconds=50.0, step=50, eval_loss=2.6, bytes_sent=5),
                                                         dict(seconds=100.0, step=100, eval_loss=2.0, bytes_sent=9)])
    fast = dict(name="DiLoCo", eval_loss=1.9, curve=[dict(seconds=4.0, step=100, eval_loss=2.1, bytes_sent=1),
                                                     dict(seconds=8.0, step=200, eval_loss=1.99, bytes_sent=2),
                                                     dict(seconds=12.0, step=300, eval_loss=1.9, bytes_sent=3)])
    never = dict(name="slow", eval_loss=2.2, curve=[dict(seconds=9.0, step=300, eval_loss=2.2, bytes_sent=1)])
    table = standings([dp, fast, never])
    assert [s["speedup"] for s in table] == [1.0, 12.5, None]  # 100 s / 8 s: the first point at or below 2.0
    assert table[1]["step"] == 200 and table[1]["bytes_sent"] == 2 and table[2]["seconds"] is None
    assert all(s["target"] == 2.0 for s in table)
    assert time_to(fast["curve"], 1.0) is None
    report = dict(standings=table, results=[{**r, "steps": 1, "train_seconds": 1, "utilization": 0.5}
                                            for r in (dp, fast, never)])
    text = markdown_table(report)
    assert "| DiLoCo | 8.0 s | 200 | 12.5× |" in text and "| slow | not reached | - | - | - |" in text


@pytest.mark.parametrize("bad, says", [
    (dict(peers=1), "at least 2 peers"),
    (dict(steps=130), "multiple of H"),
    (dict(tau=25), "tau"),
    (dict(rate_mbit=0), "rate"),
])
def test_a_race_that_cannot_run_is_refused_saying_why(bad, says):
    with pytest.raises(ValueError, match=says):
        RaceSetup(**bad)


def test_the_racers_share_what_they_must_and_differ_where_they_race():
    names = [r.name for r in racers(RaceSetup())]
    assert names == ["data-parallel", "DiLoCo H=50, fp32", "streaming P=2, τ=5, α=0, e3m0"]
    dp, diloco, streaming = racers(RaceSetup(dp_steps=300, steps=1000))
    assert "--data-parallel" in dp.flags and dp.flags[dp.flags.index("--rounds") + 1] == "300"
    assert diloco.flags[diloco.flags.index("--rounds") + 1] == "20"  # 1000 steps of H=50
    assert streaming.flags[streaming.flags.index("--overlap") + 1] == "5"


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_data_parallel_and_diloco_race_across_an_emulated_link(tmp_path):
    setup = RaceSetup(peers=2, rate_mbit=50.0, delay_ms=5.0, dp_steps=12, dp_eval_every=4, steps=24, inner_steps=6,
                      fragments=2, tau=1, d_model=32, layers=1, context=32, batch_size=2, warmup=2, timeout_s=150)
    lines: list[str] = []
    ticks: list[tuple] = []
    report = run(setup, workdir=tmp_path, progress=lines.append, tick=lambda *t: ticks.append(t),
                 which=racers(setup)[:2], measure=False)  # the lab's own link is tested in test_bench_overlap.py
    dp, diloco = report["results"]
    assert dp["digests_agree"] and diloco["digests_agree"]
    assert dp["steps"] == 12 and diloco["steps"] == 24
    # data-parallel moved the gradients every step (fp32, each peer sends about its half of every one and
    # gets the other half back); DiLoCo every 6 steps
    params = 4 * 32 * 32 * 3 + 256 * 32  # a lower bound: attention + embedding of the 1-block model
    assert dp["bytes_sent"] > 12 * 4 * params and diloco["bytes_sent"] < dp["bytes_sent"] / 2
    assert [p["step"] for p in dp["curve"]] == [4, 8, 12] and dp["curve"][-1]["eval_loss"] == dp["eval_loss"]
    assert [p["step"] for p in diloco["curve"]] == [6, 12, 18, 24]
    assert all(a["seconds"] < b["seconds"] for a, b in zip(dp["curve"], dp["curve"][1:]))
    first = report["standings"][0]
    assert first["speedup"] == 1.0 and first["target"] == dp["eval_loss"]
    assert "2 hosts in network namespaces" in lines[0] and report["measured_link"] is None
    assert ticks and all(0 <= t[0] <= 2 and t[1] == 2 for t in ticks)
