"""`Member`: one worker as a member of a swarm — what it holds, what its record says, and how it catches up.

A member holds a global state (`Holding`: θ, the outer optimizer, the round, and their digest) and its
`Standing` (its place in the synchronization schedule, the attempt at its round, the members of its last
round). It enters a swarm (`join`: the handshake, serving its state, catching up), publishes its record,
serves snapshots of its state to peers that are behind (`diloco.serving`), and downloads the swarm's state
when it is behind itself (`maybe_resync`, through `diloco.catchup`). Its rounds are the engine's
(`diloco.engine`); a member without a swarm is a lone worker.

On a torch.distributed site every rank is a member object and the leader speaks for them (`diloco.sitelink`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from diloco.comms import PeerId
from diloco.peers.records import PeerRecord

from .accounting import Accounting
from .catchup import CatchUp
from .ending import Ending, RunEnded
from .holding import Holding, Later, views
from .outer import copy_into, mix_into, outer_step
from .report import RoundReport
from .serving import SnapshotServer
from .sitelink import SiteLink
from .state import GlobalState, pinned

if TYPE_CHECKING:
    from .swarm import Swarm
    from .topology import Topology


@dataclass
class Standing:
    """Where a worker stands: its inner steps and the step of its last synchronization slot (its schedule), the
    attempt at its current round, who took part in its last committed round, and whom it no longer waits for."""

    steps: int = 0
    last_slot: int = 0
    covered: int = 0
    """Inner steps the Δ of our latest slot covered: its weight in the round's means with rounds by time (H
    otherwise); `diloco status` shows it."""
    step_seconds: float | None = None
    """With rounds by time: our inner step's duration as our pace last measured it (adaptive rounds read the
    others', `diloco.pace`)."""
    attempt: int = 0
    members: tuple[PeerId, ...] | None = None
    """Who took part in the last round we committed (or in the state we downloaded): the next round needs a
    majority of them (`SwarmConfig.majority`)."""
    stragglers: set[PeerId] = field(default_factory=set)
    """Peers the last rounds went on without: asked, taken in when ready in time, not waited for."""
    offset: int = 0
    """Inner steps the swarm had taken that we did not: a state we downloaded comes with its source's step count
    (`swarm_step`), so a joiner's schedule continues where the swarm's is, not from 0."""

    @property
    def swarm_step(self) -> int:
        """The swarm's inner step, as this worker counts it: its own steps, plus those the swarm took before it
        joined (or while it was behind: the source of the last state it downloaded)."""
        return self.steps + self.offset

    @property
    def position(self) -> int:
        """Inner steps since our last synchronization slot; a peer that downloads our state takes the same
        position, so its slots fall on ours."""
        return self.steps - self.last_slot


class Member:
    """One worker in a swarm (see the module docstring); `swarm` stays None for a lone worker."""

    def __init__(self, holding: Holding, local: Callable[[], list[torch.Tensor]], link: SiteLink,
                 accounting: Accounting, *, schema: str, period: Callable[[], int], join_timeout: float = 10.0,
                 on_report: Callable[[RoundReport], None] = lambda r: None,
                 on_download: Callable[[], None] = lambda: None, on_commit: Callable[[], None] = lambda: None,
                 stop_requested: Callable[[], int | None] = lambda: None,
                 end_requested: Callable[[], bool] = lambda: False) -> None:
        """`local()`: the local parameters a new state is copied into. `period()`: inner steps between slots now.
        `on_report(r)`: the caller's part of a report (metrics, `on_round`). `on_download()`: we took another
        peer's state (what referred to ours is void). `on_commit()`: a round moved our state (a checkpoint may be
        due). `stop_requested()`: a signal the launcher sent, if any. `end_requested()`: whether the launcher was
        asked to end the whole run (`diloco.ending`)."""
        self.holding, self.local, self.link, self.accounting = holding, local, link, accounting
        self.schema = schema
        """The digest of the model's parameter names and shapes, the compression and the fragment layout: a peer
        whose schema differs is refused at the handshake."""
        self.join_timeout = join_timeout
        self.standing = Standing()
        self._period, self._on_report, self._on_download = period, on_report, on_download
        self.committed = on_commit
        self.stop_requested = stop_requested
        self.end_requested = end_requested
        self.swarm: Swarm | None = None
        self.topology: Topology | None = None
        self.server = SnapshotServer(holding, self.snapshot_info, on_demand=link.shards is None)
        """The snapshots of our state that peers catching up download."""
        self.catch_up = CatchUp(self.publish)
        """Catching up with the swarm (`diloco.catchup`): failed sources, refused chunks, failures."""
        self.reports: list[RoundReport] = []
        self.loss: float | None = None
        """The latest inner loss the loop reported (`DiLoCo.report_loss`), published with our record."""
        self.standby = False
        """Publish `standby` instead of `training` (a region's global level held by a member that is not its
        region's representative: it holds θ_G but leaves the swarm's rounds to the representative)."""
        self._publishing = threading.Lock()
        """One thread at a time writes our record's view of the state: a record published right after a commit
        carries the digest "" (still being hashed) and must not land after the one that carries the digest."""
        self._owed = False
        """A publication at once waits for the digest being hashed."""
        self.ending = Ending()
        """The end of the whole swarm's run (`diloco.ending`): asked for, announced, read."""
        holding.on_known(self._publish_digest)

    @property
    def state(self) -> GlobalState:
        """The global state we hold: θ, the outer optimizer, the round."""
        return self.holding.state

    @property
    def round(self) -> int:
        return self.holding.round

    @property
    def digest(self) -> str:
        """Short SHA-256 of the state we hold (θ, outer optimizer state, round)."""
        return self.holding.digest

    @property
    def in_swarm(self) -> bool:
        """Our rounds run in a swarm: ours, or (a site rank other than the leader) our leader's."""
        return self.swarm is not None or self.link.follows

    def join(self, swarm: Swarm) -> None:
        """Enter `swarm`: the handshake (a peer with another model or codec stops here, saying so), serving our
        state to peers catching up, and catching up with the swarm (download its state if others are ahead)."""
        self.swarm = swarm
        swarm.handshake(self.schema)
        swarm.serve_state(self.server.serve, wait_unserved=self.link.shards is None)
        self.catch_up.on_join(swarm, lambda: (self.holding.round, self.holding.digest), self.resync,
                              self.join_timeout)

    # ------------------------------------------------------------------ what the swarm sees of us

    def report(self, report: RoundReport) -> RoundReport:
        """Keep `report`, publish our record, and tell the caller (metrics, `on_round`)."""
        self.reports.append(report)
        if report.committed:
            self.ending.committed()
        self.publish("training")
        self._on_report(report)
        return report

    def publish(self, status: str, now: bool = True) -> None:
        """Our record in the swarm: `status`, where we are, our digest, bytes, utilization (`now`: at once, else
        with the next heartbeat)."""
        if status == "training" and self.standby:
            status = "standby"
        if self.swarm is not None:
            sent, received = self.bytes_on_wire()
            usage = self.accounting.usage()
            s = self.standing
            with self._publishing:
                rnd, digest, recent = self.holding.record()
                owed = now and not digest  # sent once the digest is known (`_publish_digest`), not twice
                self.swarm.update(now=now and not owed, status=status, round=rnd, attempt=s.attempt, digest=digest,
                                  step=s.steps, loss=self.loss, recent=recent, bytes_sent=sent,
                                  bytes_received=received,
                                  utilization=round(usage.utilization, 4) if usage.steps else None,
                                  round_steps=s.covered or None, step_seconds=s.step_seconds)
                self._owed = self._owed or owed

    def _publish_digest(self) -> None:
        """The digest of the state we hold is known now (hashed beside training): our record says so, and goes
        out at once if a publication waited for it."""
        if self.swarm is not None:
            with self._publishing:
                rnd, digest, recent = self.holding.record()
                self.swarm.update(now=self._owed, round=rnd, digest=digest, recent=recent)
                self._owed = False

    def set_standby(self, standby: bool) -> None:
        """Publish `standby` instead of `training` from now on, or stop: our record at once if that changes it,
        else with the next heartbeat (or our goodbye)."""
        changed, self.standby = standby != self.standby, standby
        self.publish("training", now=changed)

    def snapshot_info(self) -> dict[str, object]:
        """What a peer downloading our state learns with it: our place in the schedule, the last members, and
        what the topology adds (a region's place in its merge schedule)."""
        info: dict[str, object] = {"position": self.standing.position, "swarm_step": self.standing.swarm_step,
                                   "members": ",".join(self.standing.members or ())}
        return {**info, **(self.topology.snapshot_info() if self.topology is not None else {})}

    def step_seconds_of_others(self) -> list[float]:
        """The inner step times the swarm's other training workers published, as the heartbeat last read their
        records (no network I/O; none for a lone worker or before the first read)."""
        if self.swarm is None:
            return []
        banned = self.swarm.collective.banned
        return [r.step_seconds for r in self.swarm.others_seen()
                if r.step_seconds is not None and r.status == "training" and r.peer not in banned]

    def bytes_on_wire(self) -> tuple[int, int]:
        """(sent, received) bytes of this peer so far, every message included."""
        return self.swarm.bytes_on_wire() if self.swarm is not None else (0, 0)

    # ------------------------------------------------------------------ at a synchronization slot

    def run_ended(self, launched: int) -> bool:
        """Whether the whole swarm's run ended for us (`diloco.ending`): an end is announced (by us now, when we were
        asked to and none is) and our rounds got to it (`launched`: our rounds on the wire). Never for a lone
        worker, nor for a site's rank other than the leader (its slot learns it from the leader). No network I/O."""
        t = self.topology
        if self.swarm is None or t is None:
            return False
        if not self.ending.wanted and self.end_requested():
            self.ending.wanted = True
        return self.ending.reached(t.whole(self.swarm), t.count(self, launched), t.per_count())

    def check_standing(self, launched: int) -> bool:
        """Raise `Banned` once most other peers banned us (`Swarm.check_standing`). A site stops here, every rank at the same slot,
        when its leader was asked to (SIGTERM / SIGINT from the launcher). Once `launched` rounds (ours on the wire)
        got to the whole swarm's end (`run_ended`), returns True, the same on every rank: launch no round, the run is
        over (`Ending.over`); at a slot after that, the loop went on without looking: `RunEnded`. An FSDP2 site that a peer asked for
        our state since its last snapshot gathers one here, for that peer to download while the round we are
        about to run waits for it."""
        if not self.in_swarm and self.link.site is None:
            return False

        def standing() -> tuple[int | None, bool, bool]:
            if self.swarm is not None:
                self.swarm.check_standing(self.standing.members)
            wanted = self.link.shards is not None and self.swarm is not None and bool(self.swarm.unserved())
            return self.stop_requested(), wanted, self.run_ended(launched)

        signum, snapshot, ended = self.link.agree(standing)  # raises Banned on every rank
        if signum is not None:
            raise SystemExit(128 + signum)
        if ended and self.ending.over:
            raise RunEnded(self.round)
        self.ending.over = self.ending.over or ended
        if snapshot:
            self.take_snapshot()
        return ended

    def take_snapshot(self) -> None:
        """Every rank of an FSDP2 site: gather the current state, whole, for the leader to serve."""
        whole = self.link.gather(self)
        if whole is None:
            return
        self.server.offer(whole)
        if self.swarm is not None:
            self.swarm.wait_for_unserved()  # our next round waits for the peers that asked, while they download

    # ------------------------------------------------------------------ catching up

    def maybe_resync(self, started: float, cached: bool = False, merge: bool = False) -> RoundReport | None:
        """Download the swarm's state if it moved past us (or ours is in the minority); with `cached`, judge from
        the records the last heartbeat read (no network I/O on the training thread)."""
        if not self.in_swarm or (self.topology is not None and not self.topology.one_state):
            return None  # a gossip peer's state is its own: nothing to take
        sent0, recv0 = self.bytes_on_wire()
        decided = self.link.agree(lambda: self._resync_if_behind(cached))
        if decided is None:
            return None
        ok, why, taken = decided
        if ok:
            self.link.took(self, taken)
        sent, recv = self.bytes_on_wire()
        return self.report(RoundReport(self.holding.round, False, f"resynced: {why}" if ok else f"resync failed: "
                                       f"{why}", 1, sent - sent0, recv - recv0, time.monotonic() - started,
                                       self.standing.steps, resynced=ok, merge=merge and ok))

    def _resync_if_behind(self, cached: bool) -> tuple[bool, str, dict[str, object]] | None:
        """The leader's side of `maybe_resync`: None when our state is current, else whether the download worked,
        why it was needed, and (on a site) the state the other ranks take."""
        assert self.swarm is not None
        source, why, _ = self.catch_up.source(self.swarm, self.holding.round, self.holding.digest, cached=cached)
        if source is None:
            stuck = self.catch_up.stranded(self.holding.round)
            if stuck:
                self.swarm.look_for(self.catch_up.swarm_peers)  # its DHT node may be an island: ping them back
                return False, stuck, {}
            return None
        ok = self.resync(source, why)
        return ok, why, self.link.handed_out(self) if ok and self.link.hands_out else {}

    def resync(self, source: PeerRecord, why: str) -> bool:
        """Download the state `source` advertises (`diloco.catchup`: vouched for, verified, from every peer that
        holds it) and adopt it: θ, the outer state, the round, the source's place in the schedule and the members
        of its last round."""
        assert self.swarm is not None
        into = self.link.shards.receiver if self.link.shards is not None else self.holding.state.receiver
        got = self.catch_up.download(self.swarm, source, why, into, self.holding.outer_factory)
        if got is None:
            return False
        fresh, info = got
        self.adopt(fresh)
        s = self.standing
        s.attempt, s.stragglers = 0, set()
        self._on_download()
        position, members, step = info.get("position"), info.get("members"), info.get("swarm_step")
        if isinstance(position, int) and not isinstance(position, bool):
            self.place(position)  # take the source's place: our next slot is its next slot
        if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 1 << 62:
            s.offset = step - s.steps  # the swarm's step: a schedule (the lr's) continues from the source's
        if isinstance(members, str) and members:
            s.members = tuple(PeerId(m) for m in members.split(",")[:4096] if m)
        if self.topology is not None:
            self.topology.take_info(info)
        self.swarm.moved_to(fresh.round)
        if self.link.shards is None:
            self.publish("training")  # an FSDP2 site publishes once its ranks took their pieces
        return True

    def place(self, position: int) -> None:
        """Be `position` inner steps past our last slot (as a peer we downloaded state from is)."""
        self.standing.last_slot = self.standing.steps - position % self._period()

    def adopt(self, fresh: GlobalState) -> None:
        """Start from the state `fresh` (downloaded, or read from a checkpoint). On an FSDP2 site the leader holds
        it whole until every rank took its pieces (`SiteLink.adopt_incoming`, right after the decision)."""
        if self.link.shards is not None:
            self.link.incoming = fresh
            return
        local = self.local()
        if any(p.is_cuda for p in local):
            fresh = pinned(fresh, self.holding.outer_factory)  # θ in host memory for a model on a GPU: pinned
        self.holding.replace(fresh)
        copy_into(local, self.holding.params)

    # ------------------------------------------------------------------ what a topology does to our state

    def take_params(self, params: Sequence[torch.Tensor], *, bump: bool) -> None:
        """Make `params` our θ and our local model (the outer optimizer's state stays); `bump`: as a new round (a
        region's merge: members that missed it see they are behind)."""
        with self.holding.changing() as state:
            copy_into(state.params, params)
            if bump:
                state.round += 1
        copy_into(self.local(), self.holding.params)
        if bump and self.swarm is not None:
            self.swarm.moved_to(self.holding.round)  # our rounds' frames for the round we skipped are stale
        self.publish("training")

    def step_to(self, gradient: torch.Tensor, rnd: int, lr_scale: float, params: Sequence[int] | None = None,
                alpha: float = 0.0) -> None:
        """Step θ with `gradient` (flat fp32) as the outer step that makes round `rnd` (its lr `lr_scale` of the
        outer lr), and continue the local model from the new θ (a gossip round: our own state's step). `params`:
        the parameters of one fragment, when the round was that fragment's (the others stay as they are); `alpha`:
        the streaming mix of the local model with the new θ (0: take θ)."""
        with self.holding.changing(touched=params) as state:
            moved = state.params if params is None else views(state.params, params)
            outer_step(state.outer, moved, gradient, lr_scale)
            state.round = rnd
        local = self.local() if params is None else views(self.local(), params)
        mix_into(local, self.holding.params if params is None else views(self.holding.params, params), alpha)

    def progress(self) -> list[torch.Tensor]:
        """The local model's way from θ (local − θ): with streamed rounds, the inner steps taken since each
        fragment's last round (`keep_progress`)."""
        return [t.detach() - p.to(t.device) for t, p in zip(self.local(), self.holding.params)]

    def keep_progress(self, progress: Sequence[torch.Tensor]) -> None:
        """We just took a new θ (the local model holds it): go on from θ + `progress`, the inner steps we had
        taken beyond the θ we held before (a region's merge of streamed rounds)."""
        with torch.no_grad():
            for t, d in zip(self.local(), progress):
                t.add_(d)

    def close_round(self, report: RoundReport, moved_seconds: float) -> RoundReport:
        """Account and report a round that `step_to` applied (`moved_seconds`: its time on the network), after the
        checkpoint it makes due, if any."""
        self.committed()
        self.accounting.round_moved(report.bytes_sent + report.bytes_received, moved_seconds)
        return self.report(report)

    def merge_report(self, merged: RoundReport) -> RoundReport:
        """A merge of the regions as one of our rounds: the region round it made and our inner step now (`Regions`
        reports it once the state it made is held twice, with that state's digest)."""
        return replace(merged, round=self.holding.round, step=self.standing.steps, merge=True)

    def report_digest(self, report: RoundReport) -> str | Later:
        """The digest a report's metrics line names: the state it names (`RoundReport.digest`), else the state we
        hold, written once hashed beside training (`diloco.metrics`)."""
        return report.digest or self.holding.later()

    def fail_attempt(self) -> None:
        """Count a failed attempt at our current round and say so in our record (a region's representative whose
        merge failed: its members stop waiting for it)."""
        self.standing.attempt += 1
        self.publish("training")
