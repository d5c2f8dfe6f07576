"""Catching up at any size (diloco/statesync.py): the state in checked chunks, from several holders.

The download runs over the in-process transport between real `Swarm`s (the same handlers and
frames as between processes); holders are made to die, lie or lag mid-download.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import diloco
from diloco.catchup import fetch_state
from diloco.comms import InProcNetwork, TransportError
from diloco.comms.loop import LoopThread
from diloco.outer import nesterov, outer_step
from diloco.peers import InProcBoard
from diloco.state import GlobalState, Manifest, StateError
from diloco.statesync import Snapshot, download, serve_chunk, serve_manifest

pytestmark = pytest.mark.swarm

RUN = "sync"
CFG = diloco.SwarmConfig(run_id=RUN, round=diloco.CollectiveConfig(call_timeout=2.0), heartbeat_interval=0.1,
                         heartbeat_ttl=2)


def _state(numel: int, seed: int = 0) -> GlobalState:
    g = torch.Generator().manual_seed(seed)
    state = GlobalState([torch.randn(numel // 2, generator=g), torch.randn(numel - numel // 2, generator=g)],
                        nesterov())
    outer_step(state.outer, state.params, torch.randn(numel, generator=g))
    state.round = 7
    return state


def _fresh(numel: int) -> GlobalState:
    return GlobalState([torch.zeros(numel // 2), torch.zeros(numel - numel // 2)], nesterov())


class Holders:
    """In-process holders of one snapshot, answering as `Swarm`'s handlers do; each can be told to die
    after serving some chunks, or to corrupt every chunk it sends."""

    def __init__(self, snapshot: Snapshot, names: list[str]) -> None:
        self.snapshot, self.served = snapshot, {n: 0 for n in names}
        # a liar's chunks: well-formed frames of the same manifest holding other values
        self.lie = Snapshot(snapshot.round, snapshot.manifest, [t + 1 for t in snapshot.tensors], snapshot.info)
        self.die_after: dict[str, int] = {}
        self.freeze_after: dict[str, int] = {}
        self.explode_after: dict[str, int] = {}
        self.corrupt: set[str] = set()

    async def call(self, peer: str, name: str, payload: bytes, timeout: float) -> bytes:
        from diloco.comms import messages as msg

        header, _, _ = msg.decode(payload, run=RUN, kind=msg.STATE, caller="joiner", max_body=0)
        await asyncio.sleep(0.001)
        if peer in self.die_after and self.served[peer] >= self.die_after[peer]:
            raise TransportError(f"peer {peer} died")
        if peer in self.explode_after and self.served[peer] >= self.explode_after[peer]:
            raise RuntimeError("a bug in the call")
        if peer in self.freeze_after and self.served[peer] >= self.freeze_after[peer]:
            await asyncio.sleep(timeout)  # SIGSTOPped: the call times out
            raise TransportError(f"call to {peer} timed out after {timeout}s")
        if name == "diloco.manifest":
            return serve_manifest(self.snapshot, run_id=RUN, me=peer)
        self.served[peer] += 1
        return serve_chunk(self.lie if peer in self.corrupt else self.snapshot, header.span, run_id=RUN, me=peer)


def _download(holders: Holders, order: list[str], numel: int, chunk_timeout: float = 1.0):
    snap = holders.snapshot
    return asyncio.run(download(holders.call, run_id=RUN, me="joiner", digest=snap.digest, holders=order,
                                receiver=_fresh(numel).receiver, chunk_timeout=chunk_timeout))


def _snapshot(state: GlobalState, chunk: int) -> Snapshot:
    return Snapshot.take(state, state.manifest(chunk), {"position": 3})


def test_a_download_whose_holder_dies_midway_finishes_from_the_others():
    numel, chunk = 30_000, 4096  # 240 kB of state in 59 chunks
    state = _state(numel)
    holders = Holders(_snapshot(state, chunk), ["a", "b", "c"])
    holders.die_after["a"] = 5  # a serves 5 chunks, then every call to it fails
    receiver, info, progress = _download(holders, ["a", "b", "c"], numel)
    got = receiver.assemble(nesterov())
    assert got.manifest(chunk).digest == holders.snapshot.digest and got.round == 7 and info == {"position": 3}
    assert holders.served["a"] == 5 and holders.served["b"] + holders.served["c"] >= receiver.chunks - 5
    assert progress.received == progress.total == holders.snapshot.manifest.total


def test_a_holder_that_corrupts_chunks_is_outvoted_by_the_hashes_and_its_chunks_come_from_another():
    numel, chunk = 20_000, 4096
    state = _state(numel)
    holders = Holders(_snapshot(state, chunk), ["liar", "honest"])
    holders.corrupt.add("liar")
    receiver, _, progress = _download(holders, ["liar", "honest"], numel)
    assert receiver.assemble(nesterov()).manifest(chunk).digest == holders.snapshot.digest
    assert progress.bad_chunks["liar"] >= 1 and "honest" not in progress.bad_chunks


def test_a_download_that_no_honest_holder_can_finish_fails_naming_why():
    numel, chunk = 20_000, 4096
    holders = Holders(_snapshot(_state(numel), chunk), ["liar"])
    holders.corrupt.add("liar")
    with pytest.raises(StateError, match="could not be had"):
        _download(holders, ["liar"], numel)


@pytest.mark.parametrize("served", [0, 3])
def test_a_holder_frozen_before_or_during_a_download_costs_it_a_hedge_not_a_call_timeout(served):
    """A holder SIGSTOPped before the manifest (`served` 0: it is asked first) or after 3 chunks, with a call timeout
    of 20 s: the manifest is asked of the next holder `HEDGE` seconds later, and at the end the chunks stuck at the
    frozen holder are asked of the others; the download ends in seconds, with every chunk, not after 20 s."""
    from diloco.statesync import HEDGE

    numel, chunk = 30_000, 4096
    holders = Holders(_snapshot(_state(numel), chunk), ["frozen", "b", "c"])
    holders.freeze_after["frozen"] = served
    started = time.monotonic()
    receiver, _, progress = _download(holders, ["frozen", "b", "c"], numel, chunk_timeout=20.0)
    took = time.monotonic() - started
    assert receiver.assemble(nesterov()).manifest(chunk).digest == holders.snapshot.digest
    assert progress.received == progress.total and holders.served["frozen"] == served
    assert took < HEDGE + 4.0, took


def test_an_unexpected_error_in_a_chunk_request_ends_the_download_with_it_not_in_a_wait_forever():
    """Found in review: the workers are waited for one by one, and a worker that died of an error nobody expected
    (not a transport error, not a refused chunk) left its chunk in flight for good, the others waiting on it."""
    numel, chunk = 30_000, 4096
    holders = Holders(_snapshot(_state(numel), chunk), ["a"])
    holders.explode_after["a"] = 1
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="a bug in the call"):
        _download(holders, ["a"], numel, chunk_timeout=20.0)
    assert time.monotonic() - started < 5.0


def test_several_holders_share_the_chunks():
    numel, chunk = 60_000, 4096
    holders = Holders(_snapshot(_state(numel), chunk), ["a", "b", "c"])
    receiver, _, _ = _download(holders, ["a", "b", "c"], numel)
    assert all(n > 0 for n in holders.served.values()), holders.served
    assert sum(holders.served.values()) == receiver.chunks


@pytest.mark.timeout(300)
def test_a_150m_parameter_state_moves_between_two_swarm_peers_with_default_settings():
    """150M parameters with momentum: a 1.2 GB state, larger than a frame may be (max_payload, 1 GiB by
    default). It travels in 4 MiB chunks between two `Swarm` peers (the same handlers as between
    processes) and arrives bit-identical."""
    numel = 150_000_000
    state = GlobalState([torch.zeros(numel)], nesterov())
    state.params[0].normal_(generator=torch.Generator().manual_seed(0))
    outer_step(state.outer, state.params, torch.ones(numel) * 1e-3)
    assert 8 * numel > diloco.SwarmConfig().round.max_payload
    net, board, loop = InProcNetwork(), InProcBoard(), LoopThread()
    cfg = diloco.SwarmConfig(run_id=RUN)  # defaults
    server = diloco.Swarm.in_process(net, board, "server", cfg, loop)
    joiner = diloco.Swarm.in_process(net, board, "joiner", cfg, loop)
    try:
        manifest = state.manifest()
        snap = Snapshot.take(state, manifest, {})
        server.serve_state(lambda digest: snap if digest == snap.digest else None)
        started = time.monotonic()
        receiver, _, progress = fetch_state(joiner, snap.digest, ["server"], _like(numel).receiver)
        took = time.monotonic() - started
        got = receiver.assemble(nesterov())
        assert progress.total == 8 * numel and len(manifest.hashes) == -(-8 * numel // (4 << 20))
        assert got.digest() == state.digest()
        print(f"150M-parameter state (1.2 GB) over the in-process transport: {took:.1f} s")
    finally:
        server.close()
        joiner.close()
        loop.stop()


def _like(numel: int) -> GlobalState:
    return GlobalState([torch.empty(numel)], nesterov())


def test_manifest_parsing_refuses_a_manifest_that_does_not_add_up():
    m = _state(100).manifest(64)
    packed = m.pack()
    with pytest.raises(StateError):
        Manifest.unpack(packed[:-1])
    with pytest.raises(StateError):
        Manifest.unpack(b"XXXX" + packed[4:])
