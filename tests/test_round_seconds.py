"""Rounds by time (`DiLoCo(round_seconds=S)`): workers of unequal speed each run inner steps until the round's
time is up, and their pseudo-gradients count by the steps they cover. The exact weighted mean is
tests/test_collective.py's subject; here, real wrappers in an in-process swarm."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from diloco import DiLoCo
from diloco.compression.errors import ConfigError
from diloco.fragments import StreamingConfig

from test_swarm_inproc import Harness, _batches, _mlp, _run_threads

ROUNDS = 3


@pytest.mark.timeout(120)
def test_workers_of_unequal_speed_each_train_until_the_slot_and_end_on_one_digest():
    """Three workers whose inner steps take 10, 20 and 40 ms train for 0.5 s a round: each round every one of them
    syncs with the steps it managed (the fast one about four times the slow one's), all commit the same rounds
    together, and they end on one global state."""
    h = Harness()
    base, delays = _mlp(7), [0.01, 0.02, 0.04]
    start = threading.Barrier(3, timeout=10)
    covered: dict[int, list[int]] = {i: [] for i in range(3)}
    out: dict[int, DiLoCo] = {}
    shown: dict[int, dict[str, int | None]] = {}

    def peer(i: int):
        def run() -> None:
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            data = _batches(30 + i, 64)
            with DiLoCo(model, opt, swarm=h.swarm(f"w{i}"), round_seconds=0.5,
                        on_round=lambda r: covered[i].append(d.member.standing.covered)) as d:
                start.wait()
                k, deadline = 0, time.monotonic() + 60
                while d.round < ROUNDS and time.monotonic() < deadline:
                    x, y = data[k % len(data)]
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    time.sleep(delays[i])  # a slower machine
                    opt.step()
                    opt.zero_grad()
                    k += 1
                shown[i] = {r.peer: r.round_steps for r in d.swarm.records()}  # what `diloco status` shows
            out[i] = d
        return run

    try:
        _run_threads([peer(i) for i in range(3)], [start])
    finally:
        h.close()
    ds = [out[i] for i in range(3)]
    assert {d.round for d in ds} == {ROUNDS}, [d.round for d in ds]
    assert len({d.digest for d in ds}) == 1
    for d in ds:
        assert [(r.round, r.committed, r.peers) for r in d.reports] == [(k + 1, True, 3) for k in range(ROUNDS)]
    assert all(c >= 1 for cs in covered.values() for c in cs), covered
    assert sum(covered[0]) > 2 * sum(covered[2]), covered  # the fast worker's Δ covers more steps, and counts more
    assert shown[0]["w0"] == covered[0][-1] and all(n is not None and n >= 1 for n in shown[0].values()), shown


def test_rounds_by_time_refuse_what_they_do_not_support_yet():
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="positive number of seconds"):
        DiLoCo(model, opt, swarm=None, round_seconds=0)
    with pytest.raises(ConfigError, match="whole-model rounds"):
        DiLoCo(model, opt, swarm=None, round_seconds=1.0, streaming=StreamingConfig(fragments=2))


def test_the_command_line_refuses_rounds_by_time_with_fragments_naming_both(monkeypatch):
    """`diloco start --round-seconds 30 --fragments 2`: exit 2 before any peer starts, naming the options."""
    from cli_util import invoke, refuse_to_start
    refuse_to_start(monkeypatch, "diloco.cli.main._run_peer", "diloco.cli.main._launch")
    result = invoke(["start", "--round-seconds", "30", "--fragments", "2"])
    said = "".join(result.output.replace("│", "").split())
    assert result.exit_code == 2 and "--round-seconds" in said and "--fragments" in said, result.output
