"""`DiLoCo`: turn an existing PyTorch training loop into a DiLoCo worker with one line.

    swarm = diloco.Swarm.join([ADDR], diloco.SwarmConfig(run_id="my-run", secret=SECRET))
    with diloco.DiLoCo(model, optimizer, swarm=swarm, inner_steps=100) as d:   # the one new line
        for x, y in loader:                  # the loop stays yours
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()                 # every inner_steps-th step also synchronizes
            optimizer.zero_grad()
        with d.global_weights():             # evaluate the global (outer) parameters
            evaluate(model)

The wrapper hooks `optimizer.step` (a post-step hook); after every H-th step it forms the
pseudo-gradient Δ = θ_global − θ_local, runs one round of the swarm's collective, applies the
averaged Δ̄ with the outer optimizer (default SGD lr 0.7, momentum 0.9, Nesterov; any torch
optimizer via `outer_optimizer=lambda params: ...`) and loads the new θ into the model. The inner
optimizer is never touched (its state persists across rounds), except after a non-finite
pseudo-gradient: we then roll back to θ, clear its per-parameter state and send nothing.

Failure semantics: if a round does not commit (a span owner died, too few peers), θ stays as it
was and the model keeps its local progress, so the next round's Δ still carries it. If the swarm
has moved past us (we were late, hung or partitioned), we download θ, the outer optimizer state
and the round number from a peer and continue from there; only our local work since the last
commit is lost. With `swarm=None` it is single-worker DiLoCo (useful to test and debug).

Streaming (`streaming=StreamingConfig(fragments=P, overlap=τ, alpha=α)`, docs/STREAMING.md): the
model is cut into P fragments of blocks; every H/P steps the next fragment's Δ is sent in the
background, its result is applied τ steps later and mixed into the local copy,
θ_local ← α·θ_local + (1−α)·θ_global. `outer_overlap="eager"|"delayed"` overlaps a whole outer step
instead. The defaults (P=1, τ=0, α=0) are plain DiLoCo. `flush()` (also on leaving the `with`)
applies the exchange still in flight; `usage()` says where the time and bytes went.

Compression (`SwarmConfig(round=CollectiveConfig(compression=...))`, or `compression=` without a swarm) encodes Δ before
it leaves; with an error-feedback stage (`ef:BETA`) the peer keeps what was not delivered in a
residual and adds it to the next Δ: a span whose contribution the round left out (dead owner,
missed deadline) stays in the residual whole. If a round commits for nobody the residual is not
touched (the local progress carries Δ); after a resync it is kept as it was.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Literal

import torch
from torch.utils.hooks import RemovableHandle

from diloco.comms import PeerId, RoundOutcome
from diloco.compression.pipeline import Spec, parse

from .accounting import Accounting, Usage
from .catchup import CatchUp
from .compression.errors import ConfigError, UsageError
from .ending import RunEnded
from .engine import RoundEngine
from .environment import data_shard
from .config import SwarmConfig
from .fragments import HSchedule, StreamingConfig, check_rounds, partition
from .gossip import Gossip
from .holding import Holding
from .launched import LaunchedRun
from .lifecycle import linger
from .member import Member
from .outer import OuterFactory, copy_into, default_outer, lr_schedule
from .persist import Checkpoints, save_model
from .regions import Regions
from .report import RoundReport
from .shards import local_view, site_shards
from .site import Site
from .sitelink import SiteLink
from .state import GlobalState, schema_digest
from .swarm import Swarm
from .topology import Topology

__all__ = ["DiLoCo", "RoundReport"]

log = logging.getLogger(__name__)


def _innermost(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside wrappers that hold one as `.optimizer` (accelerate's AcceleratedOptimizer):
    its `step` is the one that runs (or is skipped, for an overflowing fp16 step or mid-accumulation)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # type: ignore[attr-defined]
    return optimizer


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """The other names of tied parameters (`lm_head.weight` → `transformer.wte.weight`), canonical: a plain state
    dict has both, θ holds the tensor once."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = _canonical(name)
        if id(p) in first and first[id(p)] != name:
            out[name] = first[id(p)]
        first.setdefault(id(p), name)
    return out


def _canonical(name: str) -> str:
    """A parameter's name without the prefixes wrappers add (DDP's `module.`, torch.compile's
    `_orig_mod.`), so sites that wrap the same model differently agree on its schema."""
    while name.startswith(("module.", "_orig_mod.")):
        name = name.split(".", 1)[1]
    return name


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside the wrappers whose prefixes `_canonical` drops (DDP's `.module`, torch.compile's
    `._orig_mod`): what a user's `load_state_dict` and `from_pretrained` expect."""
    while True:
        inner = getattr(model, "module", None) if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
            else getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def flushes_subnormals() -> bool:
    """Whether this process's CPU arithmetic flushes subnormal floats to zero (`torch.set_flush_denormal`)."""
    return float(torch.tensor([1e-39]) * torch.tensor([1.0])) == 0.0


@contextmanager
def subnormals_flushed(flush: bool = True) -> Iterator[None]:
    """CPU arithmetic that flushes subnormal floats to zero (`flush`; they cost a CPU up to a third of its speed once
    DiLoCo's weights meet them: docs/USAGE.md), for the block. The setting is the calling thread's (the CPU's control
    register), and every thread started in the block takes it from its starter: a command that runs the bundled job
    (every worker of a simulation at once) or a benchmark enters it before its swarm starts its event loop, which
    decodes and averages, and restores the calling thread's setting after."""
    before = flushes_subnormals()
    torch.set_flush_denormal(flush)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


_TOLD: set[str] = set()
"""The warnings about subnormal floats this process gave (`_tell_of_subnormals`: each once)."""


async def _flushes_there() -> bool:
    return flushes_subnormals()


def _tell_of_subnormals(model: torch.nn.Module, swarm: Swarm | None = None) -> None:
    """Once a process each: a model that trains on the CPU without flushing subnormal floats is told how to (DiLoCo's
    outer steps make its arithmetic meet them, and a CPU computes them slowly: docs/USAGE.md); with `swarm`, one whose
    training thread flushes but whose swarm's event loop (it decodes and averages what the peers send) does not is
    told to set it before the swarm starts: a thread takes the setting from the one that starts it
    (`subnormals_flushed`)."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return
    if not flushes_subnormals():
        _warn_once("subnormals_not_flushed", "before training, on every peer",
                   "on a CPU, DiLoCo's weights meet subnormal floats that cost up to a third of the step time")
    elif swarm is not None and "subnormals_not_flushed_in_swarm" not in _TOLD \
            and not swarm.loop.run(_flushes_there(), timeout=10):  # (asked of the loop once a process at most)
        _warn_once("subnormals_not_flushed_in_swarm", "before Swarm.start/join",
                   "the swarm's event loop started before this thread flushed, and a thread takes the setting from the "
                   "one that starts it: its arithmetic meets subnormal floats slowly, and peers whose loops differ can "
                   "round one differently")


def _warn_once(event: str, fix: str, reason: str) -> None:
    if event not in _TOLD:
        _TOLD.add(event)
        log.warning("event=%s fix=torch.set_flush_denormal(True) %s reason=%s (docs/USAGE.md, \"Training on a CPU\")",
                    event, fix, reason)


def _compression(swarm: SwarmConfig | None, compression: str | None) -> Spec:
    """The compression our rounds use: the swarm's (every peer must agree), or locally the argument (fp32 by
    default). Error feedback (the spec's ef:BETA stage) keeps this peer's unsent residual. Raises ConfigError when
    both are given and differ."""
    spec = parse(swarm.round.compression if swarm is not None else compression or "fp32")
    if swarm is not None and compression is not None and parse(compression).text != spec.text:
        raise ConfigError(f"compression={compression!r} differs from the swarm's {spec.text!r}; "
                          "set it once, in SwarmConfig(round=CollectiveConfig(compression=...))")
    return spec


def _topology(d: DiLoCo, swarm: Swarm) -> Topology:
    """The topology `swarm`'s settings name for worker `d`: a region's two levels, gossip, or flat."""
    if swarm.cfg.region:
        return Regions(d.member, swarm, d.streaming, shift=d.streams)
    if swarm.cfg.topology == "gossip":
        return Gossip(d.member, d.outer_lr_schedule, d.fragments, d.streaming)
    return Topology()


class DiLoCo:
    """A DiLoCo worker around the user's model and inner optimizer (see the module docstring).

    The parts, each in its module: what the worker holds and how it stands in the swarm (`member`: a
    `diloco.member.Member`), its rounds (`engine`: a `diloco.engine.RoundEngine`), its processes (`link`:
    `diloco.sitelink`), its topology (`topology`: flat, `diloco.regions` or `diloco.gossip`) and its checkpoints
    (`checkpoints`: `diloco.persist`). This class hooks the optimizer and holds the parts together."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        swarm: Swarm | None | Literal["auto"] = "auto",
        inner_steps: int = 100,
        h_schedule: HSchedule = (),
        outer_optimizer: OuterFactory | None = None,
        outer_warmup: int = 0,
        outer_lr_schedule: Callable[[int], float] | None = None,
        on_round: Callable[[RoundReport], None] | None = None,
        join_timeout: float = 10.0,
        compression: str | None = None,
        streaming: StreamingConfig | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 0,
        site: Site | None | Literal["auto"] = "auto",
        global_device: torch.device | str = "cpu",
        round_seconds: float | None = None,
        adaptive: bool = False,
    ) -> None:
        if inner_steps < 1:
            raise ConfigError(f"inner_steps must be >= 1, got {inner_steps}")
        self.inner_steps = inner_steps
        """H at the start; `h_schedule` changes it after a number of committed rounds (`inner_steps_now`)."""
        self.h_schedule = tuple((int(r), int(h)) for r, h in h_schedule)
        self.outer_lr_schedule = lr_schedule(outer_warmup, outer_lr_schedule)
        """The outer lr's factor for the step that commits global round r (1-based; `diloco.outer.lr_schedule`)."""
        self.streaming = streaming or StreamingConfig()
        # "auto": a command started by `diloco start/join -- CMD` finds its swarm in the environment
        # (connected when we attach); without the launcher's variables, a single worker, no network.
        self.launched = LaunchedRun.from_env() if swarm == "auto" else None
        """The run the launcher started this process for (`diloco.launched`); None otherwise."""
        launch = self.launched.launch if self.launched is not None else None
        given = swarm if isinstance(swarm, Swarm) else None
        self.site = Site.detect() if site == "auto" else site
        """The torch.distributed group this worker spans (`diloco.site`); None for a lone process."""
        if launch is not None:
            checkpoint_dir = checkpoint_dir if checkpoint_dir is not None else launch.checkpoint_dir
            checkpoint_every = checkpoint_every or launch.checkpoint_every
        self.model, self.optimizer = model, optimizer
        _tell_of_subnormals(model)
        self._inner = _innermost(optimizer)  # accelerate's AcceleratedOptimizer wraps the torch optimizer
        self.global_device = torch.device(global_device)
        # Frozen parameters are not trained, so they are not synchronized: every peer loads the same values
        named = [(_canonical(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self.fragments = partition([n for n, _ in named], [p.numel() for _, p in named], self.streaming)
        check_rounds(inner_steps, len(self.fragments), self.streaming, self.h_schedule, round_seconds, adaptive)
        spec = _compression(given.cfg if given is not None else launch.swarm if launch else None, compression)
        self.compression = spec.text
        self._outer_factory = outer_optimizer or default_outer(spec.ef is not None)
        state = GlobalState(self.local_params, self._outer_factory, self.global_device)
        self.shards = site_shards(self.site, named, error_feedback=spec.ef is not None, streaming=self.streaming,
                                  global_device=self.global_device)
        """An FSDP2 site's transfers (`diloco.shards`): θ, the outer state and Δ are this rank's pieces."""
        self.link = SiteLink(self.site, self.shards)
        holding = Holding(state, self._outer_factory, self.global_device,
                          self.shards.manifest if self.shards is not None else None)
        layout = f"fragments={len(self.fragments)}:{self.streaming.pattern}"
        self.accounting = Accounting()
        self.on_round = on_round
        self.member = Member(holding, lambda: self.local_params, self.link, self.accounting,
                             schema=schema_digest(named, f"{spec.text}|{layout}"), period=lambda: self.engine.period,
                             join_timeout=join_timeout, on_report=self._reported,
                             on_download=self._downloaded, on_commit=lambda: self.checkpoints.if_due(),
                             stop_requested=lambda: self.launched.stop.signum if self.launched else None,
                             end_requested=lambda: self.launched is not None and self.launched.end_requested())
        """What the worker holds (θ, the outer state, the round), how it stands in the swarm, its catching up."""
        self.engine = RoundEngine(self.member, fragments=self.fragments, streaming=self.streaming,
                                  inner_steps=inner_steps, h_schedule=self.h_schedule,
                                  outer_lr_schedule=self.outer_lr_schedule, spec=spec,
                                  on_rollback=self._inner.state.clear, round_seconds=round_seconds,
                                  adaptive=adaptive)
        """The worker's rounds, from a synchronization slot to the outer step."""
        self.checkpoints = Checkpoints(self.member, self.engine, [n for n, _ in named], compression=spec.text,
                                       root=checkpoint_dir, every=checkpoint_every, aliases=_aliases(model))
        self.topology: Topology = Topology()
        """Flat, regions or gossip: what differs between them (`diloco.topology`)."""
        self._hook: RemovableHandle | None = None
        self._finished = False
        self._data_shard = data_shard("", launch.shard if launch else None)
        if given is not None:
            self._enter(given)

    def _enter(self, swarm: Swarm) -> None:
        """Take `swarm`'s topology (its settings name it), and the swarm our rounds run on."""
        _tell_of_subnormals(self.model, swarm)
        self.topology = self.member.topology = _topology(self, swarm)
        self.member.swarm = self.topology.rounds(swarm)

    # ------------------------------------------------------------------ what the worker is

    @property
    def swarm(self) -> Swarm | None:
        """The swarm our rounds run on (a region's namespace, in a region); None for a lone worker."""
        return self.member.swarm

    @property
    def state(self) -> GlobalState:
        """The global state we hold: θ, the outer optimizer, the round."""
        return self.member.state

    @property
    def digest(self) -> str:
        """Short SHA-256 of the global state (θ, outer optimizer state, round)."""
        return self.member.digest

    @property
    def round(self) -> int:
        return self.member.round

    @property
    def reports(self) -> list[RoundReport]:
        return self.member.reports

    @property
    def steps(self) -> int:
        return self.member.standing.steps

    @property
    def swarm_step(self) -> int:
        """The swarm's inner step: `steps` for a worker that trained from the start; a joiner (or a worker that fell
        behind and downloaded the state) continues from the step of the peer whose state it took. Set a schedule
        from it (the inner lr's: `lr_at(d.swarm_step)`) and a late joiner continues the swarm's, not its own from 0.
        Every rank of a site reads the same."""
        return self.member.standing.swarm_step

    @property
    def data_shard(self) -> int:
        """This worker's data shard, the same on every rank of a site: `diloco start/join --shard N` under the
        launcher, else drawn from the worker's peer id (stable across the launcher's restarts; 0 without a swarm).
        Seed the site's data order with it (and split it among the site's ranks as usual), so that workers read
        different data without agreeing on anything (`diloco.environment.data_shard`)."""
        return self._data_shard

    @property
    def members(self) -> tuple[PeerId, ...] | None:
        """Who took part in the last round we committed (or in the state we downloaded)."""
        return self.member.standing.members

    @property
    def schema(self) -> str:
        return self.member.schema

    @property
    def catch_up(self) -> CatchUp:
        """Catching up with the swarm (`diloco.catchup`): failed sources, refused chunks, failures."""
        return self.member.catch_up

    @property
    def loss(self) -> float | None:
        return self.member.loss

    @property
    def rollbacks(self) -> int:
        """Syncs at which our own pseudo-gradient was not finite: rolled back to θ, nothing sent."""
        return self.engine.rollbacks

    @property
    def regions(self) -> Regions | None:
        """Our region's two levels (`diloco.regions`), in a swarm that names a region; else None."""
        return self.topology if isinstance(self.topology, Regions) else None

    @property
    def gossip(self) -> Gossip | None:
        """Our gossip rounds (`diloco.gossip`), in a gossip swarm; else None."""
        return self.topology if isinstance(self.topology, Gossip) else None

    @property
    def streams(self) -> bool:
        """Whether our rounds are streamed or overlapped (Streaming DiLoCo: fragments, τ, whole-step overlap)."""
        return len(self.fragments) > 1 or bool(self.streaming.overlap) or self.streaming.outer_overlap != "none"

    def topology_summary(self) -> dict[str, object]:
        """What a run's final line says of its region or its gossip."""
        return self.topology.summary()

    @property
    def residuals(self) -> list[torch.Tensor] | None:
        """The error-feedback residual of each fragment (what compression has not delivered yet), or None without
        error feedback."""
        return self.engine.residuals

    @property
    def local_params(self) -> list[torch.Tensor]:
        """The model's trainable parameters as this process holds them: whole, or on an FSDP2 site this rank's
        piece of each (views of the parameters' storage: writes land in the model)."""
        return [local_view(p) for p in self._params]

    @property
    def inner_steps_now(self) -> int:
        """H of the next round (`inner_steps`, or what `h_schedule` says after the rounds committed)."""
        return self.engine.inner_steps_now

    @property
    def schedule_position(self) -> int:
        """Inner steps since our last synchronization slot (0 ≤ position < H/P)."""
        return self.member.standing.position

    @property
    def pending_rounds(self) -> int:
        """Rounds started but not applied yet (0 or 1): `round + pending_rounds` is how many rounds this peer has
        put on the wire."""
        return self.engine.pending_rounds

    @property
    def ended(self) -> bool:
        """The whole swarm's run ended for this worker: a peer announced the round it ends at and our rounds got
        there (docs/USAGE.md, "Ending the whole run"). Check it before each step (`while not d.ended:`); a loop that
        does not leaves by `RunEnded` (status 0) at the next slot. Every rank of a site learns it at the same slot.
        Never without a swarm. Cheap on every step: the swarm's end is read right after a slot, and found once."""
        ending = self.member.ending
        if not ending.over and self.site is None and self.steps == 0:
            ending.over = self.member.run_ended(self.round + self.pending_rounds)
        return ending.over

    def end_swarm(self) -> None:
        """Ask the whole swarm to end its run on one final model: at the next `ended` check or slot this worker
        announces the round it ends at, a few rounds ahead so that every peer reads it first (`diloco.ending`), and
        every peer ends there. Safe to call from a signal handler (it sets a flag); `diloco start/join` call it on
        SIGUSR2. On a site, the leader's (rank 0's) call counts."""
        self.member.ending.wanted = True

    def in_flight(self) -> concurrent.futures.Future[RoundOutcome] | None:
        """The exchange running in the background (None when there is none or it completed locally)."""
        return self.engine.pending.future if self.engine.pending is not None else None

    def usage(self) -> Usage:
        """Compute utilization, time blocked on communication, bytes and bandwidth per inner step."""
        return self.accounting.usage()

    def bytes_on_wire(self) -> tuple[int, int]:
        """(sent, received) bytes of this peer so far, every message included."""
        return self.member.bytes_on_wire()

    def report_loss(self, loss: float) -> None:
        """Optional: tell the swarm's live view our latest inner loss."""
        self.member.loss = float(loss)

    # ------------------------------------------------------------------ attaching to the loop

    def __enter__(self) -> DiLoCo:
        self.attach()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.detach(completed=exc_type is None or exc_type is RunEnded)

    def attach(self) -> None:
        """Join the swarm (the launcher's, for a command started by `diloco start/join -- CMD`), catch up with it
        (download θ if others are ahead) and hook the optimizer. On a site, the leader does this and every other
        rank starts from the leader's state.

        Raises:
            SwarmError: the launcher's swarm could not be joined (none of its addresses answered).
            HandshakeError: the swarm trains another model, run or compression; the message names the field.
        A swarm that cannot be caught up with in time is not an error: training starts from our own state and
        resynchronizes at the first slot (the report says so)."""
        taken = self.link.agree(self._join)
        shard = taken.pop("shard")
        assert isinstance(shard, int)
        self._data_shard = shard
        if self.site is not None and not self.site.leader:
            self.topology = self.member.topology = self.link.follow(self.member, taken)
        if self.shards is not None and taken.get("incoming"):
            self.link.adopt_incoming(self.member)
        if self.launched is not None:
            self.launched.stop.install()
        if self._hook is None:
            self._hook = self._inner.register_step_post_hook(lambda *_: self._after_step())
        self.engine.restart_clock()  # rounds by time: the first span of inner steps begins now

    def _downloaded(self) -> None:
        """We took a state another peer served: what we carried for it is gone, and our span of inner steps
        (rounds by time) begins now."""
        self.engine.per_fragment.forget_carry()
        self.engine.restart_clock()

    def _join(self) -> dict[str, object]:
        """The leader's side of `attach` (a lone process's, all of it); for a site, what the others take."""
        member = self.member
        if self.launched is not None and member.swarm is None:
            self._enter(self.launched.connect(self))
        if member.swarm is not None:
            self.topology.attach()  # a region's global level first: a region of our own starts from θ_G
            member.join(member.swarm)
            self.topology.after_catch_up()
            member.publish("training")
            if self.launched is not None:
                self.launched.hold_first_step(self.topology.whole(member.swarm))
        shard = data_shard(member.swarm.peer_id if member.swarm is not None else "",
                           self.launched.launch.shard if self.launched else None)
        if self.site is None:
            return {"shard": shard}
        return {"swarm": member.swarm is not None, "shard": shard, "topology": self.topology.flags(),
                **self.link.handed_out(member)}

    def detach(self, *, completed: bool = True) -> None:
        """Unhook the optimizer after applying the exchange still in flight, if any (`flush`). When the loop
        `completed` (no exception), a worker behind the swarm downloads its state first. A worker that joined the
        launcher's swarm also serves stragglers for a while (`linger`), writes its final checkpoint and metrics
        line, and leaves."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        try:
            self.flush()
            if completed:  # a loop that ended behind the swarm (the last round in doubt) ends on its state
                self.member.maybe_resync(time.monotonic())
        finally:
            self.member.holding.settle()  # a checkpoint written beside training is on disk when we return
            if self.member.swarm is not None:  # our last votes reach the members that may need them to commit
                self.member.swarm.settle_votes()
            if self.launched is not None:
                self.launched.end(self, completed)

    def _after_step(self) -> None:
        now = time.monotonic()
        self.accounting.begin_sync(now)
        if not self.engine.after_step() and self.member.swarm is not None and self.steps % 10 == 0:
            self.member.publish("training", now=False)  # progress rides on the next heartbeat
        now = time.monotonic()
        self.accounting.end_sync(now)
        self.accounting.step(now, *self.bytes_on_wire())

    def _reported(self, report: RoundReport) -> None:
        """A round report's way out of the worker: the launched run's metrics line, and `on_round`."""
        if self.launched is not None:
            self.launched.round_line(self, report)
        if self.on_round is not None:
            self.on_round(report)

    # ------------------------------------------------------------------ the outer round

    def sync(self) -> RoundReport:
        """Synchronize the next fragment now and wait for its result (τ is not waited out).

        Raises:
            UsageError: with `outer_overlap`, whose rounds complete at the next synchronization slot (call `flush()`).
            Banned: most members of the last round banned this peer; it must stop (the CLI exits 1).
        A round that fails is not raised: the report says why (`RoundReport.reason`), and the next slot retries
        it."""
        if self.engine.overlapped:
            raise UsageError("with outer_overlap the rounds complete at the next synchronization slot; "
                             "call flush() to apply the exchange in flight")
        return self.engine.sync()

    def flush(self) -> RoundReport | None:
        """Apply the exchange still in flight (waiting for it if needed); None when there is none."""
        return self.engine.flush()

    @contextmanager
    def global_weights(self) -> Iterator[None]:
        """Temporarily load the global (outer) parameters into the model, e.g. for evaluation."""
        saved = [p.detach().clone() for p in self.local_params]
        copy_into(self.local_params, self.state.params)
        try:
            yield
        finally:
            copy_into(self.local_params, saved)

    def save_final(self, path: str | os.PathLike[str]) -> Path | None:
        """Write the global model, as every peer holds it after the last round: through the model's
        `save_pretrained(path)` (a directory `from_pretrained` reads) when it has one (Hugging Face), else as a
        safetensors file of its whole state dict, a tied weight under each of its names (`load_state_dict(
        safetensors.torch.load_file(path))` takes it). On a site the leader writes, once; returns the path (None on the other ranks).

        Raises:
            UsageError: on an FSDP2 site, whose ranks hold pieces (write checkpoints, then `diloco export`)."""
        if self.shards is not None:
            raise UsageError("save_final on an FSDP2 site: its ranks hold pieces of the model; write checkpoints "
                             "(checkpoint_dir=...) and turn the newest into a model with `diloco export DIR OUT`")
        if not self.link.talks:
            return None
        with self.global_weights():  # the user's model, as they load it (not DDP's or torch.compile's wrapper)
            return save_model(_unwrapped(self.model), Path(path), self.round)

    def finish(self) -> None:
        """End the run on one final model, every peer's: with regions a last merge (when region rounds ran since
        the previous one) and θ_G′ taken by every peer; with gossip one average of every live peer's state (a
        flat swarm holds one state already). The model holds the final parameters afterwards, and the final
        line's `final_digest` names them. A run under the launcher or the CLI does this when its loop completes;
        a script that brings its own swarm calls it as the last line of its `with` block, on every peer. Once a
        run: a second call does nothing."""
        if self._finished:
            return
        self._finished = True
        self.flush()  # on every rank of a site: completing an exchange is a step they take together
        if self.member.in_swarm and self.topology.reshapes:  # on a site the leader's, and every rank takes it
            self.link.settle(self.member, lambda: self.topology.finish(self.member))

    def linger(self, timeout: float) -> int:
        """At the end of a run, before leaving: keep serving our state while a peer that is still in the swarm
        holds an older round, for at most `timeout` seconds; returns how many are still behind
        (`diloco.lifecycle.linger`; 0 at once for gossip, whose peers download nobody's final state)."""
        return linger(self.member, timeout) if self.topology.one_state else 0

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.checkpoints.root

    def save_checkpoint(self, root: str | os.PathLike[str] | None = None, keep: int = 3) -> Path | None:
        """Write the global state, error-feedback residuals and schedule position atomically (format:
        docs/CHECKPOINTS.md). A failure (disk full, …) is logged and training goes on; returns the path."""
        return self.checkpoints.save(root, keep)

    def resume(self, root: str | os.PathLike[str] | None = None) -> bool:
        """Load the newest verified checkpoint (falling back past damaged ones); False when there is none. Call
        before training; if the swarm is ahead, catching up downloads its newer state anyway. On an FSDP2 site
        every rank calls it: the leader reads the checkpoint and hands out the pieces."""
        return self.checkpoints.resume(root)
