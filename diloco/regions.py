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
  steps θ_G. The representative continues from θ_R ← θ_G′ (region round + 1; the region's momentum is
  kept); the region's other members wait, then download that region state from it over the region's link
  (verified, vouched for by the records like any catch-up).

The global level (`Regions.upper`) is an ordinary member of the peer's swarm (`diloco.member`) whose "local
model" is a copy of θ_R and whose inner step is one committed region round; its rounds (`Regions.merger`) are
an ordinary round engine (`diloco.engine`): the swarm's catch-up, state serving, quorum and digests apply to it
unchanged. Members other than the representative publish `standby` in the swarm's records: they serve the θ_G
they hold but are not waited for in its rounds; a member that becomes the representative downloads the
newest θ_G before its first merge.

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
from dataclasses import replace
from typing import TYPE_CHECKING, Collection, Sequence

from diloco.comms import PeerId
from diloco.compression.errors import ConfigError
from diloco.compression.pipeline import parse
from diloco.peers.membership import Voters, regions_of
from diloco.peers.records import PeerRecord

from .accounting import Accounting
from .engine import RoundEngine
from .fragments import StreamingConfig, partition
from .holding import Holding, Later
from .lifecycle import linger
from .member import Member
from .outer import OuterFactory, copy_into, nesterov
from .report import RoundReport
from .sitelink import SiteLink
from .state import GlobalState, schema_digest
from .topology import Topology

if TYPE_CHECKING:
    from .swarm import Swarm

log = logging.getLogger(__name__)


def scope_of(region: str) -> str:
    """The swarm namespace a region's rounds run in."""
    return f"region.{region}"


def representative(view: Sequence[PeerId]) -> PeerId:
    """Who merges for a region: the lowest peer id of the region round that just committed (its members all
    hold that view, so they agree without a message)."""
    return min(view)


def merge_held(records: Sequence[PeerRecord], others: Collection[PeerId], rnd: int, digest: str) -> bool | None:
    """Whether a member among `others` holds the state `digest` of region round `rnd` (a representative's merge)
    as `records` show it: True when one shows it (at that round now, or among its recent states, whether it left
    since or not); False when one shows another state at that round, or none of them is in the records but as
    having left; None while nobody has it yet."""
    mine = [r for r in records if r.peer in others]
    held = [r.digests_at(rnd) for r in mine]
    if any(digest in h for h in held):
        return True
    if any(h - {digest} for h in held) or all(r.status == "left" for r in mine):
        return False
    return None


def follow_decision(rep: PeerRecord | None, region_round: int) -> str:
    """What a member waiting for its representative's merge does now, from the representative's record in the
    region (`rep`; we are at `region_round`): "download" (it merged: its region state is one round ahead),
    "skip" (it left, or its merge failed: it counts the failure as a failed attempt of the region round, so
    its record says so), or "wait"."""
    if rep is None or rep.status == "left":
        return "skip"
    if rep.round > region_round:
        return "download"
    if rep.round == region_round and rep.attempt > 0:
        return "skip"
    return "wait"


class Regions(Topology):
    """One worker's two levels: the region's namespace (`scope`, where the worker's rounds run) and the global
    level (`upper`: a member of the peer's swarm holding θ_G, and `merger`, its rounds). The wrapper makes one
    when its swarm names a region."""

    reshapes = True
    params_final = True

    def __init__(self, worker: Member, swarm: Swarm, streaming: StreamingConfig, *, shift: bool) -> None:
        """`shift`: the worker's rounds are streamed (fragments, τ): at a merge its local model keeps the inner
        steps it took since each fragment's last round (`_merge`)."""
        cfg = swarm.cfg
        if streaming.outer_overlap != "none":
            raise ConfigError("a region's merge needs the region round before it applied: --outer-overlap does not "
                              "work with --region (fragments and --overlap do)")
        if worker.link.shards is not None:
            raise ConfigError("an FSDP2 site (its ranks hold pieces of the model) cannot be a region's member yet: "
                              "use DDP for the site, or drop --region to make it one worker of a flat swarm")
        self.name = cfg.region
        self.shift = shift
        self.worker = worker
        self.swarm = swarm
        """The peer's swarm: the global rounds (one representative per region) and the global state."""
        swarm.update(region=cfg.region)  # at once: the quorum of merges counts regions from these records
        self.scope = swarm.scope(scope_of(cfg.region))
        """The region's namespace: the worker's own rounds."""
        self.upper, self.merger = _global_level(worker, cfg.round.compression, cfg.merge_every,
                                                nesterov(cfg.global_lr, cfg.global_momentum),
                                                lambda peers: regions_of(peers, swarm.presence.regions))
        """The global level: a member of the peer's swarm whose state is θ_G and whose inner step is one committed
        region round, and its rounds (the merges)."""
        self.upper.set_standby(True)  # published when it joins; a region round may say otherwise (`after_commit`)
        self.merges = 0
        """Merges this peer took part in (as the representative, or by downloading θ_G′)."""
        self.skipped = 0
        """Merges that did not happen for this peer: the swarm's round failed, or the wait ran out."""
        self.global_seen = 0
        """The newest global round a region state we downloaded came from (`take_info`): a member holds θ_G as it was
        before the merges it followed."""
        self._unreported: tuple[RoundReport, Later, frozenset[PeerId]] | None = None
        """Our last merge until it is reported (`_report_merge`): its report (the region round it made), the digest of
        the state it made (hashed beside training) and the other members of the region round we merged."""

    # ------------------------------------------------------------------ joining and leaving

    def rounds(self, swarm: Swarm) -> Swarm:
        return self.scope

    def whole(self, swarm: Swarm) -> Swarm:
        return self.swarm  # every region's peers count

    def attach(self) -> None:
        """Join the global level (catch up with θ_G), before the worker catches up in its region. Until a merge
        commits, its quorum is a majority of the regions we see now: two regions whose representatives do not
        see each other yet (a record not yet propagated) cannot both commit a first merge on their own."""
        upper = self.upper
        upper.join(self.swarm)
        upper.publish("training")
        if upper.standing.members is None:
            upper.standing.members = tuple(sorted(r.peer for r in self.swarm.records()
                                                  if r.status in ("training", "standby")))

    def after_catch_up(self) -> None:
        """The worker caught up in its region (or found nobody there): a region without other members starts
        from θ_G, so a peer that (re)opens a region joins the swarm's model, not its own initialization."""
        worker = self.worker
        records = [r for r in self.scope.records() if r.status in ("training", "joining")]
        alone = not any(r.peer != self.scope.peer_id for r in records)
        # our role until a region round says otherwise: the representative of the region round whose state we took
        # (`take_info`), or in a region that ran none yet the lowest peer id we see there (published now, so the
        # other regions' representatives expect us in the first merge)
        self._stand_by_unless_representing(worker.standing.members or [r.peer for r in records] + [self.scope.peer_id])
        if alone and worker.round == 0 and worker.digest != self.upper.digest:
            worker.take_params(self.upper.holding.params, bump=False)
            log.info("event=region_opened region=%s global_round=%d", self.name, self.upper.round)

    def per_count(self) -> int:
        return self.merger.inner_steps_now  # region rounds per merge

    def count(self, worker: Member, launched: int) -> int:
        """The whole swarm counts merges (`diloco.ending`): the newest global round our region holds (ours, or as its
        representative's record shows it: a member does not hold θ_G′ itself), and the last merge that `finish`
        makes when region rounds ran since the one before. Every representative knows its own exactly, and stops
        no later than its members."""
        ours = [r.round for r in self.swarm.others_seen() if r.region == self.name]  # a representative that left too
        return max([self.upper.round, self.global_seen, *ours]) + (1 if self.upper.standing.position > 0 else 0)

    def close(self) -> None:
        """Leave the region's namespace and the global level (the worker leaves the swarm after this)."""
        try:
            self._report_merge(last=True)
        except Exception as e:  # noqa: BLE001 - leaving must never fail
            log.warning("event=merge_not_reported region=%s reason=%s", self.name, e)
        self.scope.close()
        self.merger.flush()

    # ------------------------------------------------------------------ the merge

    def after_commit(self, members: Sequence[PeerId]) -> None:
        """A region round just committed with `members`: publish our role in the swarm's records, and merge if
        one is due (the region round's count since the last merge reached `merge_every`)."""
        self._report_merge(members)
        upper = self.upper
        upper.standing.steps += 1  # the global level's inner step, shown in our swarm record: the swarm has started
        self._stand_by_unless_representing(members)
        if upper.standing.position < self.merger.inner_steps_now:
            return
        # Due. A merge that does not happen is tried again after the next region round (not `merge_every`
        # later), so regions whose schedules drifted apart (one slowed by a crash, a late start) meet again.
        self._merge(representative(members))

    def _stand_by_unless_representing(self, members: Sequence[PeerId]) -> None:
        """Our role at the global level after the region round whose members were `members` (the one we committed,
        or whose state we took): its representative (its lowest member) merges, every other member stands by."""
        self.upper.set_standby(representative(members) != self.scope.peer_id)

    def _merge(self, rep: PeerId, final: bool = False) -> None:
        """Merge as the representative `rep` of our last region round, or follow its merge. The merge makes the next
        region round R + 1: frames for it may come before we are done merging. With streamed rounds the local model
        is ahead of θ_R by the inner steps since each fragment's last round; it keeps them on top of θ_G′
        (local ← θ_G′ + (local − θ_R)), except at the run's end (`final`), which ends on θ_G′ itself."""
        self._report_merge(last=True)  # the one before, if still unreported
        self.scope.moved_to(self.worker.round)
        progress = self.worker.progress() if self.shift and not final else None
        merges = self.merges
        if rep == self.scope.peer_id:
            self._lead()
        else:
            self._follow(rep)
        if progress is not None and self.merges > merges:
            self.worker.keep_progress(progress)

    def finish(self, worker: Member) -> None:
        """The run ends on one model: a last merge if region rounds ran since the previous one (every region's
        representative ends its run at the same global round, so they meet), then θ_G′ everywhere: a member
        downloads it from a representative (it holds θ_R, whose parameters are θ_G′'s, but not θ_G′'s outer
        state), and a representative serves it while a peer of the swarm still holds an older θ_G. Every peer's
        model then holds θ_G′'s parameters, and `final_digest` (a digest of the parameters each peer ends on) is the
        same everywhere; where the final merge failed, each region's differs."""
        upper, members = self.upper, worker.standing.members
        if upper.standing.position > 0 and members:
            self._merge(representative(members), final=True)
        upper.maybe_resync(time.monotonic())
        if not upper.standby:  # the representatives serve θ_G′ to the swarm's peers that do not hold it yet
            linger(upper, self.swarm.cfg.round.gather_timeout)
        self._report_merge(last=True)

    def _lead(self) -> None:
        worker, upper = self.worker, self.upper
        upper.maybe_resync(time.monotonic())  # hold the newest θ_G before we take the difference to it
        copy_into(upper.local(), worker.holding.params)
        report = self.merger.sync()
        if not report.committed:
            self.skipped += 1
            worker.fail_attempt()  # our members read it in our record: no merge this time
            log.warning("event=merge_skipped region=%s role=representative reason=%s", self.name, report.reason)
            return
        upper.standing.last_slot = upper.standing.steps
        worker.take_params(upper.holding.params, bump=True)  # the region round R + 1: θ_R ← θ_G′
        self.merges += 1
        log.info("event=region_merged region=%s role=representative global_round=%d peers=%d", self.name,
                 upper.round, report.peers)
        others = frozenset(worker.standing.members or ()) - {self.scope.peer_id}
        self._unreported = (worker.merge_report(report), worker.holding.later(), others)
        if not others:  # a region of one: nobody to copy it (otherwise nobody holds it yet: they download it now)
            self._report_merge(last=True)

    def _report_merge(self, view: Sequence[PeerId] = (), *, last: bool = False) -> None:
        """Report our last merge (metrics, `on_round`) as the region round it made, once that state is held twice.
        Until then it is ours alone: were we to die, the members would run that region round again from the round
        before, and a merge we had reported would be a second state of it (`diloco bench chaos --faults repkill`
        found one per representative killed right after its merge). Held twice: a region round we committed since
        with another member, from the merged state (`view`: its members); or a member's record shows the merged
        state (`merge_held`). Checked where training passes anyway (a merge, a region round committed, the run's
        end), never waited for. Not reported when our state at that round gave way to another (we took the members'
        after they went on without our merge); reported held alone, with a warning, when `last` (a new merge, the
        run's end) finds no copy and no other state."""
        pending = self._unreported
        if pending is None:
            return
        report, later, others = pending
        if not later.ready() and not last:
            return
        rnd, digest = report.round, later.get()
        if (rnd, digest) not in self.worker.holding.recent:  # hashed: in `recent` unless replaced at its round
            self._unreported = None
            log.warning("event=merge_given_way region=%s region_round=%d reason=our state at that round was replaced "
                        "by the members'", self.name, rnd)
            return
        committed_with = bool(set(view) & others)  # a region round since, with a member holding it
        records = [] if committed_with else self.scope.records(cached=True)
        held = True if committed_with else merge_held(records, others, rnd, digest)
        if held is None and not last:
            return
        self._unreported = None
        if held is False and any(r.peer in others and r.status != "left" for r in records):
            log.warning("event=merge_given_way region=%s region_round=%d reason=a member holds another state at "
                        "that round", self.name, rnd)
            return
        if not held:
            log.warning("event=merge_held_alone region=%s region_round=%d reason=no member of the region took it",
                        self.name, rnd)
        self.worker.report(replace(report, digest=digest))

    def _follow(self, rep: PeerId) -> None:
        """Wait for the representative's merge, then download the region state it merged into (θ_G′ and the
        region's momentum, at the next region round: exactly its state, verified) over the region's link. Our
        θ_G stays as it was: the representatives hold θ_G′, and if we represent the region one day, our first
        merge downloads the newest θ_G first (`_lead`), so a merge never waits for a download across regions
        that it does not need."""
        worker, cfg = self.worker, self.swarm.cfg
        region_round = worker.round
        # the representative's round under its own deadlines, and a few chunk deadlines for its download
        limit = 1.2 * cfg.round.gather_timeout + cfg.round.result_timeout + 8 * cfg.round.call_timeout
        deadline = time.monotonic() + limit
        while True:
            decision = follow_decision(next((r for r in self.scope.records() if r.peer == rep), None), region_round)
            if decision == "wait" and self.scope.gathering(rep, region_round):
                # it asks us into region round `region_round` again: it is not merging (it restarted, and lost or
                # never made the merge), and waits for us as we wait for it
                decision = "skip"
            if decision == "download":
                report = worker.maybe_resync(time.monotonic(), merge=True)
                if report is not None and report.resynced:
                    self.merges += 1
                    log.info("event=region_merged region=%s role=member region_round=%d", self.name, worker.round)
                    return
            if decision == "skip" or time.monotonic() >= deadline:
                self.skipped += 1
                log.warning("event=merge_skipped region=%s role=member representative=%s reason=%s", self.name, rep,
                            "its merge failed, it left, or it runs our region round again" if decision == "skip"
                            else f"no merge within {limit:.0f}s")
                return
            time.sleep(0.1)

    def summary(self) -> dict[str, object]:
        """The global level, for a run's final line: our region, θ_G's round and digest, the merges."""
        return {"region": self.name, "global_round": self.upper.round, "global_digest": self.upper.digest,
                "merges": self.merges, "merges_skipped": self.skipped}

    # ------------------------------------------------------------------ the region's schedule

    def snapshot_info(self) -> dict[str, object]:
        """What a member joining our region learns with the region state: where we are in the merge schedule, and the
        global round it comes from (a member that follows a merge holds the region state, not θ_G′: `count`)."""
        return {"merge_position": self.upper.standing.position, "global_round": max(self.upper.round, self.global_seen)}

    def take_info(self, info: dict[str, object]) -> None:
        """We downloaded the region state: merge when our region does, and stand by unless we represent the region
        round we took (its lowest member: `after_commit`'s rule). A member that was late for a region round and took
        its state instead would otherwise still say `training` at the global level, and every merge, the run's final
        one included, would wait its whole gather timeout for a peer that never runs it."""
        position = info.get("merge_position")
        if isinstance(position, int) and not isinstance(position, bool) and position >= 0:
            self.upper.place(position)
        rnd = info.get("global_round")
        if isinstance(rnd, int) and not isinstance(rnd, bool) and rnd >= 0:
            self.global_seen = max(self.global_seen, rnd)
        if self.worker.standing.members:
            self._stand_by_unless_representing(self.worker.standing.members)


def _global_level(worker: Member, compression: str, merge_every: int, outer: OuterFactory,
                  voters: Voters) -> tuple[Member, RoundEngine]:
    """The global level of a region's member: θ_G (a copy of the worker's state's shapes, with the global outer
    optimizer) held by a member of the peer's swarm, whose local copy is what a merge takes the difference to
    (the region state), and whose rounds are the merges (one fragment, `merge_every` region rounds a period),
    their quorum counted in regions (`voters`: the region each peer's record last named)."""
    local = [t.detach().clone() for t in worker.holding.params]
    named = [(f"p.{i}", t) for i, t in enumerate(local)]  # the schema's names: the same on every member
    spec = parse(compression)
    streaming = StreamingConfig()
    fragments = partition([n for n, _ in named], [t.numel() for t in local], streaming)
    device = worker.holding.device
    holding = Holding(GlobalState(local, outer, device), outer, device)
    upper = Member(holding, lambda: local, SiteLink(None, None), Accounting(),
                   schema=schema_digest(named, f"{spec.text}|fragments={len(fragments)}:{streaming.pattern}"),
                   period=lambda: merge_every, join_timeout=worker.join_timeout)  # one fragment, no H schedule
    return upper, RoundEngine(upper, fragments=fragments, streaming=streaming, inner_steps=merge_every, h_schedule=(),
                              outer_lr_schedule=lambda rnd: 1.0, spec=spec, voters=voters)

