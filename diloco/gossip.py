"""Gossip: DiLoCo without an all-reduce, each round averaging within small groups of peers (NoLoCo;
`SwarmConfig(topology="gossip")`, docs/GOSSIP.md).

Every peer keeps its *own* global state θ_i and outer optimizer. At each synchronization slot (every H inner
steps) the live peers are cut into groups of `gossip_group` (default 2) by a permutation drawn from the run id
and the round number, so every peer that sees the same peers draws the same groups without a message
(`groups`). A group runs one ordinary round of the swarm's protocol (`Swarm.group_round_async`: the same
deadlines, authentication, admission checks and Paxos-style commit, with the group as the whole view) on the
members' *local* parameters, so each member learns the group's mean of local parameters m. Each member then
steps its own θ_i with its own outer optimizer, using

    g_i = θ_i − m = mean_group(Δ_j) + (θ_i − mean_group(θ_j))

as the gradient: the group's mean pseudo-gradient (Δ_j = θ_j − local_j) plus NoLoCo's consensus term pulling
θ_i toward the group's mean outer parameters, both at the outer lr (`gossip_gradient`). With one group of
everyone holding one θ this is exactly DiLoCo's step (g = Δ̄). A peer whose group did not meet in time (its
partner was slow, dead, or drew another group from other records) steps with its own Δ alone ("solo") and
goes on: nothing waits for the whole swarm, and nothing is retried. A pair cannot outvote a bad partner, so
each peer judges its own outer gradient against its recent ones instead (`history_scale`).

What is guaranteed, and what is not (docs/GOSSIP.md): the members of a group that commits apply the same
mean (the round protocol's guarantee, per group); there is no single global state and no global digest (each
peer publishes its own), and peers agree only in expectation as groups mix. Rounds are numbered per peer and
kept in step: a peer whose records show others two rounds ahead or more jumps to the round before theirs
(its state stays its own), so that it draws the same groups as they do (`round_to_run`). A joining peer
downloads one peer's state (the newest round, verified against that peer's advertised digest; no majority
can vouch for it, since every peer's differs).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from functools import partial
from statistics import median
from typing import TYPE_CHECKING, Any, Callable, Collection, Sequence

import torch

from diloco.comms import PeerId, RoundKey
from diloco.compression.errors import ConfigError
from diloco.peers.membership import GroupPlan, gossip_plan  # the round's arithmetic: groups, group_of, round_to_run
from diloco.peers.records import PeerRecord

from .fragments import Fragment, StreamingConfig, fragment_of_round
from .holding import views
from .outer import flatten, unflatten
from .report import RoundReport
from .topology import Topology

if TYPE_CHECKING:
    from .member import Member

log = logging.getLogger(__name__)


def gossip_gradient(theta: torch.Tensor, group_mean_local: torch.Tensor) -> torch.Tensor:
    """The outer gradient of one member: θ_i − mean_group(local_j) = mean_group(Δ_j) + (θ_i − mean_group(θ_j)),
    the group's mean pseudo-gradient plus NoLoCo's consensus term (alone: θ_i − local_i = Δ_i)."""
    return theta - group_mean_local


HISTORY = 8
"""Outer gradients of rounds that met whose norms a gossip peer remembers to judge the next one (`history_scale`; a
solo round has no partner to guard against and is neither judged nor remembered)."""


def history_scale(norm: float, recent: Sequence[float], clip: float, least: int = 3, own: float = 0.0) -> float:
    """The factor to scale this round's outer gradient by: 1, or what brings its norm down to `clip` × a usual
    round's: the larger of the median of our `recent` rounds' (as clipped) norms, once `least` are remembered, and
    the norm of our `own` pseudo-gradient this round (what we would step alone). A pair's median cannot tell which
    partner is wrong, but our own history and our own Δ can: a partner that sends absurd parameters moves us at
    most `clip` times a usual round. Our own Δ keeps the bound honest where norms grow from round to round (the
    inner learning rate's warm-up; a partner that diverged by a solo round) and guards the first rounds, before
    there is a history. Off with `clip` 0."""
    usual = max(median(recent) if len(recent) >= least else 0.0, own)
    if clip <= 0 or not usual > 0 or not norm > 0:
        return 1.0
    return min(1.0, clip * usual / norm)


def whole_norms(recent: Sequence[Sequence[float]]) -> list[float]:
    """The whole model's recent outer gradient norms, from each fragment's (`recent[f]`): the i-th of them is the
    norm of the fragments' i-th newest together (√Σ of squares), as many as every fragment has. With one fragment,
    its own."""
    depth = min((len(r) for r in recent), default=0)
    return [math.sqrt(sum(r[len(r) - 1 - i] ** 2 for r in recent)) for i in range(depth)]


class Gossip(Topology):
    """One worker's gossip rounds: groups, the exchange of local parameters, the step of its own state. With
    streaming fragments each round is one fragment's, in turn (round r: fragment r mod P, as in a flat swarm): the
    group averages that fragment's local parameters and each member steps that fragment of its own θ."""

    one_state = False
    own_slots = True
    reshapes = True
    params_final = True

    def __init__(self, member: Member, outer_lr_schedule: Callable[[int], float],
                 fragments: Sequence[Fragment], streaming: StreamingConfig) -> None:
        if streaming.overlap or streaming.outer_overlap != "none":
            raise ConfigError("a gossip round is applied at once (each peer steps its own state with its group's "
                              "mean): --overlap and --outer-overlap do not work with gossip; --fragments does")
        if member.link.shards is not None:
            raise ConfigError("an FSDP2 site (its ranks hold pieces of the model) cannot gossip yet: use DDP for "
                              "the site, or a flat swarm")
        self.member = member
        self.outer_lr_schedule = outer_lr_schedule
        self.fragments = list(fragments)
        self.alpha = streaming.alpha
        member.catch_up.gossip = True  # a joiner takes one peer's state: no majority vouches for any
        self.met = 0
        """Rounds whose group met: we stepped with the group's mean."""
        self.solo = 0
        """Rounds whose group did not meet in time: we stepped with our own Δ alone."""
        self.jumped = 0
        """Times we skipped round numbers to the others' newest (we were behind)."""
        self.partners: set[PeerId] = set()
        """Every peer we averaged with."""
        self.clipped = 0
        """Rounds whose outer gradient we scaled down, far above our recent ones (`history_scale`)."""
        self._norms: dict[int, deque[float]] = {f.index: deque(maxlen=HISTORY) for f in self.fragments}
        """Each fragment's recent outer gradient norms (`history_scale`)."""
        self.final = 0
        """Peers of the run's final average we took part in (0: none, or it is still to come)."""

    def slot(self, started: float) -> RoundReport:
        """One synchronization slot: draw our group, average local parameters with it, step our own θ."""
        m = self.member
        assert m.swarm is not None
        frag = self.fragments[fragment_of_round(m.round, len(self.fragments))]
        whole = len(self.fragments) == 1
        local = flatten(m.local() if whole else views(m.local(), frag.params)).to(m.holding.device)  # where θ lives
        numel = local.numel()
        outcome = m.swarm.finish_exchange(m.swarm.group_round_async(self._plan(fragments=len(self.fragments)), local),
                                          RoundKey(m.round))
        rnd = outcome.key.round  # ours, or later if we were behind (`round_to_run`)
        if rnd > m.round:
            self.jumped += 1
            log.info("event=gossip_jump from=%d to=%d", m.round, rnd)
        met = outcome.committed
        mean_local = outcome.aggregate if met else local
        assert mean_local is not None  # a committed round of a whole `Handoff` holds its mean
        theta = flatten(m.holding.params if whole else views(m.holding.params, frag.params))
        own = float(torch.dist(theta, local)) if met else 0.0  # our own Δ's norm: a usual round's at the least
        gradient = gossip_gradient(theta, mean_local.to(m.holding.device))
        del mean_local, local, theta
        # a partner's influence is what the history guards against: a solo round (our own Δ alone) is neither judged
        # nor remembered, since its norm lacks the consensus term and would drag the median of met rounds down
        norm = float(gradient.norm())
        scale = self._judged(norm, rnd + 1, outcome.view, frag.index, own) if met else 1.0
        if scale < 1.0:
            gradient.mul_(scale)
        m.step_to(gradient, rnd + 1, self.outer_lr_schedule(rnd + 1), None if whole else frag.params, self.alpha)
        del gradient
        if met:
            self.met += 1
            self.partners.update(p for p in outcome.view if p != m.swarm.peer_id)
            log.info("event=gossip_round round=%d group=%s norm=%.4g recent=%s", rnd + 1, ",".join(outcome.view), norm,
                     ",".join(f"{n:.4g}" for n in self._norms[frag.index]))
        else:
            self.solo += 1
            log.info("event=gossip_solo round=%d reason=%s norm=%.4g", rnd + 1, outcome.reason, norm)
        report = RoundReport(m.round, met, "gossip" if met else f"solo: {outcome.reason}",
                             max(1, len(outcome.view)), outcome.bytes_sent, outcome.bytes_received,
                             time.monotonic() - started, m.standing.steps, payload_bytes=outcome.payload_bytes,
                             numel=numel, fragment=frag.index, phases=outcome.phases)
        return m.close_round(report, outcome.seconds)

    def _plan(self, **how: Any) -> Callable[[Sequence[PeerRecord], Collection[PeerId]], GroupPlan]:
        """Our round's plan from the records the swarm reads when it starts (`membership.gossip_plan`)."""
        m = self.member
        assert m.swarm is not None
        return partial(gossip_plan, me=m.swarm.peer_id, my_round=m.round, run_id=m.swarm.cfg.run_id,
                       size=m.swarm.cfg.gossip_group, **how)

    def finish(self, worker: Member) -> None:
        """The run ends on one model: one average of every live peer's state θ_i (a single merge of locally
        trained replicas), each peer's model and θ then the mean. Every peer of the average takes the same mean
        (the round protocol's commit); a peer that missed it (it came after the gather closed) keeps its own
        state, and its final line says so (`gossip_final` 0)."""
        m = self.member
        assert m.swarm is not None
        theta = flatten(m.holding.params)
        outcome = m.swarm.finish_exchange(m.swarm.group_round_async(self._plan(everyone=True), theta.clone()),
                                          RoundKey(m.round))
        if not outcome.committed:
            log.warning("event=gossip_final_average_missed round=%d reason=%s", m.round, outcome.reason)
            return
        assert outcome.aggregate is not None
        # as in any gossip round: a partner's absurd parameters move us at most `clip` times a usual round
        theta, mean = theta.to(m.holding.device), outcome.aggregate.to(m.holding.device)
        gradient = theta - mean
        scale = self._judged(float(gradient.norm()), "final", outcome.view, None)
        if scale < 1.0:
            mean = theta - scale * gradient
        m.take_params(unflatten(mean, m.holding.params), bump=False)  # the mean itself, bit for bit, when unclipped
        self.final = len(outcome.view)
        log.info("event=gossip_final_average round=%d peers=%d", m.round, self.final)

    def _judged(self, norm: float, rnd: int | str, view: Sequence[PeerId], fragment: int | None,
                own: float = 0.0) -> float:
        """The factor our outer gradient of round `rnd` (its `norm`; of `fragment`, or None: the whole model's, the
        final average), from averaging with `view`, is to be scaled by (`history_scale` against our recent met rounds'
        of that fragment, or the whole model's `whole_norms`, and our `own` Δ's norm); counted and logged when below
        1, and remembered."""
        assert self.member.swarm is not None
        recent = list(self._norms[fragment]) if fragment is not None else whole_norms(list(self._norms.values()))
        scale = history_scale(norm, recent, self.member.swarm.cfg.round.robust.clip, own=own)
        if scale < 1.0:
            self.clipped += 1
            log.warning("event=gossip_clipped round=%s norm=%.4g own=%.4g recent=%s scale=%.3g group=%s reason=outer "
                        "gradient far above our recent rounds' and our own Δ (a partner sent parameters far from ours)",
                        rnd, norm, own, ",".join(f"{n:.4g}" for n in recent), scale, ",".join(view))
        if fragment is not None:
            self._norms[fragment].append(norm * scale)
        return scale

    def summary(self) -> dict[str, object]:
        """What the final metrics line says of our gossip."""
        return {"topology": "gossip", "gossip_met": self.met, "gossip_solo": self.solo, "gossip_jumped": self.jumped,
                "gossip_partners": len(self.partners), "gossip_clipped": self.clipped, "gossip_final": self.final}
