"""Topologies: how a worker's rounds relate to the rest of the swarm — flat, regions or gossip.

One narrow interface, driven by the engine and the wrapper at fixed points of a worker's life:

| point | flat | regions (`diloco.regions`) | gossip (`diloco.gossip`) |
|---|---|---|---|
| `rounds(swarm)`: where our rounds run | the swarm | the region's namespace | the swarm |
| `attach()`, before we join | — | join the global level (θ_G) | — |
| `after_catch_up()` | — | a region of our own starts from θ_G | — |
| `slot(started)`: a round of its own? (`own_slots`) | no: the engine's | no: the engine's | the group's round, our own step |
| `after_commit(members)` | — | a merge when one is due | — |
| `reshapes`: changes θ outside the engine's rounds | no | merges, the final one | its rounds, the final average |
| `one_state`: one state for all, caught up with? | yes | yes (per region) | no: each peer its own |
| `snapshot_info()` / `take_info(info)` | — | the merge schedule | — |
| `finish()`: the run's one final model | — (one state already) | a final merge; θ_G′ everywhere | one average of all |
| `final_digest()`: what every peer ends on | the state's | θ_G′'s | the averaged parameters' |
| `summary()`, `close()` | — | merges, θ_G; leave the levels | groups met |
| `count(worker, launched)`: our rounds as the whole swarm counts them (`diloco.ending`) | the rounds launched | the merges, the last one due included | the rounds launched |

A topology gets the worker's `Member` (its state, standing and record), never the wrapper; the swarm itself
carries no topology policy. The wrapper picks one from the swarm's settings (`SwarmConfig.region`,
`SwarmConfig.topology`).

On a torch.distributed site only the leader is in the swarm, so only the leader holds the topology; every other
rank holds a `Followed` stand-in with the same flags (`flags()`, handed out when the site joins). Where a topology
may change the worker's state (a merge, a gossip round, the run's final model) the leader runs that step alone
and the other ranks take its state and local model afterwards (`SiteLink.settle`), so every rank of a site holds
one state in regions and under gossip as in a flat swarm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from diloco.comms import PeerId

from .state import params_digest

if TYPE_CHECKING:
    from .member import Member
    from .report import RoundReport
    from .swarm import Swarm


class Topology:
    """Flat DiLoCo: every round is the whole swarm's, and every peer that commits holds one state. Regions and
    gossip override what differs (see the module docstring)."""

    one_state = True
    """Every peer of a round holds the same state afterwards: a peer behind downloads it, and a run's end waits
    for peers still behind (False for gossip: each peer keeps its own state)."""
    own_slots = False
    """Every synchronization slot is a round of the topology's own (`slot`), not the engine's (gossip)."""
    reshapes = False
    """`after_commit` or `finish` may change the worker's state: on a site the other ranks take it afterwards
    (`SiteLink.settle`)."""
    params_final = False
    """The run's final model is named by its parameters alone (`final_digest`): each peer's outer optimizer state
    is its own (a region's momentum, a gossip peer's), only the parameters are everyone's."""

    def flags(self) -> dict[str, bool]:
        """What a site's other ranks need to know of the leader's topology (`Followed`)."""
        return {"one_state": self.one_state, "own_slots": self.own_slots, "reshapes": self.reshapes,
                "params_final": self.params_final}

    def rounds(self, swarm: Swarm) -> Swarm:
        """The swarm our rounds run on, given the peer's."""
        return swarm

    def whole(self, swarm: Swarm) -> Swarm:
        """The whole swarm, given the one our rounds run on (`--wait-for N` counts every peer of the run)."""
        return swarm

    def attach(self) -> None:
        """Before the worker joins the swarm of its rounds."""

    def after_catch_up(self) -> None:
        """The worker caught up with its swarm (or found nobody to catch up with)."""

    def slot(self, started: float) -> RoundReport | None:
        """At a synchronization slot: a round of the topology's own (its report), or None for the engine's."""
        return None

    def after_commit(self, members: Sequence[PeerId]) -> None:
        """A round of ours committed with `members`."""

    def snapshot_info(self) -> dict[str, object]:
        """What a peer downloading our state learns with it, beyond our schedule and members."""
        return {}

    def take_info(self, info: dict[str, object]) -> None:
        """We downloaded a peer's state: `info` is what it told us of it."""

    def per_count(self) -> int:
        """Our rounds per round of the whole swarm's count (`count`): a region's rounds per merge."""
        return 1

    def count(self, worker: Member, launched: int) -> int:
        """Where we stand in the whole swarm's count of rounds, the one an end of the whole run names
        (`diloco.ending`): the rounds we put on the wire (`launched`)."""
        return launched

    def finish(self, worker: Member) -> None:
        """The run ended, its loop complete: make the one final model every peer of the run ends on (a flat swarm
        holds one state already). `worker` is the run's worker (`Topology` of a flat swarm holds none)."""

    def final_digest(self, worker: Member) -> str:
        """The digest of the final model, the same in every peer's final line when the run ended on one: a flat
        swarm's state (θ, the outer state, the round), or its parameters alone (`params_final`)."""
        return params_digest(worker.holding.params) if self.params_final else worker.digest

    def summary(self) -> dict[str, object]:
        """What a run's final line says of the topology."""
        return {}

    def close(self) -> None:
        """The worker leaves the swarm."""


class Followed(Topology):
    """A site rank other than the leader: its leader's topology as far as this rank acts on it (the flags); the
    leader alone runs the topology's steps, and `SiteLink.settle` hands their outcome to this rank."""

    def __init__(self, flags: dict[str, bool]) -> None:
        self.one_state, self.own_slots = bool(flags["one_state"]), bool(flags["own_slots"])
        self.reshapes, self.params_final = bool(flags["reshapes"]), bool(flags["params_final"])
