"""Regions: hierarchical DiLoCo for sites close to each other and far from the rest (docs/REGIONS.md).

A peer whose `SwarmConfig.region` names a region trains at two levels:

- **Region rounds** (every H inner steps): DiLoCo among the peers of its region only, in a namespace of the
  swarm (`Swarm.scope`: own records, rounds and state serving over the same connections and credentials).
  The region state θ_R has its own outer optimizer (the worker's, e.g. Nesterov 0.7 / 0.9): momentum in the
  region. After a region round every member holds one region state (one digest per region round).
- **Merges** (every `merge_every` region rounds): the region's *representative*, the lowest peer id of the
  region round that just committed (every member knows that view: no election), runs one round of the
  swarm itself with Δ = θ_G − θ_R; the swarm's rounds take one peer per region, and their quorum counts
  regions, not peers. The global outer optimizer (`global_lr`, `global_momentum`: momentum across regions)
  steps θ_G. The region's other members wait, then download θ_G′ from the representative over the
  region's link (verified, vouched for by the records like any catch-up) and everyone continues from it:
  θ_R ← θ_G′ (region round + 1; the region's momentum is kept).

The global level is an ordinary `DiLoCo` worker (`_Upper`) whose "local model" is a copy of θ_R and whose
inner step is one committed region round: the swarm's catch-up, state serving, quorum and digests apply to
it unchanged. Members other than the representative publish `standby` in the swarm's records: they hold
θ_G and serve it (a new representative, a joining region, a member that missed a merge download it from
them) but are not waited for in its rounds.

What happens when (tests/test_regions.py):
- a representative crashes before or during a merge: its members' wait ends at the round's deadline
  with no merge; the next region round's view has a new lowest peer id, which merges next time (the
  swarm's quorum counts its region, so the new representative is the same voter);
- a region loses its last peer: the swarm's rounds go on with the other regions (a departed region stops
  counting toward the quorum once its peers said they left; a crashed one counts as absent, as a crashed
  peer does in a flat swarm); a peer that joins that region later starts from θ_G;
- a peer restarts in another region: it joins that region's namespace and takes its region state;
- a partition between regions: the side without a majority of the last merge's regions commits no
  merges (the quorum), its regions keep training on their own, and once the link heals their next merge
  first downloads the newer θ_G (their progress since the cut is dropped, as a flat swarm's minority's is).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Sequence

import torch

from diloco.comms import PeerId
from diloco.peers.records import PeerRecord

from .config import ConfigError
from .outer import copy_into, nesterov

if TYPE_CHECKING:
    from .swarm import Swarm
    from .wrapper import DiLoCo, RoundReport

log = logging.getLogger(__name__)


def scope_of(region: str) -> str:
    """The swarm namespace a region's rounds run in."""
    return f"region.{region}"


def representative(view: Sequence[PeerId]) -> PeerId:
    """Who merges for a region: the lowest peer id of the region round that just committed (its members all
    hold that view, so they agree without a message)."""
    return min(view)


def follow_decision(rep: PeerRecord | None, rep_region: PeerRecord | None, global_round: int, region_round: int,
                    steps: int) -> str:
    """What a member waiting for its representative's merge does now, from the representative's records in the
    swarm (`rep`) and in the region (`rep_region`): "download" (it committed global round `global_round` + 1 or
    later), "skip" (it left, or went back to training without merging: its round failed), or "wait"."""
    if rep is None or rep.status == "left" or (rep_region is not None and rep_region.status == "left"):
        return "skip"
    if rep.round > global_round:
        return "download"
    if rep_region is not None and rep_region.round == region_round and rep_region.step > steps:
        return "skip"  # it trains on in the same region round: no merge this time
    return "wait"


class _Holder(torch.nn.Module):
    """The global level's model: a copy of the region state's tensors (never trained by an optimizer)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.p = torch.nn.ParameterList([torch.nn.Parameter(t.detach().clone()) for t in tensors])


class Regions:
    """One worker's two levels: the region's namespace (`scope`, the worker's rounds) and the global worker
    (`upper`, on the peer's swarm). Create with the peer's swarm; `DiLoCo` does when its swarm names a region."""

    def __init__(self, worker: DiLoCo, swarm: Swarm) -> None:
        from .wrapper import DiLoCo

        cfg = swarm.cfg
        streaming = worker.streaming
        if len(worker.fragments) > 1 or streaming.overlap or streaming.outer_overlap != "none":
            raise ConfigError("regions run plain DiLoCo rounds: give no --fragments/--overlap/--outer-overlap "
                              "with --region (streaming inside a region is not supported yet)")
        if worker.site is not None or worker.shards is not None:
            raise ConfigError("a torch.distributed site cannot be a region's member yet: run one process per "
                              "peer with --region, or drop --region to make the site one worker of a flat swarm")
        self.name, self.merge_every = cfg.region, cfg.merge_every
        self.swarm = swarm
        """The peer's swarm: the global rounds (one representative per region) and the global state."""
        swarm.quorum_by_region = True
        swarm.update(region=cfg.region, now=False)
        self.scope = swarm.scope(scope_of(cfg.region))
        """The region's namespace: the worker's own rounds."""
        holder = _Holder(worker.state.params)
        # made without a swarm (which would make it enter the region too), then given the peer's
        self.upper = DiLoCo(holder, torch.optim.SGD(holder.parameters(), lr=0.0), swarm=None,
                            compression=cfg.compression, inner_steps=cfg.merge_every,
                            outer_optimizer=nesterov(cfg.global_lr, cfg.global_momentum), site=None,
                            join_timeout=worker.join_timeout, global_device=worker.global_device)
        self.upper.swarm = swarm
        """The global level: its inner step is one committed region round; its state is θ_G."""
        self.upper.standby = True
        self.merges = 0
        """Merges this peer took part in (as the representative, or by downloading θ_G′)."""
        self.skipped = 0
        """Merges that did not happen for this peer: the swarm's round failed, or the wait ran out."""

    # ------------------------------------------------------------------ joining and leaving

    def attach(self, worker: DiLoCo) -> None:
        """Join the global level (catch up with θ_G), before the worker catches up in its region."""
        self.upper.attach()

    def after_catch_up(self, worker: DiLoCo) -> None:
        """The worker caught up in its region (or found nobody there): a region without other members starts
        from θ_G, so a peer that (re)opens a region joins the swarm's model, not its own initialization."""
        alone = not any(r.peer != self.scope.peer_id and r.status in ("training", "standby")
                        for r in self.scope.records())
        if alone and worker.state.round == 0 and worker.digest != self.upper.digest:
            self._take_global(worker, bump=False)
            log.info("event=region_opened region=%s global_round=%d", self.name, self.upper.state.round)

    def close(self) -> None:
        """Leave the region's namespace and the global level (the worker leaves the swarm after this)."""
        self.scope.close()
        self.upper.detach(completed=False)

    # ------------------------------------------------------------------ the merge

    def after_commit(self, worker: DiLoCo, members: Sequence[PeerId]) -> RoundReport | None:
        """A region round just committed with `members`: publish our role in the swarm's records, and merge
        if one is due (the region round's count since the last merge reached `merge_every`). Returns the
        merge's report (None when no merge was due, or none happened)."""
        rep = representative(members)
        me = self.scope.peer_id
        upper = self.upper
        if upper.standby != (me != rep):
            upper.standby = me != rep
            upper.publish_status()
        upper.steps += 1
        if upper.schedule_position < upper.inner_steps_now:
            return None
        upper.mark_slot()
        # the merge makes the next region round R + 1: frames for it may come before we are done merging
        self.scope.moved_to(worker.state.round)
        return self._lead(worker) if me == rep else self._follow(worker, rep)

    def _lead(self, worker: DiLoCo) -> RoundReport | None:
        upper = self.upper
        upper.resync_now()  # hold the newest θ_G before we take the difference to it
        copy_into(upper.local_params, worker.state.params)
        report = upper.sync()
        if not report.committed:
            self.skipped += 1
            log.warning("event=merge_skipped region=%s role=representative reason=%s", self.name, report.reason)
            return report
        self._take_global(worker, bump=True)
        log.info("event=region_merged region=%s role=representative global_round=%d peers=%d", self.name,
                 upper.state.round, report.peers)
        return report

    def _follow(self, worker: DiLoCo, rep: PeerId) -> RoundReport | None:
        upper, cfg = self.upper, self.swarm.cfg
        global_round, region_round = upper.state.round, worker.state.round
        # the representative's round under its own deadlines, then our download of θ_G′ (a few chunk deadlines)
        limit = 1.2 * cfg.gather_timeout + cfg.result_timeout + 4 * cfg.call_timeout + 4 * cfg.call_timeout
        deadline = time.monotonic() + limit
        while True:
            rep_record = next((r for r in self.swarm.records() if r.peer == rep), None)
            rep_region = next((r for r in self.scope.records() if r.peer == rep), None)
            decision = follow_decision(rep_record, rep_region, global_round, region_round, worker.steps)
            if decision == "download":
                assert rep_record is not None
                report = upper.resync_from(rep_record, f"our region's representative {rep} merged the regions")
                if report is not None and report.resynced:
                    self._take_global(worker, bump=True)
                    log.info("event=region_merged region=%s role=member global_round=%d", self.name,
                             upper.state.round)
                    return report
            if decision == "skip" or time.monotonic() >= deadline:
                self.skipped += 1
                log.warning("event=merge_skipped region=%s role=member representative=%s reason=%s", self.name, rep,
                            "it went on without merging" if decision == "skip" else f"no merge within {limit:.0f}s")
                return None
            time.sleep(0.1)

    def _take_global(self, worker: DiLoCo, *, bump: bool) -> None:
        """Continue from θ_G: the region state and the local model take it (the region's momentum stays);
        after a merge the region round advances, so a member that missed the merge sees it is behind."""
        worker.take_params(self.upper.state.params, bump=bump)
        if bump:
            self.merges += 1

    # ------------------------------------------------------------------ the region's schedule

    def snapshot_info(self) -> dict[str, object]:
        """What a member joining our region learns with the region state: where we are in the merge schedule."""
        return {"merge_position": self.upper.schedule_position}

    def take_info(self, info: dict[str, object]) -> None:
        """We downloaded the region state: merge when our region does."""
        position = info.get("merge_position")
        if isinstance(position, int) and not isinstance(position, bool) and position >= 0:
            self.upper.place_in_schedule(position)

