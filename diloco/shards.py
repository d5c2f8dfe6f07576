"""FSDP2 sites: a site whose ranks hold the model in shards keeps DiLoCo's state in the same shards.

With FSDP2 (`torch.distributed.fsdp.fully_shard`) every parameter is a DTensor sharded by rows
(`Shard(0)`) over the site's ranks: rank r holds rows [a_r, b_r) of parameter i, one contiguous piece
of its flattened values. The wrapper keeps θ, the outer optimizer's state and Δ for exactly those
pieces on each rank. The outer optimizers are elementwise, so stepping the pieces gives the same
bits as stepping whole tensors (tests/test_shards.py checks it), and the site's state is the same as
a full-replica peer's. The swarm still sees one worker and one flat Δ of the whole model, in the
canonical order every other site uses (whole parameters, one after the other); `ShardMap` says which
rank holds which part of it, so sites of any size and sharding train together.

The whole model never gathers on one rank in a round. What crosses the site's gloo group, always to
or from its leader (rank 0, the site's only peer in the swarm), one piece at a time:

- Δ, one span at a time, as the leader's round encodes it (`ShardedHandoff`, while the other ranks
  answer in `SiteShards.serve`): the leader holds one span of fp32 values (at most `SPAN_VALUES`)
  plus the encoded payloads;
- the round's averaged Δ, which the leader's round keeps as its result frames only (a lean round,
  `Handoff.keeps_aggregate`) and decodes one span at a time to hand each rank its pieces
  (`SiteShards.scatter_spans`);
- after each commit, every rank's pieces of θ and of the outer state, which the leader hashes in the
  state's stream order into its manifest (`SiteShards.manifest`): the same digest a full-replica peer
  computes, holding one piece at a time.

Exceptions, where the whole state is held on the leader's host memory for a while (docs/SITES.md): a
snapshot served to a peer catching up from this site, a checkpoint being written, and a state the
leader downloaded or read from a checkpoint before it is handed out (`gather_state`, `scatter_state`).

Every method of `SiteShards` is collective: every rank of the site calls it at the same point, in
the same order (the wrapper's decision points guarantee it), except `ShardedHandoff`'s requests, which
run on the leader's round thread while the other ranks wait in `serve`.
"""

from __future__ import annotations

import atexit
import functools
import math
import sys
import threading
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence, cast

import torch
import torch.distributed as dist

from diloco.comms.rounds import Handoff

from .compression.errors import ConfigError
from .fragments import StreamingConfig
from .outer import OuterFactory
from .site import Site, broadcast_object, settle
from .state import CHUNK_BYTES, ChunkHasher, GlobalState, Manifest, Receiver, StateError, manifest_header

__all__ = ["Piece", "ShardMap", "SiteShards", "ShardedHandoff", "is_sharded", "local_view"]


class Piece(NamedTuple):
    """A part of the canonical flat vector held by one rank: `n` values at canonical offset `at`, which are
    values [local, local + n) of that rank's local flat vector."""

    rank: int
    at: int
    local: int
    n: int


def is_sharded(p: torch.Tensor) -> bool:
    """Whether `p` is a DTensor (a parameter FSDP2 sharded). A model that shards has imported DTensor already:
    a process that does not never pays for the import."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def local_view(p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `p` (a DTensor), sharing its storage (writes land in the parameter); `p` itself
    for a plain tensor. Detached: autograd forbids writing into `to_local()`'s output in place."""
    return p.to_local().detach() if is_sharded(p) else p  # type: ignore[attr-defined]


def _rows_range(p: torch.Tensor, site_size: int, name: str) -> tuple[int, int]:
    """[lo, hi) of `p`'s flattened values that this rank holds; raises ValueError for a sharding a site
    cannot take part in the swarm with."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not is_sharded(p):
        raise ValueError(f"parameter {name} is not sharded while others are: apply fully_shard to every module "
                         "that holds trainable parameters (at least the root module)")
    mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
    if mesh.ndim != 1 or placements != (Shard(0),) or mesh.size() != site_size or \
            mesh.mesh.flatten().tolist() != list(range(site_size)):
        raise ValueError(f"parameter {name} is sharded as {placements} over a {mesh.ndim}-D mesh of {mesh.size()} "
                         f"ranks; a DiLoCo site needs FSDP2's default: Shard(0) over one 1-D mesh of all the site's "
                         f"{site_size} ranks (HSDP and custom placements are not supported)")
    shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, placements)
    row = math.prod(p.shape[1:])
    return offset[0] * row, offset[0] * row + math.prod(shape)


@dataclass(frozen=True)
class ShardMap:
    """Which rank holds which values of every parameter (see the module docstring)."""

    numels: tuple[int, ...]
    """Every parameter's full size, in canonical order."""
    shapes: tuple[tuple[int, ...], ...]
    """Every parameter's full shape."""
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    """ranges[i][r]: the [lo, hi) of parameter i's flattened values that rank r holds."""
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranges[0]) if self.ranges else 1

    @classmethod
    def of(cls, shapes: Sequence[tuple[int, ...]], ranges: Sequence[Sequence[tuple[int, int]]], rank: int) -> ShardMap:
        """Check that every parameter's pieces tile it in rank order; raises ValueError otherwise."""
        numels = tuple(math.prod(s) for s in shapes)
        for i, (numel, pieces) in enumerate(zip(numels, ranges)):
            at = 0
            for lo, hi in pieces:
                if lo != at or hi < lo:
                    raise ValueError(f"parameter {i}'s shards {list(pieces)} do not tile its {numel} values in rank "
                                     "order (a DiLoCo site needs FSDP2's row sharding)")
                at = hi
            if at != numel:
                raise ValueError(f"parameter {i}'s shards cover {at} of its {numel} values")
        return cls(numels, tuple(tuple(s) for s in shapes), tuple(tuple(p) for p in ranges), rank)

    def local_numel(self, params: Sequence[int], rank: int | None = None) -> int:
        r = self.rank if rank is None else rank
        return sum(self.ranges[i][r][1] - self.ranges[i][r][0] for i in params)

    def pieces(self, params: Sequence[int], lo: int, hi: int) -> list[Piece]:
        """The parts of [lo, hi) of the canonical flat vector of `params` (whole parameters, in that order),
        each held by one rank, in canonical order."""
        out: list[Piece] = []
        base, local = 0, [0] * self.size
        for i in params:
            if base >= hi:
                break
            for r, (a, b) in enumerate(self.ranges[i]):
                x, y = max(lo, base + a), min(hi, base + b)
                if x < y:
                    out.append(Piece(r, x, local[r] + x - base - a, y - x))
                local[r] += b - a
            base += self.numels[i]
        return out


def _sharded(name: str, t: torch.Tensor) -> bool:
    """Whether a state tensor is cut like its parameter (θ, and outer state shaped like it) or is a 0-d value
    every rank holds whole (e.g. Adam's step)."""
    return name.startswith("p") or t.dim() > 0


def _tensor_plan(state: GlobalState, m: ShardMap) -> list[tuple[str, torch.Tensor, tuple[int, ...], int | None]]:
    """The local state's tensors in stream order: (name, local tensor, full shape, parameter index when it is
    sharded like its parameter, else None: a 0-d value every rank holds, e.g. Adam's step)."""
    tensors, _ = state.layout()
    plan = []
    for name, t in tensors:
        index = int(name[1:].split(".")[0])
        sharded = _sharded(name, t)
        plan.append((name, t, m.shapes[index] if sharded else tuple(t.shape), index if sharded else None))
    return plan


_LIVE: weakref.WeakSet[SiteShards] = weakref.WeakSet()
"""Every SiteShards not yet garbage: their groups are released at exit (`SiteShards.release`)."""


def _release_all() -> None:
    for shards in list(_LIVE):
        shards.release()


@functools.cache
def _release_at_exit() -> None:
    """Register `_release_all` with `atexit`, once, when the first SiteShards is made (so that it runs before
    the exit handlers registered earlier, the script's own and `weakref.finalize`'s among them)."""
    atexit.register(_release_all)


def _destroy(group: dist.ProcessGroup) -> None:
    """Destroy a gloo group of ours, unless torch already did (`dist.destroy_process_group()` destroys them all);
    gloo's destruction is local to the rank, no collective."""
    try:
        dist.destroy_process_group(group)
    except ValueError:
        pass  # torch no longer knows it


def site_shards(site: Site | None, named: Sequence[tuple[str, torch.Tensor]], *, error_feedback: bool,
                streaming: StreamingConfig, global_device: torch.device) -> SiteShards | None:
    """The site's shard transfers when FSDP2 shards the model over it (None otherwise); ConfigError for what a
    sharded site does not support yet, naming what to use instead."""
    if site is None or not any(is_sharded(p) for _, p in named):
        return None  # FSDP2 over one rank: every piece is the whole parameter
    why = []
    if error_feedback:
        why.append("error feedback (an ef:BETA compression stage): use a compression without it, e.g. e3m0")
    if streaming.overlap or streaming.outer_overlap != "none":
        why.append("overlapping communication (StreamingConfig overlap / outer_overlap): use overlap=0")
    if global_device.type != "cpu":
        why.append(f"global_device={global_device}: keep θ in host memory (the default)")
    if why:
        raise ConfigError("an FSDP2 site (sharded parameters) does not support " + "; ".join(why))
    return SiteShards.build(site, named)


class SiteShards:
    """An FSDP2 site's transfers (see the module docstring); collective: every rank calls each method."""

    def __init__(self, site: Site, shard_map: ShardMap) -> None:
        self.site, self.map = site, shard_map
        # Host tensors move over gloo whatever the training backend (NCCL moves GPU tensors only). Every
        # process of the job creates the group (torch.distributed's rule), with the site's ranks in it.
        ranks = None if site.group is None else [dist.get_global_rank(site.group, r) for r in range(site.size)]
        group = dist.new_group(ranks=ranks, backend="gloo")
        self._group: dist.ProcessGroup | None = group
        self._global = [dist.get_global_rank(group, r) for r in range(site.size)]
        # Destroyed when this object is garbage, or at exit by `_release_all` (see `release`)
        self._finalizer = weakref.finalize(self, _destroy, group)
        self._finalizer.atexit = False
        _release_at_exit()
        _LIVE.add(self)

    @classmethod
    def build(cls, site: Site, named: Sequence[tuple[str, torch.Tensor]]) -> SiteShards:
        """Every rank says which rows it holds (one all-gather); raises ValueError, on every rank, for a
        sharding the swarm cannot take (the same check runs everywhere on the same data)."""
        mine: list[tuple[int, int]] | str
        try:
            mine = [_rows_range(p, site.size, n) for n, p in named]
        except ValueError as e:
            mine = str(e)
        everyone: list[Any] = [None] * site.size
        dist.all_gather_object(everyone, mine, group=site.group)
        for r, got in enumerate(everyone):
            if isinstance(got, str):
                raise ValueError(got if r == site.rank else f"rank {r}: {got}")
        shapes = [tuple(p.shape) for _, p in named]
        ranges = [[everyone[r][i] for r in range(site.size)] for i in range(len(named))]
        return cls(site, ShardMap.of(shapes, ranges, site.rank))

    @property
    def leader(self) -> bool:
        return self.site.leader

    # ---------------------------------------------------------------- plumbing

    @property
    def group(self) -> dist.ProcessGroup:
        """The site's gloo group (ours: created in `__init__`, destroyed in `release`)."""
        group = self._group
        if group is None:
            raise StateError("this site's gloo group was released (SiteShards.release, which runs at exit)")
        return group

    def release(self) -> None:
        """Destroy the site's gloo group and let go of it, so that its threads are joined now (it happens, once,
        when this object is garbage too). Runs for every SiteShards still alive when the interpreter exits
        (`atexit`): a group kept alive by a reference cycle (a wrapper's) outlives `dist.destroy_process_group()`
        and would otherwise be torn down during interpreter shutdown, when its threads can no longer take the
        GIL (the rank aborts with SIGABRT, "terminate called without an active exception", and torchrun reports
        it failed; tests/shard_ranks.py checks none is left, and that a released group is gone)."""
        self._group = None
        self._finalizer()

    def _send(self, t: torch.Tensor, rank: int) -> None:
        dist.send(t.contiguous(), dst=self._global[rank], group=self.group)

    def _recv(self, t: torch.Tensor, rank: int) -> None:
        dist.recv(t, src=self._global[rank], group=self.group)

    def _broadcast(self, obj: Any) -> Any:
        return broadcast_object(obj, self._global[0], self.group, torch.device("cpu"))

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (for decisions each rank takes from its own shard)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        settle(t)
        return bool(t.item())

    # ---------------------------------------------------------------- Δ and the averaged Δ

    def gather_span(self, local: torch.Tensor, params: Sequence[int], lo: int, hi: int) -> torch.Tensor | None:
        """Values [lo, hi) of the canonical flat vector of `params`, assembled on the leader from every rank's
        local flat vector `local` (None elsewhere)."""
        pieces = self.map.pieces(params, lo, hi)
        if not self.leader:
            for pc in pieces:
                if pc.rank == self.site.rank:
                    self._send(local[pc.local:pc.local + pc.n], 0)
            return None
        out = torch.empty(hi - lo, dtype=local.dtype)
        for pc in pieces:
            part = out[pc.at - lo:pc.at - lo + pc.n]
            if pc.rank == 0:
                part.copy_(local[pc.local:pc.local + pc.n])
            else:
                self._recv(part, pc.rank)
        return out

    def scatter_span(self, span: torch.Tensor | None, params: Sequence[int], lo: int, hi: int,
                     out: torch.Tensor) -> None:
        """Each rank's part of values [lo, hi) of the canonical flat vector of `params` (`span`, given on the
        leader) into its local flat vector `out`."""
        for pc in self.map.pieces(params, lo, hi):
            if self.leader:
                assert span is not None
                part = span[pc.at - lo:pc.at - lo + pc.n]
                if pc.rank == 0:
                    out[pc.local:pc.local + pc.n].copy_(part)
                else:
                    self._send(part, pc.rank)
            elif pc.rank == self.site.rank:
                self._recv(out[pc.local:pc.local + pc.n], 0)

    def scatter_spans(self, spans: Iterable[tuple[int, int, torch.Tensor]] | None, params: Sequence[int],
                      out: torch.Tensor) -> None:
        """`scatter_span` for every (lo, hi, values) the leader's `spans` yields (decoded one at a time: the
        round's result frames), into every rank's `out`."""
        if self.leader:
            assert spans is not None
            for lo, hi, values in spans:
                self._broadcast((lo, hi))
                self.scatter_span(values, params, lo, hi, out)
            self._broadcast(None)
            return
        while (bounds := self._broadcast(None)) is not None:
            lo, hi = bounds
            self.scatter_span(None, params, lo, hi, out)

    def serve(self, local: torch.Tensor, params: Sequence[int]) -> None:
        """A rank other than the leader, while the leader's round runs: send the pieces of the spans of Δ it
        asks for (`ShardedHandoff`) until it says the round is over."""
        while True:
            span = self._broadcast(None)
            if span is None:
                return
            self.gather_span(local, params, *span)

    # ---------------------------------------------------------------- the whole state

    def receiver(self, manifest: Manifest) -> Receiver:
        """Somewhere for the leader to download the whole state `manifest` describes (checked against the
        model's full shapes, not this rank's pieces); it is handed out with `scatter_state`."""
        shapes = SimpleNamespace(params=[torch.zeros(1).expand(s) for s in self.map.shapes])  # shape, no storage
        return Receiver(cast(GlobalState, shapes), manifest)

    def _stream(self, state: GlobalState, take: Callable[[int, int, torch.Tensor], None]) -> None:
        """Every rank's pieces of every state tensor to the leader, in the state's stream order:
        `take(tensor index, offset in its flattened values, piece)` on the leader, one piece at a time."""
        for k, (_, t, _, index) in enumerate(_tensor_plan(state, self.map)):
            flat = t.detach().reshape(-1)
            if index is None:  # the same on every rank: the leader's
                if self.leader:
                    take(k, 0, flat)
                continue
            for r, (lo, hi) in enumerate(self.map.ranges[index]):
                if hi == lo:
                    continue
                if r == self.site.rank:
                    if self.leader:
                        take(k, lo, flat)
                    else:
                        self._send(flat, 0)
                elif self.leader:
                    piece = torch.empty(hi - lo, dtype=t.dtype)
                    self._recv(piece, r)
                    take(k, lo, piece)

    def _header(self, state: GlobalState) -> bytes:
        _, scalars = state.layout()
        plan = _tensor_plan(state, self.map)
        return manifest_header(state.round, [(n, t.dtype, full) for n, t, full, _ in plan], scalars)

    def manifest(self, state: GlobalState, chunk: int = CHUNK_BYTES) -> Manifest:
        """The manifest (and so the digest) of the site's state, the same bytes a peer holding the whole
        state computes; the leader hashes every rank's pieces in stream order, one at a time."""
        hasher = ChunkHasher(chunk)
        self._stream(state, lambda _k, _at, piece: hasher.feed(piece))
        packed = hasher.manifest(self._header(state)).pack() if self.leader else None
        return Manifest.unpack(self._broadcast(packed))

    def gather_state(self, state: GlobalState, outer_factory: OuterFactory) -> GlobalState | None:
        """The whole state on the leader (a copy; None elsewhere): for a snapshot or a checkpoint."""
        plan = _tensor_plan(state, self.map)
        full = [torch.empty(shape, dtype=t.dtype) if self.leader else None for _, t, shape, _ in plan]

        def take(k: int, at: int, piece: torch.Tensor) -> None:
            target = full[k]
            assert target is not None
            target.reshape(-1)[at:at + piece.numel()].copy_(piece)

        self._stream(state, take)
        if not self.leader:
            return None
        _, scalars = state.layout()
        return GlobalState.from_layout([(n, t) for (n, *_), t in zip(plan, full) if t is not None], scalars,
                                       state.round, outer_factory)

    def scatter_state(self, whole: GlobalState | None, like: GlobalState, outer_factory: OuterFactory) -> GlobalState:
        """Each rank's pieces of the state `whole` (given on the leader: downloaded or read from a checkpoint)
        as its local state, shaped like `like` (this rank's current state)."""
        if self.leader:
            assert whole is not None
            tensors, scalars = whole.layout()
            head = (whole.round, [(n, _sharded(n, t)) for n, t in tensors], scalars,
                    {n: t for n, t in tensors if not _sharded(n, t)})
        else:
            tensors, head = [], None
        rnd, names, scalars, replicated = self._broadcast(head)
        local: list[tuple[str, torch.Tensor]] = []
        for k, (name, sharded) in enumerate(names):
            if not sharded:
                local.append((name, replicated[name].clone()))
                continue
            index = int(name[1:].split(".")[0])
            param = like.params[index]
            lo, hi = self.map.ranges[index][self.site.rank]
            if self.leader:
                flat = tensors[k][1].detach().reshape(-1)
                for r, (a, b) in enumerate(self.map.ranges[index]):
                    if r != 0 and b > a:
                        self._send(flat[a:b], r)
                mine = flat[lo:hi].clone().reshape(param.shape)
            else:
                mine = torch.empty(param.shape, dtype=param.dtype)
                if hi > lo:
                    self._recv(mine.reshape(-1), 0)
            local.append((name, mine.to(param.device)))
        return GlobalState.from_layout(local, scalars, rnd, outer_factory)


class ShardedHandoff(Handoff):
    """An FSDP2 site leader's Δ for its round: the round asks for it one span at a time (`spans`), and each
    span is gathered from the ranks then (they wait in `SiteShards.serve`); `close()` tells them the round
    is over. The leader never holds more than one span of fp32 Δ, and the round keeps Δ̄ as frames (lean)."""

    keeps_aggregate = False

    def __init__(self, shards: SiteShards, local: torch.Tensor, params: Sequence[int]) -> None:
        self.shards, self._local, self._params = shards, local, list(params)
        self.numel = sum(shards.map.numels[i] for i in self._params)
        self._tensor = None
        self._lock = threading.Lock()
        self._open = True

    def take(self) -> torch.Tensor:
        raise RuntimeError("a sharded pseudo-gradient is read one span at a time (spans), never whole")

    def spans(self, bounds: Sequence[tuple[int, int]]) -> Iterator[torch.Tensor]:
        for lo, hi in bounds:
            with self._lock:  # close() waits for a span being gathered
                if not self._open:
                    raise StateError("the round ended before it read Δ")
                self.shards._broadcast((lo, hi))
                span = self.shards.gather_span(self._local, self._params, lo, hi)
            assert span is not None
            yield span

    def close(self) -> None:
        """The round is over (whether or not it read Δ): release the ranks waiting in `serve`."""
        with self._lock:
            if self._open:
                self._open = False
                self.shards._broadcast(None)
