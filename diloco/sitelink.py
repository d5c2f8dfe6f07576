"""`SiteLink`: how the processes of one worker act as one — the site coordinator of a round.

A lone process is its own worker: every decision is its own (`agree` runs it), and the state is whole. On a
torch.distributed site (`diloco.site`) the leader is the worker's only peer in the swarm: wherever the swarm is
asked (a round's outcome, whether to catch up, the standing check at a slot) the leader decides and every
rank applies its decision with the same code, so all ranks hold one state. On an FSDP2 site (`diloco.shards`)
each rank holds a piece of θ, of the outer state and of Δ: the leader's round reads Δ span by span from the
ranks, a committed Δ̄ is handed out piece by piece, and a downloaded or resumed state is scattered.

The engine calls the link at those points and nowhere else; a link without a site answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import torch

from diloco.comms import RoundOutcome
from diloco.comms.rounds import Value

from .fragments import Fragment
from .outer import copy_into
from .shards import ShardedHandoff, SiteShards
from .site import Site
from .state import GlobalState
from .topology import Followed

if TYPE_CHECKING:
    from .member import Member
    from .swarm import Swarm

T = TypeVar("T")


class SiteLink:
    """One worker's processes: a lone process (`site` None) or a site's ranks (see the module docstring)."""

    def __init__(self, site: Site | None, shards: SiteShards | None) -> None:
        self.site, self.shards = site, shards
        self.follows = False
        """A site rank other than the leader, in a swarm: it applies the leader's decisions."""
        self.incoming: GlobalState | None = None
        """An FSDP2 leader's downloaded or resumed state, held whole until every rank took its pieces."""
        self._value: Value | None = None  # an FSDP2 leader's committed Δ̄ (result frames), to hand out
        self._alone = False  # the leader runs a step of its own (`settle`): its decisions are its own

    @property
    def talks(self) -> bool:
        """This process is the worker's voice: a lone process, or the leader of its site."""
        return self.site is None or self.site.leader

    @property
    def hands_out(self) -> bool:
        """A decision here goes to the site's other ranks: a site's leader, outside a step it runs alone (`settle`
        hands out what that step changed once it is done)."""
        return self.site is not None and not self._alone

    @property
    def writes_checkpoints(self) -> bool:
        """This process takes part in writing checkpoints: the worker's voice, or every rank of an FSDP2 site
        (each holds a piece of the state)."""
        return self.talks or self.shards is not None

    def agree(self, decide: Callable[[], T]) -> T:
        """`decide()` here, or on a site: the leader's result on every rank (see `diloco.site`). Inside `settle`'s
        step the leader decides alone (the other ranks wait for the step's outcome)."""
        return decide() if self.site is None or self._alone else self.site.agree(decide)

    def settle(self, member: Member, step: Callable[[], T]) -> T:
        """`step()`, a topology's step that may change the worker's state outside the engine's rounds (a region's
        merge, a gossip round, the run's final model); on a site the leader runs it alone and every rank gets its
        result, and if it changed the state, the leader's state and local model (a DDP site's ranks hold one local
        model: they go on from exactly the leader's)."""
        if self.site is None:
            return step()

        def lead() -> tuple[T, dict[str, Any]]:
            before = member.holding.changes
            self._alone = True
            try:
                value = step()
            finally:
                self._alone = False
            moved = member.holding.changes != before
            return value, self.handed_out(member, state=moved, local=moved)

        value, taken = self.site.agree(lead)
        if not self.talks:
            self.take(member, taken)
        return value

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds for the whole worker (on an FSDP2 site each rank judges its own piece)."""
        return self.shards.all_true(flag) if self.shards is not None else flag

    # ------------------------------------------------------------------ a round on an FSDP2 site

    def handoff(self, acc: torch.Tensor, params: Sequence[int]) -> ShardedHandoff | None:
        """The leader's Δ for its round: read span by span from the ranks (None: the Δ we hold is whole)."""
        return ShardedHandoff(self.shards, acc, params) if self.shards is not None else None

    def serve_piece(self, acc: torch.Tensor | None, params: Sequence[int]) -> None:
        """A rank other than the leader: serve our piece of Δ while the leader's round reads it."""
        if self.shards is not None and self.follows:
            assert acc is not None
            self.shards.serve(acc, params)

    def keep_value(self, outcome: RoundOutcome) -> None:
        """The leader: keep the committed Δ̄'s frames to hand them out piece by piece (`aggregate`)."""
        if self.shards is not None:
            self._value, outcome.value = outcome.value, None

    def aggregate(self, frag: Fragment, outcome: RoundOutcome, swarm: Swarm | None) -> torch.Tensor:
        """The committed Δ̄ of `frag` as this process applies it: whole, or on an FSDP2 site in a swarm this
        rank's pieces, handed out by the leader piece by piece."""
        if self.shards is None or not (swarm is not None or self.follows):
            if outcome.value is not None:  # a lean round (`RoundEngine.lean`)
                assert swarm is not None
                return decode_value(outcome, swarm)
            assert outcome.aggregate is not None
            return outcome.aggregate
        value, self._value = self._value, None
        spans = swarm.value_spans(value) if value is not None and swarm is not None else None
        mine = torch.empty(self.shards.map.local_numel(frag.params), dtype=torch.float32)
        self.shards.scatter_spans(spans, frag.params, mine)
        return mine

    # ------------------------------------------------------------------ a new state for every rank

    def handed_out(self, member: Member, *, state: bool = True, local: bool = False) -> dict[str, Any]:
        """What a site leader hands its other ranks with a new state: the state itself (an FSDP2 site's comes
        next, piece by piece: `adopt_incoming`), with `local` the local model (else they start it from θ), and
        the place in the schedule (alone when not `state`)."""
        held: dict[str, object] = {}
        if state:
            held = {"incoming": self.incoming is not None} if self.shards is not None else \
                {"state": member.holding.state.to_bytes()}
        if local and self.shards is None:
            held["local"] = [t.detach().cpu() for t in member.local()]
        s = member.standing
        return {**held, "steps": s.steps, "last_slot": s.last_slot, "attempt": s.attempt, "members": s.members,
                "offset": s.offset}

    def follow(self, member: Member, taken: dict[str, Any]) -> Followed:
        """A site rank other than the leader, as it attaches: take what the leader handed out (`take`) and whether
        it has a swarm; returns the leader's topology as far as this rank acts on it."""
        self.follows = bool(taken.pop("swarm"))
        flags = taken.pop("topology")
        assert isinstance(flags, dict)
        self.take(member, taken)
        return Followed(flags)

    def take(self, member: Member, taken: dict[str, Any]) -> None:
        """A site rank other than the leader: start from the leader's state and place in the schedule."""
        if "state" in taken:
            fresh = member.holding.empty_like()
            fresh.load_bytes(taken["state"])
            member.holding.replace(fresh)
            copy_into(member.local(), taken.get("local", member.holding.params))
        s = member.standing
        s.steps, s.last_slot = int(taken["steps"]), int(taken["last_slot"])
        s.attempt, s.members, s.offset = int(taken["attempt"]), taken["members"], int(taken["offset"])

    def took(self, member: Member, taken: dict[str, Any]) -> None:
        """The leader adopted a new state (`taken`: what it handed out): the other ranks take it, and on an FSDP2
        site every rank takes its pieces."""
        if not self.talks:
            self.take(member, taken)
        if self.shards is not None:
            self.adopt_incoming(member)

    def adopt_incoming(self, member: Member) -> None:
        """Every rank of an FSDP2 site: take its pieces of the state the leader holds whole (the new digest is
        hashed from the pieces: a peer that vouches for the state checks the site holds it)."""
        assert self.shards is not None
        whole, self.incoming = self.incoming, None
        local = self.shards.scatter_state(whole, member.holding.state, member.holding.outer_factory)
        del whole
        member.holding.replace(local)
        copy_into(member.local(), member.holding.params)
        member.publish("training")

    def gather(self, member: Member) -> GlobalState | None:
        """Every rank of an FSDP2 site: the state, whole, on the leader (None elsewhere); the state itself
        without shards."""
        if self.shards is None:
            return member.holding.state
        return self.shards.gather_state(member.holding.state, member.holding.outer_factory)


def decode_value(outcome: RoundOutcome, swarm: Swarm) -> torch.Tensor:
    """A lean round's Δ̄, decoded span by span from its result frames, each frame let go once read: the frames
    and their decoded copy never both exist whole."""
    assert outcome.value is not None
    value, outcome.value = outcome.value, None
    aggregate = torch.empty(value.numel, dtype=torch.float32)
    for i, _ in enumerate(swarm.value_spans(value, into=aggregate)):  # each span decoded in place
        value.frames[i] = b""
    return aggregate
