"""B4's harness end to end: real `diloco start`/`join` processes in network namespaces joined by an
emulated WAN link, one plain and one streaming + overlap variant, on a tiny model.

The figures of the benchmark itself (utilization ≥ 95% with streaming + overlap) live in
docs/BENCHMARKS.md; this test checks that the harness runs real peers across the link and reports
what they measured, not how fast this machine is.
"""

from __future__ import annotations

import pytest

from diloco.bench.overlap import OverlapSetup, Variant, markdown_table, rounds_share, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


def test_plain_and_streaming_variants_run_across_an_emulated_link(tmp_path):
    setup = OverlapSetup(peers=2, rate_mbit=20.0, delay_ms=10.0, inner_steps=8, outer_steps=2, fragments=2, tau=1,
                         d_model=32, layers=2, batch_size=2, timeout_s=180,
                         variants=[Variant("plain DiLoCo"),
                                   Variant("streaming P=2, overlap tau=1, alpha=0.5", fragments=2, overlap=1,
                                           alpha=0.5)])
    lines: list[str] = []
    ticks: list[tuple] = []
    report = run(setup, workdir=tmp_path, progress=lines.append, tick=lambda *t: ticks.append(t))
    assert "2 hosts in network namespaces" in report["link"]
    assert 18.0 <= report["measured_link"]["rtt_ms"] <= 40.0  # 2 × 10 ms one way, plus the plumbing
    plain, streaming = report["results"]
    assert plain["rounds_committed"] == 2 and streaming["rounds_committed"] == 4  # 2 outer steps × P rounds
    for r in (plain, streaming):
        assert r["digests_agree"]
        assert r["steps"] >= 2 * 8 - 1  # the accounting window starts after the first step
        assert 0.0 < r["utilization"] <= 1.0
        assert r["bytes_sent"] > 0 and r["peak_mbit"] > 0
        assert len(r["per_peer"]) == 2
    # plain DiLoCo waits for every round where it starts (tau = 0): that wait is its blocked time
    assert plain["blocked_waits"] == 2 and plain["blocked_seconds"] > 0
    assert "| streaming P=2, overlap tau=1, alpha=0.5 |" in markdown_table(report)
    assert any("measured between hosts 0 and 1" in line for line in lines)
    # progress: variants done, fractional from the first peer's committed rounds while one runs
    assert [t[0] for t in ticks] == sorted(t[0] for t in ticks) and all(t[1] == 2 for t in ticks)
    assert all(0 <= t[0] <= 2 for t in ticks) and ticks[-1][2] == "[2/2] streaming P=2, overlap tau=1, alpha=0.5"


def test_a_variant_is_as_far_as_its_first_peers_committed_rounds():
    lines = [{"event": "round", "committed": True}, {"event": "round", "committed": False},
             {"event": "round", "committed": True}, {"event": "final"}]
    assert rounds_share(lines, outer_steps=2, fragments=2) == 0.5 and rounds_share([], 3, 1) == 0
