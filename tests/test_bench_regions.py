"""`diloco bench regions` (diloco/bench/regions.py): the setup's checks, the variants' flags, and one small
run of each variant on a two-region emulated network (real peers in network namespaces; needs root)."""

from __future__ import annotations

import pytest

from diloco.bench.regions import RegionsSetup, run, variants
from diloco.bench.wan import WanLab

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("bad, says", [(dict(regions=(0, 0)), "two regions"),
                                       (dict(budget=1000, inner_steps=50, merge_every=(3,)), "end on a merge"),
                                       (dict(steps=1010, inner_steps=50), "multiple of H"),
                                       (dict(cross_rate_mbit=0.0), "rates > 0")])
def test_a_setup_that_cannot_run_is_refused_saying_why(bad, says):
    with pytest.raises(ValueError, match=says):
        RegionsSetup(**bad)


def test_the_regions_variants_end_on_a_merge_within_their_budget_and_gossip_takes_the_same_budget():
    flat, regions, rarer, gossip = variants(RegionsSetup(steps=1000, budget=1600, inner_steps=50, merge_every=(4, 8)))
    assert flat.flags == ("--rounds", "20") and not flat.per_peer
    # 32 region rounds and a merge after every 4 (each counts as a round of the region state): 40
    assert regions.flags == ("--rounds", "40", "--merge-every", "4")
    assert rarer.flags == ("--rounds", "36", "--merge-every", "8")
    assert regions.per_peer == (("--region", "r0"), ("--region", "r0"), ("--region", "r1"), ("--region", "r1"))
    assert gossip.flags == ("--rounds", "32", "--topology", "gossip") and not gossip.per_peer
    assert len(variants(RegionsSetup(gossip=False))) == 3


@pytest.mark.timeout(120)
def test_links_between_regions_are_the_slow_ones():
    with WanLab(4, 40.0, 2.0, regions=[0, 0, 1, 1], cross_rate_mbit=4.0, cross_delay_ms=20.0) as lab:
        inside, between = lab.measure(0, 1, nbytes=2_000_000), lab.measure(1, 3, nbytes=400_000)
    # the fastest of the pings: the links' delays, not the scheduler's (a busy suite's mean ping ran 2 ms over elsewhere)
    assert 1.5 * 2 * 2.0 > inside.rtt_min_ms and 2 * 20.0 <= between.rtt_min_ms < 2 * 20.0 + 10
    assert inside.goodput_mbit > 20.0 and 2.0 < between.goodput_mbit <= 4.2


@pytest.mark.slow  # 33 s on a busy 2-core machine; the real-process regions test runs in make test
@pytest.mark.timeout(300)
def test_flat_regions_and_gossip_train_on_a_two_region_network(tmp_path):
    setup = RegionsSetup(rate_mbit=50.0, delay_ms=2.0, cross_rate_mbit=5.0, cross_delay_ms=10.0, steps=24,
                         budget=24, inner_steps=6, merge_every=(2,), d_model=32, layers=1, context=32, batch_size=2, warmup=2,
                         timeout_s=200)
    lines: list[str] = []
    report = run(setup, workdir=tmp_path, progress=lines.append, measure=False)
    flat, regions, gossip = report["results"]
    assert flat["steps"] == regions["steps"] == gossip["steps"] == 24
    assert flat["one_model"] and regions["one_model"] and regions["regions_agree"]  # ended on a merge: one model
    assert all(m is not None and m >= 1 for m in regions["merges"]), regions["merges"]
    assert all(m is not None and m >= 1 for m in gossip["gossip_met"]) and gossip["regions_agree"] is None, gossip
    assert report["standings"][0]["speedup"] == 1.0
    assert "2 regions" in lines[0]
