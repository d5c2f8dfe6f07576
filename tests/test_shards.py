"""FSDP2 sites (`diloco.shards`): the shard map's arithmetic, bit-identical outer steps on pieces, the
streamed manifest, and the transfers between real ranks (torch.distributed over gloo on 127.0.0.1, one
process per rank) of a model FSDP2 really sharded.

The swarm-level behaviour (an FSDP2 site training with DDP sites and lone processes, serving its state,
restarting after a rank dies) runs with real launchers in tests/test_launcher.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.outer import nesterov
from diloco.shards import ShardMap
from diloco.state import ChunkHasher, GlobalState

# ---------------------------------------------------------------- pure: the shard map


def _chunked(numel: int, rows: int, ranks: int) -> list[tuple[int, int]]:
    """FSDP2's Shard(0): torch.chunk of the rows, as ranges of flattened values (trailing ranks may be empty)."""
    per = -(-rows // ranks) if rows else 0
    row = numel // rows if rows else 0
    return [(min(rows, r * per) * row, min(rows, (r + 1) * per) * row) for r in range(ranks)]


def _map(shapes: list[tuple[int, ...]], ranks: int, rank: int = 0) -> ShardMap:
    return ShardMap.of(shapes, [_chunked(math.prod(s), s[0], ranks) for s in shapes], rank)


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(1, 9), min_size=1, max_size=5), cols=st.integers(1, 4), ranks=st.integers(1, 4),
       data=st.data())
def test_pieces_reassemble_any_span_of_the_canonical_vector(rows, cols, ranks, data):
    """Every rank's local flat vector (its pieces of each parameter, in order) put back through `pieces`
    gives exactly the canonical flat vector's span, whatever the span, sizes and rank count."""
    shapes = [(r, cols) for r in rows]
    m = _map(shapes, ranks)
    params = list(range(len(shapes)))
    full = torch.arange(sum(m.numels), dtype=torch.float32)
    offsets = [0, *torch.tensor(m.numels).cumsum(0).tolist()]
    local = [torch.cat([full[offsets[i] + a:offsets[i] + b] for i, (a, b) in
                        ((i, m.ranges[i][r]) for i in params)]) for r in range(ranks)]
    assert [t.numel() for t in local] == [m.local_numel(params, r) for r in range(ranks)]
    lo = data.draw(st.integers(0, full.numel()))
    hi = data.draw(st.integers(lo, full.numel()))
    out = torch.full((hi - lo,), -1.0)
    pieces = m.pieces(params, lo, hi)
    for pc in pieces:
        out[pc.at - lo:pc.at - lo + pc.n] = local[pc.rank][pc.local:pc.local + pc.n]
    assert torch.equal(out, full[lo:hi])
    assert [pc.at for pc in pieces] == sorted(pc.at for pc in pieces)  # canonical order
    # a fragment: a subset of the parameters, in its own canonical order
    sub = params[1:] or params
    sub_numel = sum(m.numels[i] for i in sub)
    assert sum(pc.n for pc in m.pieces(sub, 0, sub_numel)) == sub_numel


@pytest.mark.unit
def test_a_sharding_that_does_not_tile_the_parameter_is_refused():
    with pytest.raises(ValueError, match="do not tile"):
        ShardMap.of([(4, 2)], [[(0, 4), (2, 8)]], 0)  # overlapping pieces
    with pytest.raises(ValueError, match="cover 6 of its 8"):
        ShardMap.of([(4, 2)], [[(0, 4), (4, 6)]], 0)


@pytest.mark.unit
@pytest.mark.parametrize("make", [lambda ps: nesterov()(ps), lambda ps: torch.optim.AdamW(ps, lr=1e-2)],
                         ids=["nesterov", "adamw"])
def test_outer_steps_on_pieces_give_the_bits_of_whole_tensors(make):
    """Why a sharded site holds the same state as a full replica: the outer optimizers are elementwise,
    and stepping pieces cut anywhere gives the same bits as stepping the whole tensor."""
    torch.manual_seed(0)
    whole, grads = torch.randn(100_003), [torch.randn(100_003) for _ in range(3)]

    def run(cuts: list[int]) -> torch.Tensor:
        bounds = [0, *cuts, whole.numel()]
        ps = [whole[a:b].clone() for a, b in zip(bounds, bounds[1:])]
        opt = make(ps)
        for g in grads:
            for p, a, b in zip(ps, bounds, bounds[1:]):
                p.grad = g[a:b].clone()
            opt.step()
        return torch.cat(ps)

    assert torch.equal(run([]), run([7, 1001, 50_000]))
    assert torch.equal(run([]), run([3, 5, 11, 17, 33, 65, 99_999]))


@pytest.mark.unit
def test_the_chunk_hasher_fed_pieces_matches_the_manifest_of_whole_tensors():
    torch.manual_seed(1)
    state = GlobalState([torch.randn(300, 7), torch.randn(5)], nesterov())
    for p in state.params:
        p.grad = torch.randn_like(p)
    state.outer.step()
    tensors, _ = state.layout()
    flat = torch.cat([t.reshape(-1) for _, t in tensors])
    hasher = ChunkHasher(1000)
    for piece in flat.split([1, 999, 17, 2500, flat.numel() - 3517]):
        hasher.feed(piece)
    manifest = state.manifest(chunk=1000)
    fed = hasher.manifest(manifest.header)
    assert fed.hashes == manifest.hashes and fed.total == manifest.total


# ---------------------------------------------------------------- real ranks: a model FSDP2 sharded

RANKS_SCRIPT = Path(__file__).resolve().parent / "shard_ranks.py"


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_a_sharded_site_hashes_hands_out_and_checkpoints_its_state_like_a_full_replica(tmp_path):
    """Three real ranks (torchrun, gloo) of an FSDP2-sharded model (uneven shards, empty ones too): the
    site's digest is a full replica's; the whole state gathered on the leader, handed back out, or
    checkpointed and resumed gives the same digest; Δ reaches the leader one span at a time and Δ̄ goes
    back to every rank's pieces; error feedback and overlap are refused; the site's gloo groups are gone before
    interpreter shutdown (tests/shard_ranks.py)."""
    out = tmp_path / "found.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(RANKS_SCRIPT), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = out.read_text().splitlines()
    numel = 16 * 64 + 64 + 64 + 1
    assert found == ["start True", "gathered True", "scattered True", "spans True",
                     f"largest {-(-numel // 5)} of {numel}", "handed out True", "resumed True True round 2",
                     "refused error feedback True", "refused overlap True", "released True",
                     "no site group at exit True"], found
