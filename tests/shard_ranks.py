"""One rank of a 3-rank FSDP2 site, run by tests/test_shards.py under torchrun (gloo, CPU): every check
runs on every rank, and rank 0 writes one line per check to the file named by argv[1] (the last one at exit)."""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import diloco
from diloco.comms.spans import span_bounds
from diloco.outer import nesterov
from diloco.shards import ShardedHandoff
from diloco.state import GlobalState, StateError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # 64 rows among 3 ranks (uneven); the last layer's 1 row leaves 2 ranks empty
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        torch.nn.functional.mse_loss(model(x), torch.sin(x.sum(1, keepdim=True))).backward()
        opt.step()
        opt.zero_grad()


def checks(rank: int, out: Path) -> list[str]:
    found: list[str] = []
    whole_model = _model()  # the same weights, unsharded: what a full-replica peer would hold
    model = _shard(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = diloco.DiLoCo(model, opt, swarm=None, inner_steps=4)
    assert d.shards is not None and d.site is not None
    # the site's digest is a full replica's: at the start, and (below) after two rounds
    whole_state = GlobalState(list(whole_model.parameters()), nesterov())
    found.append(f"start {d.digest == whole_state.digest()}")
    with d:
        _train(model, opt, 8, seed=0)  # two rounds, no swarm (each rank steps its pieces)
    assert d.round == 2
    full = d.shards.gather_state(d.state, d._outer_factory)
    if rank == 0:
        assert full is not None
        found.append(f"gathered {full.digest() == d.digest}")
    # a state handed out whole from the leader comes back as every rank's pieces, with the same digest
    back = d.shards.scatter_state(full, d.state, d._outer_factory)
    same = all(torch.equal(a, b) for a, b in zip(back.params, d.state.params)) and \
        d.shards.manifest(back).digest == d.digest
    found.append(f"scattered {d.shards.all_true(same)}")
    # Δ one span at a time: the leader assembles each span, never a whole Δ
    m = d.shards.map
    params = list(range(len(m.numels)))
    delta = torch.arange(sum(m.numels), dtype=torch.float32)
    offsets = [0, *torch.tensor(m.numels).cumsum(0).tolist()]
    mine = torch.cat([delta[offsets[i] + m.ranges[i][rank][0]:offsets[i] + m.ranges[i][rank][1]] for i in params])
    bounds = span_bounds(delta.numel(), 5)
    if rank == 0:
        handoff = ShardedHandoff(d.shards, mine, params)
        with pytest.raises(RuntimeError, match="one span at a time"):
            handoff.take()
        spans = list(handoff.spans(bounds))
        handoff.close()
        found.append(f"spans {all(torch.equal(s, delta[a:b]) for s, (a, b) in zip(spans, bounds))}")
        found.append(f"largest {max(s.numel() for s in spans)} of {delta.numel()}")
        pieces = ((a, b, delta[a:b]) for a, b in bounds)
    else:
        d.shards.serve(mine, params)
        pieces = None
    got = torch.empty_like(mine)
    d.shards.scatter_spans(pieces, params, got)
    found.append(f"handed out {d.shards.all_true(torch.equal(got, mine))}")
    # a checkpoint of the sharded state (written whole by the leader) resumes on fresh shards
    ckpt = out.parent / "ckpt"
    d.save_checkpoint(ckpt)
    fresh = _shard(_model())
    e = diloco.DiLoCo(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), swarm=None, inner_steps=4)
    found.append(f"resumed {e.resume(ckpt)} {e.digest == d.digest} round {e.round}")
    # what a sharded site does not support yet is refused, naming it, on every rank
    for kwargs, needle in [({"compression": "e3m0+ef:0.9"}, "error feedback"),
                           ({"streaming": diloco.StreamingConfig(overlap=1)}, "overlap")]:
        try:
            diloco.DiLoCo(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), swarm=None, inner_steps=4,
                          **kwargs)  # type: ignore[arg-type]
            found.append(f"accepted {needle}")
        except ValueError as err:
            found.append(f"refused {needle} {needle in str(err)}")
    # the site's gloo group is ours: released, it is destroyed (its threads joined) and refuses further use
    assert e.shards is not None
    groups = _gloo_groups()
    e.shards.release()
    with pytest.raises(StateError, match="released"):
        e.shards.all_true(True)
    found.append(f"released {_gloo_groups() == groups - 1}")
    return found


def _gloo_groups() -> int:
    """gloo groups alive in this process: each has its own TCP event loop thread."""
    tasks = Path("/proc/self/task")
    return sum((tasks / t / "comm").read_text().strip() == "gloo_tcp_loop" for t in os.listdir(tasks))


def _check_at_exit(out: Path, world: int) -> None:
    """After the site's exit handler (registered later, so run earlier): no gloo group of the site is left
    for interpreter shutdown to tear down (the world group may be: FSDP2 keeps it after it is destroyed)."""
    left = _gloo_groups()
    print(f"gloo groups: {world} with the world group, {left} at exit", file=sys.stderr)
    with out.open("a") as f:
        f.write(f"\nno site group at exit {left <= world}")


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        atexit.register(_check_at_exit, out, _gloo_groups())
    try:
        found = checks(rank, out)
    except BaseException:
        found = ["error " + traceback.format_exc()]
        raise
    finally:
        if rank == 0:
            out.write_text("\n".join(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
