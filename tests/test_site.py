"""diloco.site's collectives in a real (one-rank, gloo) process group, in a subprocess so that the test
process keeps no process group. The sites themselves are tested across real torchrun ranks in
tests/test_launcher.py and tests/test_shards.py."""

from __future__ import annotations

import textwrap

import pytest
from fresh import fresh_python

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from diloco.site import broadcast_object, settle

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    obj = {"round": 7, "delta": torch.arange(5.0), "why": "ok"}
    got = broadcast_object(obj, 0, None, torch.device("cpu"))
    assert got["round"] == 7 and got["why"] == "ok" and torch.equal(got["delta"], obj["delta"]), got
    left = 0
    for _ in range(300):
        t = torch.zeros(257)
        dist.broadcast(t, 0)  # returns once the work completed; gloo's worker may still hold t
        settle(t)
        left += t._use_count() != 1
    dist.destroy_process_group()
    print("left", left)
""")


@pytest.mark.timeout(60)
def test_settle_returns_once_the_backend_let_go_of_the_tensors():
    """After `settle`, ours is the only reference to a tensor a collective moved: a rank may leave right
    after its last collective without gloo's worker thread dropping a Python tensor during interpreter
    shutdown (which aborts the process: SIGABRT, 'terminate called without an active exception')."""
    done = fresh_python(SCRIPT, timeout=50)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["left", "0"], done.stdout
