"""A peer that joins and leaves every round, in-process.

Two steady peers train for ROUNDS rounds while a third keeps flapping: attach (download the state),
take part in one round, leave with a goodbye, and come back under a new identity, as a spot instance
that is reclaimed and restarted would. The steady peers must commit every round, never deadlock,
and not leak: their process's memory may not keep growing with the number of flaps.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from test_swarm_inproc import H, PATIENT, Harness, _batches, _mlp, _run_threads

from diloco import DiLoCo

pytestmark = pytest.mark.swarm

ROUNDS = 50
WARM = 10
STEP = 0.002  # seconds of "compute" per inner step: the flapper comes and goes mid-round as well as between rounds


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_steady_peers_commit_every_round_while_a_peer_flaps():
    # The in-process deadlines (a 2 s result deadline, a 1 s answer window) are for quick tests of slow paths; this
    # one's rounds must all commit on a loaded 2-core machine, where a round's reduce among threads once took longer
    # than that: no deadline may decide one (the flapper says goodbye when it leaves, so nobody waits for it).
    h = Harness(PATIENT)
    base = _mlp(3)
    start = threading.Barrier(2, timeout=10)
    done = threading.Event()
    reports: dict[int, list] = {}
    rss: dict[str, int] = {}
    flaps: list[tuple[int, int, bool]] = []  # (round attached at, rounds it committed, ended identical)
    finals: dict[int, str] = {}

    def steady(i: int):
        def run():
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            data = _batches(20 + i, 8)

            def on_round(r):
                if i == 0 and r.round == WARM:
                    rss["warm"] = _rss()

            d = DiLoCo(model, opt, swarm=h.swarm(f"steady{i}"), inner_steps=H, on_round=on_round)
            with d:
                start.wait()
                k, deadline = 0, time.monotonic() + 60
                while d.round < ROUNDS and time.monotonic() < deadline:
                    x, y = data[k % len(data)]
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                    k += 1
                    time.sleep(STEP)  # a real inner step takes a while: the flapper gets a chance to come and go
                reports[i] = list(d.reports)
                finals[i] = d.digest
            done.set()
        return run

    def flapper():
        n = 0
        while not done.is_set():
            n += 1
            model = _mlp(100 + n)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            swarm = h.swarm(f"flap{n}", bootstrapped=True)
            try:
                d = DiLoCo(model, opt, swarm=swarm, inner_steps=H, join_timeout=5)
                with d:
                    attached_at = d.round
                    data = _batches(200 + n, H)
                    k = 0
                    while not done.is_set() and not any(r.committed for r in d.reports) and k < 20 * H:
                        x, y = data[k % H]
                        torch.nn.functional.mse_loss(model(x), y).backward()
                        opt.step()
                        opt.zero_grad()
                        k += 1
                        time.sleep(STEP)
                committed = [r for r in d.reports if r.committed]
                flaps.append((attached_at, len(committed), bool(committed)))
            finally:
                swarm.close()  # goodbye: status=left at once
                h.forget(swarm)

    try:
        _run_threads([steady(0), steady(1), flapper], [start])
        rss["end"] = _rss()
    finally:
        h.close()

    for i in (0, 1):
        assert [(r.round, r.committed) for r in reports[i]] == [(k, True) for k in range(1, ROUNDS + 1)], \
            [(r.round, r.committed, r.reason) for r in reports[i] if not r.committed]
    assert finals[0] == finals[1]
    # the flapper really flapped: it came and went many times, and took part in rounds
    assert len(flaps) >= ROUNDS // 5, flaps
    assert sum(1 for f in flaps if f[2]) >= ROUNDS // 5, flaps
    assert max(r.peers for r in reports[0]) == 3
    growth = (rss["end"] - rss["warm"]) / rss["warm"]
    assert growth < 0.05, f"RSS grew {growth:.1%} over {ROUNDS - WARM} rounds of flapping ({rss})"
