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

Compression (`SwarmConfig(compression=...)`, or `compression=` without a swarm) encodes Δ before
it leaves; with an error-feedback stage (`ef:BETA`) the peer keeps what was not delivered in a
residual and adds it to the next Δ: a span whose contribution the round left out (dead owner,
missed deadline) stays in the residual whole. If a round commits for nobody the residual is not
touched (the local progress carries Δ); after a resync it is kept as it was.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Literal, Sequence, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

from diloco.comms import PeerId, RoundKey, RoundOutcome
from diloco.comms.rounds import Handoff, Value
from diloco.comms.robust import finite
from diloco.compression.ef import ErrorFeedback
from diloco.compression.pipeline import Pipeline, parse
from diloco.peers import stragglers
from diloco.peers.records import PeerRecord

from . import persist
from .accounting import Accounting, Usage
from .catchup import CatchUp
from .checkpoint import CheckpointError
from .compression.errors import ConfigError, UsageError
from .environment import WAIT_TIMEOUT, Launch
from .gossip import Gossip
from .metrics import close_launched
from .fragments import (Fragment, HSchedule, StreamingConfig, check_h_schedule, check_schedule, fragment_of_round,
                        inner_steps_at, partition)
from .outer import OuterFactory, copy_into, default_outer, mix_into, outer_step, pseudo_gradient, \
    pseudo_gradient_pieces, warmup_scale
from .shards import ShardedHandoff, SiteShards, is_sharded, local_view
from .site import Site
from .state import GlobalState, is_pinned, pinned, schema_digest
from .statesync import Snapshot
from .swarm import Banned, Swarm

if TYPE_CHECKING:
    from .regions import Regions

log = logging.getLogger(__name__)

_T = TypeVar("_T")
SNAPSHOT_IDLE, SNAPSHOTS = 30.0, 2
"""Seconds a snapshot we serve stays after its last chunk was asked for (a download may resume), and how
many we hold at most (each is a copy of the state: a download of an older one overlapping a newer)."""


@dataclass(frozen=True)
class RoundReport:
    """What one synchronization did, for logs, metrics and the live view."""

    round: int  # the global round reached after this sync
    committed: bool
    reason: str
    peers: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    step: int
    resynced: bool = False
    payload_bytes: int = 0  # encoded size of our contribution (all spans), without framing
    numel: int = 0  # parameters synchronized
    fragment: int = 0  # which fragment this round synchronized (0 when the model is one fragment)
    blocked: bool = False  # the training loop had to wait for this round's result
    phases: dict[str, float] = field(default_factory=dict)
    """Where the round's time went, in seconds: gather, encode, exchange (or fetch), decide (`RoundOutcome.phases`)."""
    merge: bool = False
    """A merge of the regions (`diloco.regions`): our representative's round of the swarm, or our download of
    the region state it merged into; `round` is the region round it made."""

    @property
    def bits_per_param(self) -> float:
        """What our contribution cost on the wire per parameter: the codec's bits/param/sync."""
        return 8 * self.payload_bytes / self.numel if self.numel else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "bits_per_param": round(self.bits_per_param, 5)}


@dataclass
class _Pending:
    """A round in flight: what we sent (error-feedback accumulator) and when it must be applied."""

    fragment: Fragment
    acc: torch.Tensor | None
    """What we sent, kept only when something needs it after the round (error feedback, a failed whole-step
    overlap's carry); otherwise the round drops Δ once it is encoded."""
    due: int  # inner step at which the result is applied
    started: float
    future: concurrent.futures.Future[RoundOutcome] | None = None
    source: ShardedHandoff | None = None  # an FSDP2 site leader's Δ, read span by span by the round
    key: RoundKey = RoundKey(0)
    outcome: RoundOutcome | None = None
    blocked: bool = False


@dataclass
class _FragmentState:
    """What a worker keeps per fragment of the model (torchft's `_StreamingDiLoCoFragment` plays this part):
    the fragment, its error-feedback residual (compression with an ef:BETA stage), and, with a whole outer
    step overlapped, the Δ of its last round that failed, delivered with its next one."""

    fragment: Fragment
    ef: ErrorFeedback | None
    carry: torch.Tensor | None = None


class _StopOnSignal:
    """SIGTERM / SIGINT for a worker the launcher started: leave at the next inner step (a site: at the
    next synchronization slot, every rank at the same one), applying the exchange in flight and telling
    the swarm, instead of dying mid-step. A second signal stops at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._saved: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self._saved:
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._saved[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.signum is not None:
            self.restore()
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("event=stop_requested signal=%s reason=leaving the swarm at the next inner step",
                    signal.Signals(signum).name)

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._saved.clear()


def _innermost(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside wrappers that hold one as `.optimizer` (accelerate's AcceleratedOptimizer):
    its `step` is the one that runs (or is skipped, for an overflowing fp16 step or mid-accumulation)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # type: ignore[attr-defined]
    return optimizer


def _canonical(name: str) -> str:
    """A parameter's name without the prefixes wrappers add (DDP's `module.`, torch.compile's
    `_orig_mod.`), so sites that wrap the same model differently agree on its schema."""
    while name.startswith(("module.", "_orig_mod.")):
        name = name.split(".", 1)[1]
    return name


class DiLoCo:
    """A DiLoCo worker around the user's model and inner optimizer (see the module docstring)."""

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
    ) -> None:
        if inner_steps < 1:
            raise ConfigError(f"inner_steps must be >= 1, got {inner_steps}")
        if outer_warmup < 0:
            raise ConfigError(f"outer_warmup must be >= 0 rounds, got {outer_warmup}")
        if outer_warmup and outer_lr_schedule is not None:
            raise ConfigError("give outer_warmup or outer_lr_schedule, not both (a schedule can warm up itself)")
        self.inner_steps = inner_steps
        """H at the start; `h_schedule` changes it after a number of committed rounds (`inner_steps_now`)."""
        self.h_schedule = tuple((int(r), int(h)) for r, h in h_schedule)
        self.outer_lr_schedule = outer_lr_schedule or partial(warmup_scale, warmup=outer_warmup)
        """The outer lr's factor for the step that commits global round r (1-based), `outer_warmup`'s linear
        warmup unless given; a function of r alone, so every peer (and one that caught up) steps with the same lr."""
        self.streaming = streaming or StreamingConfig()
        # "auto": a command started by `diloco start/join -- CMD` finds its swarm in the environment
        # (connected when we attach); without the launcher's variables, a single worker, no network.
        self.launch = Launch.from_env() if swarm == "auto" else None
        self.swarm: Swarm | None = swarm if isinstance(swarm, Swarm) else None
        self.regions: Regions | None = None
        """With a swarm that names a region (`SwarmConfig.region`): the region's namespace, where our rounds run,
        and the global level (`diloco.regions`); None in a flat swarm."""
        self.gossip: Gossip | None = None
        """With a gossip swarm (`SwarmConfig.topology`): our rounds average within small groups and we keep our own
        state (`diloco.gossip`); None in a flat swarm."""
        self.standby = False
        """Publish `standby` instead of `training` (a region member's global level: it holds the state but
        leaves the swarm's rounds to its region's representative)."""
        self.site = Site.detect() if site == "auto" else site
        """The torch.distributed group this worker spans (`diloco.site`); None for a lone process."""
        self._follows = False  # a site rank other than the leader, in a swarm: it applies the leader's decisions
        self._owns_swarm = False
        if self.launch is not None:
            checkpoint_dir = checkpoint_dir if checkpoint_dir is not None else self.launch.checkpoint_dir
            checkpoint_every = checkpoint_every or self.launch.checkpoint_every
        self.model, self.optimizer = model, optimizer
        self._inner = _innermost(optimizer)  # accelerate's AcceleratedOptimizer wraps the torch optimizer
        self.global_device = torch.device(global_device)
        # Frozen parameters are not trained, so they are not synchronized: every peer loads the same values
        named = [(_canonical(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self.fragments = partition([n for n, _ in named], [p.numel() for _, p in named], self.streaming)
        check_schedule(inner_steps, len(self.fragments), self.streaming)
        check_h_schedule(self.h_schedule, len(self.fragments), self.streaming)
        # Compression is a property of the swarm (every peer must agree); locally, take it from the
        # argument. Error feedback (the spec's ef:BETA stage) keeps this peer's unsent residual.
        swarm_cfg = self.swarm.cfg if self.swarm is not None else self.launch.swarm if self.launch else None
        spec = parse(swarm_cfg.compression if swarm_cfg is not None else compression or "fp32")
        if swarm_cfg is not None and compression is not None and parse(compression).text != spec.text:
            raise ConfigError(f"compression={compression!r} differs from the swarm's {spec.text!r}; "
                             "set it once, in SwarmConfig(compression=...)")
        self.compression = spec.text
        self._outer_factory = outer_optimizer or default_outer(spec.ef is not None)
        self.state = GlobalState(self.local_params, self._outer_factory, self.global_device)
        self._local_pipeline = Pipeline(spec) if swarm_cfg is None else None
        # Error feedback and compression apply per fragment: one residual per fragment.
        self._error_feedback = spec.ef is not None
        self._per_fragment = [_FragmentState(f, ErrorFeedback(spec.ef, f.numel) if spec.ef is not None else None)
                              for f in self.fragments]
        self.shards = self._shard(named, spec.ef is not None)
        """An FSDP2 site's transfers (`diloco.shards`): θ, the outer state and Δ are this rank's pieces."""
        self._incoming: GlobalState | None = None  # an FSDP2 leader's downloaded or resumed state, to hand out
        self._value: Value | None = None  # an FSDP2 leader's committed Δ̄ (result frames), to hand out
        layout = f"fragments={len(self.fragments)}:{self.streaming.pattern}"
        self.schema = schema_digest(named, f"{spec.text}|{layout}")
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self._names = [n for n, _ in named]
        self.on_round = on_round
        self.join_timeout = join_timeout
        self.steps = 0
        self.attempt = 0
        self.loss: float | None = None
        self.reports: list[RoundReport] = []
        self.accounting = Accounting()
        self._pending: _Pending | None = None
        self._start: list[torch.Tensor] | None = None  # eager: where this phase started (≠ θ)
        self._last_view = 1
        self.catch_up = CatchUp(self._publish)
        """Catching up with the swarm (`diloco.catchup`): failed sources, refused chunks, failures."""
        self.stragglers: set[PeerId] = set()
        """Peers the last rounds went on without: asked, taken in when ready in time, not waited for."""
        self.rollbacks = 0
        """Syncs at which our own pseudo-gradient was not finite: rolled back to θ, nothing sent."""
        self.members: tuple[PeerId, ...] | None = None
        """Who took part in the last round we committed (or in the state we downloaded): the next round
        needs a majority of them (`SwarmConfig.majority`)."""
        self._last_slot = 0  # `steps` at our last synchronization slot (moved onto the swarm's when we catch up)
        self._hook: RemovableHandle | None = None
        self._snapshots: list[Snapshot] = []  # what we serve to peers catching up (`_serve`)
        # Held by the training thread while it changes the global state, and by the event-loop thread
        # while it serializes that state for a peer catching up: neither sees a half-applied step.
        self._state_lock = threading.Lock()
        self._digest = ""
        self._recent: collections.deque[tuple[int, str]] = collections.deque(maxlen=4)
        """The last (round, digest) states we held, published with our record (`PeerRecord.recent`)."""
        self._stop = _StopOnSignal()
        self._state_changed()
        if self.swarm is not None:
            self._enter_topology(self.swarm)

    def _enter_topology(self, swarm: Swarm) -> None:
        """Our swarm names a region (our rounds run in the region's namespace, merges on `swarm`: `diloco.regions`)
        or gossips (`diloco.gossip`); a flat swarm needs nothing."""
        if swarm.cfg.region:
            from .regions import Regions

            self.regions = Regions(self, swarm)
            self.swarm = self.regions.scope
        elif swarm.cfg.topology == "gossip":
            self.gossip = Gossip(self)
            self.catch_up.gossip = True

    @property
    def streams(self) -> bool:
        """Whether our rounds are streamed or overlapped (Streaming DiLoCo: fragments, τ, whole-step overlap)."""
        return len(self.fragments) > 1 or bool(self.streaming.overlap) or self.streaming.outer_overlap != "none"

    def topology_summary(self) -> dict[str, object]:
        """What a run's final line says of its region (`Regions.summary`) or its gossip (`Gossip.summary`)."""
        if self.regions is not None:
            return self.regions.summary()
        return self.gossip.summary() if self.gossip is not None else {}

    @property
    def residuals(self) -> list[torch.Tensor] | None:
        """The error-feedback residual of each fragment (what compression has not delivered yet), or None
        without error feedback."""
        return [k.ef.residual for k in self._per_fragment if k.ef is not None] if self._error_feedback else None

    @property
    def local_params(self) -> list[torch.Tensor]:
        """The model's trainable parameters as this process holds them: whole, or on an FSDP2 site this
        rank's piece of each (views of the parameters' storage: writes land in the model)."""
        return [local_view(p) for p in self._params]

    def _shard(self, named: Sequence[tuple[str, torch.Tensor]], error_feedback: bool) -> SiteShards | None:
        """The site's shard transfers when FSDP2 shards the model over it (None otherwise); ValueError for what
        a sharded site does not support yet, naming what to use instead."""
        if self.site is None or not any(is_sharded(p) for _, p in named):
            return None  # FSDP2 over one rank: every piece is the whole parameter
        why = []
        if error_feedback:
            why.append("error feedback (an ef:BETA compression stage): use a compression without it, e.g. e3m0")
        if self.streaming.overlap or self.streaming.outer_overlap != "none":
            why.append("overlapping communication (StreamingConfig overlap / outer_overlap): use overlap=0")
        if self.global_device.type != "cpu":
            why.append(f"global_device={self.global_device}: keep θ in host memory (the default)")
        if why:
            raise ConfigError("an FSDP2 site (sharded parameters) does not support " + "; ".join(why))
        return SiteShards.build(self.site, named)

    # ------------------------------------------------------------------ attaching to the loop

    def __enter__(self) -> DiLoCo:
        self.attach()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.detach(completed=exc_type is None)

    def attach(self) -> None:
        """Join the swarm (the launcher's, for a command started by `diloco start/join -- CMD`), catch up
        with it (download θ if others are ahead) and hook the optimizer. On a site, the leader does this
        and every other rank starts from the leader's state.

        Raises:
            SwarmError: the launcher's swarm could not be joined (none of its addresses answered).
            HandshakeError: the swarm trains another model, run or compression; the message names the field.
        A swarm that cannot be caught up with in time is not an error: training starts from our own state
        and resynchronizes at the first slot (the report says so)."""
        taken = self._agree(self._join)
        if self.site is not None and not self.site.leader:
            self._follows = bool(taken.pop("swarm"))
            self._take(taken)
        if self.shards is not None and taken.get("incoming"):
            self._adopt_incoming()
        if self.launch is not None:
            self._stop.install()
        if self._hook is None:
            self._hook = self._inner.register_step_post_hook(lambda *_: self._after_step())

    def _join(self) -> dict[str, object]:
        """The leader's side of `attach` (a lone process's, all of it); for a site, what the others take."""
        if self.launch is not None and self.swarm is None:
            if self.checkpoint_dir is not None:
                self._resume()  # the launcher restarted us: start from our last checkpoint, then catch up
            self.swarm, self._owns_swarm = self.launch.connect(), True
            self._enter_topology(self.swarm)
        if self.regions is not None:
            self.regions.attach()  # the global level first: a region of our own starts from θ_G
        if self.swarm is not None:
            self.swarm.handshake(self.schema)  # a peer with another model or codec stops here, saying so
            self.swarm.serve_state(self._serve, wait_unserved=self.shards is None)
            self._catch_up_on_join()
            if self.regions is not None:
                self.regions.after_catch_up(self)
            self._publish("training")
            if self.launch is not None and self.launch.wait_for > 1:  # `--wait-for N`: hold the first step
                whole = self.regions.swarm if self.regions is not None else self.swarm  # every region's peers count
                seen = whole.wait_for_peers(self.launch.wait_for, WAIT_TIMEOUT)
                log.info("event=peers_present count=%d wanted=%d", seen, self.launch.wait_for)
        if self.site is None:
            return {}
        return {"swarm": self.swarm is not None, **self._handed_out()}

    def _handed_out(self) -> dict[str, object]:
        """What a site leader hands its other ranks with a new state: the state itself (an FSDP2 site's comes
        next, piece by piece: `_adopt_incoming`) and the place in the schedule."""
        state: dict[str, object] = {"incoming": self._incoming is not None} if self.shards is not None else \
            {"state": self.state.to_bytes()}
        return {**state, "steps": self.steps, "last_slot": self._last_slot, "attempt": self.attempt,
                "members": self.members}

    def _take(self, taken: dict[str, object]) -> None:
        """A site rank other than the leader: start from the leader's state and place in the schedule."""
        if "state" in taken:
            fresh = GlobalState(self.state.params, self._outer_factory, self.global_device)
            fresh.load_bytes(taken["state"])  # type: ignore[arg-type]
            with self._state_lock:
                self.state = fresh
                self._state_changed()
            copy_into(self.local_params, self.state.params)
        self.steps, self._last_slot = int(taken["steps"]), int(taken["last_slot"])  # type: ignore[call-overload]
        self.attempt, self.members = int(taken["attempt"]), taken["members"]  # type: ignore[assignment,call-overload]

    def _adopt(self, fresh: GlobalState) -> None:
        """Start from the state `fresh` (downloaded, or read from a checkpoint). On an FSDP2 site the leader
        holds it whole until every rank took its pieces (`_adopt_incoming`, right after the decision)."""
        if self.shards is not None:
            self._incoming = fresh
            return
        if any(p.is_cuda for p in self.local_params):
            fresh = pinned(fresh, self._outer_factory)  # θ in host memory for a model on a GPU: pinned
        with self._state_lock:
            self.state = fresh
            self._state_changed()
        copy_into(self.local_params, self.state.params)

    def _adopt_incoming(self) -> None:
        """Every rank of an FSDP2 site: take its pieces of the state the leader holds whole (the new digest is
        hashed from the pieces: a peer that vouches for the state checks the site holds it)."""
        assert self.shards is not None
        whole, self._incoming = self._incoming, None
        local = self.shards.scatter_state(whole, self.state, self._outer_factory)
        del whole
        with self._state_lock:
            self.state = local
            self._state_changed()
        copy_into(self.local_params, self.state.params)
        self._publish("training")

    def detach(self, *, completed: bool = True) -> None:
        """Unhook the optimizer after applying the exchange still in flight, if any (`flush`). When the loop
        `completed` (no exception), a worker behind the swarm downloads its state first. A worker that
        joined the launcher's swarm also serves stragglers for a while (`linger`), writes its final
        checkpoint and metrics line, and leaves."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        try:
            self.flush()
            if completed:  # a loop that ended behind the swarm (the last round in doubt) ends on its state
                self._maybe_resync(time.monotonic())
        finally:
            self._stop.restore()
            if self.launch is not None:
                self._finish_launched(completed)

    def _finish_launched(self, completed: bool) -> None:
        if completed and self.shards is not None and self._in_swarm:
            self._take_snapshot()  # an FSDP2 site serves its final state to a peer still behind
        if completed and self.swarm is not None:
            self.linger(self.swarm.cfg.gather_timeout)  # a site still behind downloads the final state from us
        if self.checkpoint_dir is not None and self._writes_checkpoints:
            self.save_checkpoint()
        if self.launch is not None and self.launch.records_metrics:
            self.launch.metrics_writer(self.swarm.peer_id if self.swarm else "", sinks=self._talks).write(
                "final", rank=self.site.rank if self.site else 0, site_size=self.site.size if self.site else 1,
                peer=self.swarm.peer_id if self.swarm else "", round=self.state.round, digest=self.digest,
                steps=self.steps, committed_rounds=sum(r.committed for r in self.reports), restart=self.launch.restart,
                **self.topology_summary())
            close_launched()
        if self._owns_swarm and self.swarm is not None:
            if self.regions is not None:
                self.regions.close()
                self.swarm = self.regions.swarm
            self.swarm.close()
            self.swarm, self._owns_swarm = None, False

    @property
    def _talks(self) -> bool:
        """This process is the worker's voice: a lone process, or the leader of its site."""
        return self.site is None or self.site.leader

    @property
    def _writes_checkpoints(self) -> bool:
        """This process takes part in writing checkpoints: the worker's voice, or every rank of an FSDP2 site
        (each holds a piece of the state)."""
        return self._talks or self.shards is not None

    @property
    def _in_swarm(self) -> bool:
        return self.swarm is not None or self._follows

    def _agree(self, decide: Callable[[], _T]) -> _T:
        """`decide()` here, or on a site: the leader's result on every rank (see `diloco.site`)."""
        return decide() if self.site is None else self.site.agree(decide)

    def _after_step(self) -> None:
        self.accounting.begin_sync(time.monotonic())
        self.steps += 1
        if self.site is None and self._stop.signum is not None:
            raise SystemExit(128 + self._stop.signum)  # leave now: `with` applies what is in flight
        if self._pending is not None and self._pending.due <= self.steps and self.streaming.outer_overlap == "none":
            self._complete(self._pending)
        if self.schedule_position >= self._period:
            self._last_slot = self.steps
            self._check_standing()
            if self.streaming.outer_overlap == "none":
                self._launch()
            else:
                self._overlapped_slot()
        elif self.swarm is not None and self.steps % 10 == 0:
            self._publish("training", now=False)  # progress rides on the next heartbeat
        now = time.monotonic()
        self.accounting.end_sync(now)
        self.accounting.step(now, *self.bytes_on_wire())

    def report_loss(self, loss: float) -> None:
        """Optional: tell the swarm's live view our latest inner loss."""
        self.loss = float(loss)

    @property
    def inner_steps_now(self) -> int:
        """H of the next round: `inner_steps`, or what `h_schedule` says after the rounds committed (those on
        the wire count: a schedule's change applies from the slot after the round it names)."""
        return inner_steps_at(self.state.round + self.pending_rounds, self.inner_steps, self.h_schedule)

    @property
    def _period(self) -> int:
        """Inner steps between synchronization slots now (H/P)."""
        return self.inner_steps_now // len(self.fragments)

    @property
    def schedule_position(self) -> int:
        """Inner steps since our last synchronization slot (0 ≤ position < H/P); a peer that downloads
        our state takes the same position, so its slots fall on ours."""
        return self.steps - self._last_slot

    @property
    def pending_rounds(self) -> int:
        """Rounds started but not applied yet (0 or 1): `round + pending_rounds` is how many rounds this
        peer has put on the wire."""
        return 1 if self._pending is not None else 0

    def in_flight(self) -> concurrent.futures.Future[RoundOutcome] | None:
        """The exchange running in the background (None when there is none or it completed locally)."""
        return self._pending.future if self._pending is not None else None

    def usage(self) -> Usage:
        """Compute utilization, time blocked on communication, bytes and bandwidth per inner step."""
        return self.accounting.usage()

    # ------------------------------------------------------------------ the outer round

    def sync(self) -> RoundReport:
        """Synchronize the next fragment now and wait for its result (τ is not waited out).

        Raises:
            UsageError: with `outer_overlap`, whose rounds complete at the next slot (call `flush()`).
            Banned: most members of the last round banned this peer; it must stop (the CLI exits 1).
        A round that fails is not raised: the report says why (`RoundReport.reason`), and the next slot
        retries it."""
        if self.streaming.outer_overlap != "none":
            raise UsageError("with outer_overlap the rounds complete at the next synchronization slot; "
                               "call flush() to apply the exchange in flight")
        self.flush()
        report = self._launch(force_complete=True)
        assert report is not None
        return report

    def flush(self) -> RoundReport | None:
        """Apply the exchange still in flight (waiting for it if needed); None when there is none."""
        if self._pending is None:
            return None
        pending = self._pending
        report = self._complete(pending, in_step=False)
        if self.streaming.outer_overlap != "none" and report is not None:
            copy_into(self.local_params, self.state.params)  # the phase is over: continue from θ
            self._start = None
        return report

    def _check_standing(self) -> None:
        """Stop with `Banned` once most other peers banned us: nobody takes our rounds any more (the
        exchange in flight, if any, is dropped: it can only fail). A site stops here, every rank at
        the same slot, when its leader was asked to (SIGTERM / SIGINT from the launcher). An FSDP2 site that
        a peer asked for our state since its last snapshot gathers one here, for that peer to download
        while the round we are about to run waits for it."""
        if not self._in_swarm and self.site is None:
            return

        def standing() -> tuple[int | None, bool]:
            if self.swarm is not None:
                self.swarm.check_standing(self.members)
            wanted = self.shards is not None and self.swarm is not None and bool(self.swarm.unserved())
            return self._stop.signum, wanted

        try:
            signum, snapshot = self._agree(standing)
        except Banned:
            self._pending = None
            raise
        if signum is not None:
            raise SystemExit(128 + signum)
        if snapshot:
            self._take_snapshot()

    def _launch(self, force_complete: bool = False) -> RoundReport | None:
        """A synchronization slot: resync if the swarm moved on, else start the next fragment's round
        in the background (it is applied τ steps later, or at once when τ = 0)."""
        started = time.monotonic()
        if self.gossip is not None:
            return self.gossip.round(started)
        resync = self._maybe_resync(started, cached=True)
        if resync is not None:
            return resync
        frag = self.fragments[fragment_of_round(self.state.round, len(self.fragments))]
        global_frag, local_frag = self._frag(self.state.params, frag), self._frag(self.local_params, frag)
        delta: torch.Tensor | list[torch.Tensor]
        if self._lean:  # in pieces the round frees as it encodes them (SIZE.md)
            delta = pseudo_gradient_pieces(global_frag, local_frag)
            ok = all(finite(p) for p in delta)
        else:
            delta = pseudo_gradient(global_frag, local_frag)
            ok = finite(delta)
        if not (self.shards.all_true(ok) if self.shards is not None else ok):  # every rank judges its own piece
            return self._roll_back(started)
        pending = self._start_exchange(frag, delta, started)
        del delta  # the round has it; holding it here would keep a copy of the model alive through the round
        if self.streaming.overlap == 0 or force_complete:
            return self._complete(pending)
        return None

    def _overlapped_slot(self) -> None:
        """Whole-step overlap (P = 1): finish the round sent one slot ago, send this phase's Δ, and
        continue from θ (delayed) or from θ plus our fresh contribution (eager)."""
        started = time.monotonic()
        frag = self.fragments[0]
        start = self._start if self._start is not None else self.state.params
        delta = pseudo_gradient(start, self.local_params)  # before the late aggregate moves θ
        if not finite(delta):
            if self._pending is not None:
                self._complete(self._pending)
            self._roll_back(started)
            self._start = None
            return
        before = self._clone_state() if self.streaming.outer_overlap == "eager" else None
        aggregate = None
        if self._pending is not None:
            pending = self._pending
            report = self._complete(pending)
            if report is not None and report.committed and pending.outcome is not None:
                aggregate = pending.outcome.aggregate
            elif report is not None and report.resynced:
                self._start = None
                return  # the swarm's θ replaced ours: this phase's Δ is not comparable; start over
        kept = self._per_fragment[frag.index]
        carry, kept.carry = kept.carry, None
        if carry is not None:  # the round just finished failed: its Δ is still ours to deliver
            delta = delta + carry
        resync = self._maybe_resync(started, cached=True)
        if resync is not None:
            self._start = None
            return
        self._start_exchange(frag, delta, started)
        if before is None:
            copy_into(self.local_params, self.state.params)
            self._start = None
            return
        # Eager (Kale et al.): step from the state before the late aggregate arrived, with that aggregate
        # plus our own fresh contribution — exactly their per-worker update for outer SGD without
        # momentum — anchored to the shared θ every phase, so no peer drifts from the others.
        params, outer = before
        grad = delta / self._last_view if aggregate is None else aggregate.to(delta.device) + delta / self._last_view
        outer_step(outer, params, grad, self._outer_lr_scale())
        copy_into(self.local_params, params)
        self._start = params

    def _outer_lr_scale(self) -> float:
        """The outer lr's factor for the step that commits the next global round."""
        return self.outer_lr_schedule(self.state.round + 1)

    def _roll_back(self, started: float) -> RoundReport:
        """Our pseudo-gradient holds NaN or Inf (a diverged inner step): contribute nothing this round,
        restart from the global θ, and drop the inner optimizer's per-parameter state (its moments
        hold the same NaN). The swarm goes on without us; we catch up at the next slot if it moved."""
        self.rollbacks += 1
        log.warning("event=non_finite_update round=%d reason=our pseudo-gradient holds NaN or Inf: rolled back to "
                    "the global state, sent nothing (lower the inner lr or clip gradients if this repeats)",
                    self.state.round)
        copy_into(self.local_params, self.state.params)
        self._inner.state.clear()
        report = RoundReport(self.state.round, False, "non-finite pseudo-gradient: rolled back, sent nothing", 1,
                             0, 0, time.monotonic() - started, self.steps)
        return self._report(report)

    @property
    def _lean(self) -> bool:
        """Whether our rounds take Δ in pieces and keep Δ̄ as their frames (`PiecewiseHandoff`): a lone peer in a
        swarm (a site's leader hands the whole outcome to its ranks; error feedback and overlap read Δ and Δ̄
        whole)."""
        return self.swarm is not None and self.site is None and not self._error_feedback and \
            self.streaming.outer_overlap == "none"

    def _start_exchange(self, frag: Fragment, delta: torch.Tensor | list[torch.Tensor], started: float) -> _Pending:
        if isinstance(delta, list):  # a lean round's Δ in pieces: only the round reads it
            future = self._exchange(frag, delta)
            self._pending = _Pending(frag, None, self.steps + self.streaming.overlap, started, future=future,
                                     key=RoundKey(self.state.round, self.attempt))
            return self._pending
        ef = self._per_fragment[frag.index].ef
        acc = ef.accumulate(delta) if ef is not None else delta
        due = self.steps + (self.streaming.overlap if self.streaming.outer_overlap == "none" else self.inner_steps_now)
        if self._follows:  # the leader sends; we apply the outcome it tells us (`_complete`)
            self._pending = _Pending(frag, acc, due, started, key=RoundKey(self.state.round, self.attempt))
            return self._pending
        if self.swarm is None:
            assert self._local_pipeline is not None
            payload = self._local_pipeline.encode(acc)
            sent = self._local_pipeline.decode(payload, acc.numel()).dense(acc.numel())
            outcome = RoundOutcome(RoundKey(self.state.round), True, "local", (), sent, [()], sent,
                                   payload_bytes=len(payload))
            self._pending = _Pending(frag, acc, due, started, outcome=outcome)
            return self._pending
        source = ShardedHandoff(self.shards, acc, frag.params) if self.shards is not None else None
        future = self._exchange(frag, source or acc)
        keep = self._error_feedback or self.streaming.outer_overlap != "none"
        self._pending = _Pending(frag, acc if keep else None, due, started, future=future, source=source,
                                 key=RoundKey(self.state.round, self.attempt))
        return self._pending

    def _exchange(self, frag: Fragment, delta: torch.Tensor | list[torch.Tensor] | Handoff,
                  ) -> concurrent.futures.Future[RoundOutcome]:
        assert self.swarm is not None
        return self.swarm.exchange_async(self.state.round, self.attempt, self.digest, delta, fragment=frag.index,
                                         previous=self.members, skip=self.stragglers)

    def _complete(self, pending: _Pending, in_step: bool = True) -> RoundReport | None:
        """Wait for the exchange in flight and apply it; waiting inside an inner step (not in `flush`)
        is counted as time the training loop was blocked."""
        self._pending = None
        outcome = pending.outcome
        if outcome is None:
            if self.shards is not None and self._follows:  # the leader's round reads our piece of Δ meanwhile
                assert pending.acc is not None
                self.shards.serve(pending.acc, pending.fragment.params)
            waited = time.monotonic()
            outcome, pending.blocked = self._agree(lambda: self._outcome_of(pending, in_step))
            if pending.blocked:
                self.accounting.blocked(time.monotonic() - waited)
            pending.outcome = outcome
        report = self._finish(pending, outcome)
        if outcome.committed and self.regions is not None and self.members:
            self.regions.after_commit(self, self.members)
        if not outcome.committed and self._in_swarm:
            # Maybe the others committed without us: catch up now, not H steps later.
            resync = self._maybe_resync(pending.started)
            if resync is not None:
                return resync
        return report

    def _outcome_of(self, pending: _Pending, in_step: bool) -> tuple[RoundOutcome, bool]:
        """The leader's side of `_complete`: the exchange's outcome (waiting for it), and whether the
        training loop had to wait."""
        assert pending.future is not None and self.swarm is not None
        blocked = not pending.future.done() and in_step
        try:
            outcome = self.swarm.finish_exchange(pending.future, pending.key)
        finally:
            if pending.source is not None:
                pending.source.close()  # the ranks serving its spans go on
        if self.shards is not None:  # each rank gets its pieces of Δ̄ when it applies it (`_finish`), span by span
            self._value, outcome.value = outcome.value, None
        if outcome.committed and not self.swarm.may_apply(outcome.key.round):
            # killed in-process before the outer step: it never happens
            outcome = RoundOutcome(outcome.key, False, "crashed", outcome.view)
        return outcome, blocked

    def _maybe_resync(self, started: float, cached: bool = False, merge: bool = False) -> RoundReport | None:
        """Download the swarm's state if it moved past us (or ours is in the minority); with `cached`, judge
        from the records the last heartbeat read (no network I/O on the training thread)."""
        if not self._in_swarm or self.gossip is not None:  # a gossip peer's state is its own: nothing to take
            return None
        sent0, recv0 = self.bytes_on_wire()
        decided = self._agree(lambda: self._resync_if_behind(cached))
        if decided is None:
            return None
        ok, why, taken = decided
        if ok and not self._talks:
            self._take(taken)
        if ok and self.shards is not None:
            self._adopt_incoming()
        sent, recv = self.bytes_on_wire()
        report = RoundReport(self.state.round, False, f"resynced: {why}" if ok else f"resync failed: {why}", 1,
                             sent - sent0, recv - recv0, time.monotonic() - started, self.steps, resynced=ok,
                             merge=merge and ok)
        return self._report(report)

    def _resync_if_behind(self, cached: bool) -> tuple[bool, str, dict[str, object]] | None:
        """The leader's side of `_maybe_resync`: None when our state is current, else whether the download
        worked, why it was needed, and (on a site) the state the other ranks take."""
        assert self.swarm is not None
        source, why, _ = self.catch_up.source(self.swarm, self.state.round, self.digest, cached=cached)
        if source is None:
            return None
        ok = self._resync(source, why)
        return ok, why, self._handed_out() if ok and self.site is not None else {}

    def _finish(self, pending: _Pending, outcome: RoundOutcome) -> RoundReport:
        frag = pending.fragment
        kept = self._per_fragment[frag.index]
        overlapped = self.streaming.outer_overlap != "none"
        if outcome.committed:
            aggregate = self._my_aggregate(frag, outcome)
            if kept.ef is not None:
                assert outcome.sent is not None and pending.acc is not None
                kept.ef.commit(pending.acc, outcome.sent)
            global_frag = self._frag(self.state.params, frag)
            if self.streaming.outer_overlap == "eager":  # the eager step reads the aggregate again (`outer_step`)
                aggregate = aggregate.clone()
            with self._state_lock:
                outer_step(self.state.outer, global_frag, aggregate, self._outer_lr_scale())
                self.state.round += 1
                self._state_changed()
            del aggregate
            self.attempt = 0
            self._last_view = max(1, len(outcome.view))
            if outcome.view:
                # members the round went on without are not waited for until they make it into a view again
                self.stragglers = stragglers(self.stragglers, self.members or (), outcome.view,
                                             self.swarm.records(cached=True) if self.swarm is not None else ())
                self.members = tuple(outcome.view)
            if not overlapped:
                mix_into(self._frag(self.local_params, frag), global_frag, self.streaming.alpha)
            log.info("event=round_committed round=%d fragment=%d peers=%d", self.state.round, frag.index,
                     len(outcome.view))
            self._checkpoint_if_due()
        else:
            self.attempt = outcome.key.attempt + 1
            if overlapped:  # the local copy no longer carries this Δ: deliver it with the next round
                assert pending.acc is not None
                if kept.ef is not None:
                    kept.ef.commit(pending.acc, torch.zeros_like(pending.acc))
                else:
                    kept.carry = pending.acc
            log.warning("event=round_failed round=%s fragment=%d reason=%s", outcome.key, frag.index, outcome.reason)
        self.accounting.round_moved(outcome.bytes_sent + outcome.bytes_received, outcome.seconds)
        report = RoundReport(self.state.round, outcome.committed, outcome.reason, max(1, len(outcome.view)),
                             outcome.bytes_sent, outcome.bytes_received, time.monotonic() - pending.started,
                             self.steps, payload_bytes=outcome.payload_bytes, numel=frag.numel,
                             fragment=frag.index, blocked=pending.blocked, phases=outcome.phases)
        return self._report(report)

    def _my_aggregate(self, frag: Fragment, outcome: RoundOutcome) -> torch.Tensor:
        """The committed Δ̄ of `frag` as this process applies it: whole, or on an FSDP2 site in a swarm this
        rank's pieces, handed out by the leader piece by piece."""
        if self.shards is None or not self._in_swarm:
            if outcome.value is not None:  # a lean round (`_lean`)
                return self._decode_value(outcome)
            assert outcome.aggregate is not None
            return outcome.aggregate
        value, self._value = self._value, None
        spans = self.swarm.value_spans(value) if value is not None and self.swarm is not None else None
        mine = torch.empty(self.shards.map.local_numel(frag.params), dtype=torch.float32)
        self.shards.scatter_spans(spans, frag.params, mine)
        return mine

    def _decode_value(self, outcome: RoundOutcome) -> torch.Tensor:
        """A lean round's Δ̄, decoded span by span from its result frames, each frame let go once read: the
        frames and their decoded copy never both exist whole."""
        assert outcome.value is not None and self.swarm is not None
        value, outcome.value = outcome.value, None
        aggregate = torch.empty(value.numel, dtype=torch.float32)
        for i, (lo, hi, span) in enumerate(self.swarm.value_spans(value)):
            aggregate[lo:hi] = span
            value.frames[i] = b""
        return aggregate

    def _take_snapshot(self) -> None:
        """Every rank of an FSDP2 site: the current state, whole, as a snapshot the leader serves."""
        assert self.shards is not None
        whole = self.shards.gather_state(self.state, self._outer_factory)
        if whole is None:
            return
        snap = Snapshot(whole.round, self._manifest, [t for _, t in whole.layout()[0]], self._snapshot_info())
        with self._state_lock:
            self._keep_snapshot(snap)
        if self.swarm is not None:
            self.swarm.wait_for_unserved()  # our next round waits for the peers that asked, while they download

    def _report(self, report: RoundReport) -> RoundReport:
        self.reports.append(report)
        self._publish("training")
        if self.launch is not None and self.launch.records_metrics and self._talks:
            self.launch.metrics_writer(self.swarm.peer_id if self.swarm else "").write(
                "round", peer=self.swarm.peer_id if self.swarm else "", loss=self.loss, digest=self.digest,
                restart=self.launch.restart, **report.as_dict())
        if self.on_round is not None:
            self.on_round(report)
        return report

    def _frag(self, tensors: Sequence[torch.Tensor], frag: Fragment) -> list[torch.Tensor]:
        return [tensors[i] for i in frag.params]

    def _clone_state(self) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        """A private copy of θ and the outer optimizer (for the eager step, which must not touch θ)."""
        params = [torch.empty_like(p, pin_memory=is_pinned(p)).copy_(p) for p in self.state.params]
        outer = self._outer_factory(params)
        outer.load_state_dict(copy.deepcopy(self.state.outer.state_dict()))
        return params, outer

    # ------------------------------------------------------------------ catching up

    def _catch_up_on_join(self) -> None:
        """On joining a running swarm, start from its θ rather than from our own initialization."""
        assert self.swarm is not None
        self.catch_up.on_join(self.swarm, lambda: (self.state.round, self.digest), self._resync, self.join_timeout)

    def _resync(self, source: PeerRecord, why: str) -> bool:
        """Download the state `source` advertises (`diloco.catchup`: vouched for, verified, from every peer
        that holds it) and adopt it: θ, the outer state, the round, the source's place in the schedule and
        the members of its last round."""
        assert self.swarm is not None
        into = self.shards.receiver if self.shards is not None else self.state.receiver  # the whole state
        got = self.catch_up.download(self.swarm, source, why, into, self._outer_factory)
        if got is None:
            return False
        fresh, info = got
        self._adopt(fresh)
        self.attempt = 0
        for kept in self._per_fragment:
            kept.carry = None
        self.stragglers = set()
        position, members = info.get("position"), info.get("members")
        if isinstance(position, int) and not isinstance(position, bool):
            self.place_in_schedule(position)  # take the source's place: our next slot is its next slot
        if isinstance(members, str) and members:
            self.members = tuple(PeerId(m) for m in members.split(",")[:4096] if m)
        if self.regions is not None:
            self.regions.take_info(info)
        self.swarm.moved_to(fresh.round)
        if self.shards is None:
            self._publish("training")  # an FSDP2 site publishes once its ranks took their pieces
        return True

    def linger(self, timeout: float) -> int:
        """At the end of a run, before leaving: keep serving our state while a peer that is still in the
        swarm holds an older round (it was in doubt, frozen, or slow when we finished), so that it can
        download the final state instead of ending on an older one. Returns after `timeout` seconds at
        most, with the number of peers still behind (0 when everyone caught up)."""
        if self.swarm is None or self.gossip is not None:  # nobody downloads a gossip peer's final state
            return 0
        started = time.monotonic()
        deadline, quiet = started + timeout, 3 * self.swarm.cfg.heartbeat_interval + 2
        first_beat: dict[PeerId, float] = {}
        while True:
            now = time.monotonic()
            behind = []
            for r in self.swarm.records():
                if r.peer == self.swarm.peer_id or r.status == "left" or r.round >= self.state.round:
                    continue
                # a peer whose heartbeat has not moved for a while is dead or frozen: not worth waiting for
                if first_beat.setdefault(r.peer, r.beat) != r.beat or now - started < quiet:
                    behind.append(r.peer)
            if not behind or now >= deadline:
                if behind:
                    log.warning("event=left_peers_behind round=%d peers=%s reason=they did not catch up within "
                                "%.0fs", self.state.round, ",".join(behind), timeout)
                return len(behind)
            log.info("event=linger round=%d behind=%s", self.state.round, ",".join(behind))
            time.sleep(0.25)

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_if_due(self) -> None:
        """After a round moved our state: write a checkpoint every `checkpoint_every` rounds (when we write them)."""
        if self.checkpoint_dir is not None and self.checkpoint_every and self._writes_checkpoints and \
                self.state.round % self.checkpoint_every == 0:
            self.save_checkpoint()

    def save_checkpoint(self, root: str | os.PathLike[str] | None = None, keep: int = 3) -> Path | None:
        """Write the global state, error-feedback residuals and schedule position atomically (format:
        docs/CHECKPOINTS.md). A failure (disk full, …) is logged and training goes on; returns the path."""
        target = Path(root) if root is not None else self.checkpoint_dir
        if target is None:
            raise ConfigError("no checkpoint directory: pass root or DiLoCo(checkpoint_dir=...)")
        state: GlobalState | None = self.state
        if self.shards is not None:  # every rank sends its pieces; the leader writes the whole state
            state = self.shards.gather_state(self.state, self._outer_factory)
        if state is None or not self._talks:  # a site writes one checkpoint, its leader's
            return None
        meta = {"schema": self.schema, "steps": self.steps, "position": self.schedule_position,
                "members": ",".join(self.members or ()), "compression": self.compression}
        try:
            with self._state_lock:
                path = persist.write(target, self._names, state,
                                     self.residuals, meta, keep)
        except CheckpointError as e:
            log.warning("event=checkpoint_failed reason=%s", e)
            return None
        log.info("event=checkpoint_saved path=%s round=%d", path, self.state.round)
        return path

    def resume(self, root: str | os.PathLike[str] | None = None) -> bool:
        """Load the newest verified checkpoint (falling back past damaged ones); False when there is none.
        Call before training; if the swarm is ahead, catching up downloads its newer state anyway. On an
        FSDP2 site every rank calls it: the leader reads the checkpoint and hands out the pieces."""
        if self.shards is None:
            return self._resume(root)
        taken = self._agree(lambda: self._handed_out() if self._resume(root) else None)
        if taken is None:
            return False
        if not self._talks:
            self._take(taken)
        self._adopt_incoming()
        return True

    def _resume(self, root: str | os.PathLike[str] | None = None) -> bool:
        target = Path(root) if root is not None else self.checkpoint_dir
        if target is None:
            raise ConfigError("no checkpoint directory: pass root or DiLoCo(checkpoint_dir=...)")
        sizes = [f.numel for f in self.fragments] if self._error_feedback else None
        like = self.state.params if self.shards is None else [torch.empty(s) for s in self.shards.map.shapes]
        got = persist.read(target, like, self._outer_factory, sizes, self.schema)
        if got is None:
            return False
        state, residuals, loaded = got
        self._adopt(state)
        if residuals is not None:
            for kept, r in zip(self._per_fragment, residuals):
                if kept.ef is not None:
                    kept.ef.residual = r
        steps = loaded.meta.get("steps")
        if isinstance(steps, int) and steps >= 0:
            position = loaded.meta.get("position")
            self.steps = steps
            self._last_slot = steps - (position if isinstance(position, int) and not isinstance(position, bool)
                                       else steps) % self._period
        # The saved membership is not restored: a restarted peer has a new peer id, so it could never be a
        # majority of its old round. A running swarm's state (and members) arrive with the catch-up.
        self.members = None
        self.attempt = 0
        if self.swarm is not None:
            self.swarm.moved_to(state.round)
        log.info("event=resumed path=%s round=%d skipped=%d", loaded.path, state.round, len(loaded.skipped))
        return True

    # ------------------------------------------------------------------ helpers

    @property
    def digest(self) -> str:
        """Short SHA-256 of the global state (θ, outer optimizer state, round)."""
        return self._digest

    def _state_changed(self) -> None:
        """The global state changed (call with `_state_lock` held): new manifest and digest. A snapshot we
        serve stays while a download uses it, and goes once idle."""
        self._manifest = self.shards.manifest(self.state) if self.shards is not None else self.state.manifest()
        self._digest = self._manifest.digest
        now = time.monotonic()
        self._snapshots = [snap for snap in self._snapshots if now - snap.used <= SNAPSHOT_IDLE]
        while self._recent and self._recent[-1][0] >= self.state.round:
            self._recent.pop()  # one state per round: a state replaced at its round (resync) is not ours
        self._recent.append((self.state.round, self._digest))

    @property
    def round(self) -> int:
        return self.state.round

    @contextmanager
    def global_weights(self) -> Iterator[None]:
        """Temporarily load the global (outer) parameters into the model, e.g. for evaluation."""
        saved = [p.detach().clone() for p in self.local_params]
        copy_into(self.local_params, self.state.params)
        try:
            yield
        finally:
            copy_into(self.local_params, saved)

    def _serve(self, digest: str) -> Snapshot | None:
        """The snapshot of state `digest` for peers catching up (`diloco.statesync`), taken from our current
        state when one first asks for it; None when we do not hold that state. At most `SNAPSHOTS` copies
        are held (the least recently used goes first). Runs on the event-loop thread."""
        with self._state_lock:
            for snap in self._snapshots:
                if snap.digest == digest:
                    return snap
            if self.shards is not None or digest != self._digest:  # an FSDP2 leader gathers one at its next slot
                return None
            return self._keep_snapshot(Snapshot.take(self.state, self._manifest, self._snapshot_info()))

    def _snapshot_info(self) -> dict[str, object]:
        """What a peer downloading our state learns with it: our place in the schedule, and the last members."""
        info: dict[str, object] = {"position": self.schedule_position, "members": ",".join(self.members or ())}
        return info if self.regions is None else {**info, **self.regions.snapshot_info()}

    def _keep_snapshot(self, snap: Snapshot) -> Snapshot:
        """Serve `snap` from now on (call with `_state_lock` held): at most `SNAPSHOTS` are kept, the least
        recently used goes first."""
        self._snapshots = [*sorted(self._snapshots, key=lambda s: s.used)[-(SNAPSHOTS - 1):], snap]
        return snap

    def _publish(self, status: str, now: bool = True) -> None:
        if status == "training" and self.standby:
            status = "standby"
        if self.swarm is not None:
            sent, received = self.bytes_on_wire()
            usage = self.accounting.usage()
            self.swarm.update(now=now, status=status, round=self.state.round, attempt=self.attempt,
                              digest=self.digest, step=self.steps, loss=self.loss, recent=tuple(self._recent),
                              bytes_sent=sent, bytes_received=received,
                              utilization=round(usage.utilization, 4) if usage.steps else None)

    # ------------------------------------------------------------------ what the global level of a region uses

    def set_standby(self, standby: bool) -> None:
        """Publish `standby` instead of `training` from now on, or stop: our record at once if that changes it,
        else with the next heartbeat (or our goodbye: a peer that finished and left shows it took steps)."""
        changed, self.standby = standby != self.standby, standby
        self._publish("training", now=changed)

    def mark_slot(self) -> None:
        """A synchronization slot is now (the global level's merge, driven by `diloco.regions`)."""
        self._last_slot = self.steps

    def place_in_schedule(self, position: int) -> None:
        """Be `position` inner steps past our last slot (as a peer we downloaded state from is)."""
        self._last_slot = self.steps - position % self._period

    def resync_now(self, merge: bool = False) -> RoundReport | None:
        """Download the swarm's state now if it moved past ours (a fresh read of the records); `merge`: the
        download takes a merge of the regions (the report says so)."""
        return self._maybe_resync(time.monotonic(), merge=merge)

    def report_merge(self, merged: RoundReport) -> RoundReport:
        """Report a merge of the regions as one of our rounds (metrics, `on_round`), at the region round it made."""
        return self._report(replace(merged, round=self.state.round, step=self.steps, merge=True))

    def fail_attempt(self) -> None:
        """Count a failed attempt at our current round and say so in our record (a region's representative whose
        merge failed: its members stop waiting for it)."""
        self.attempt += 1
        self._publish("training")

    def take_params(self, params: Sequence[torch.Tensor], *, bump: bool) -> None:
        """Make `params` our global θ and our local model (the outer optimizer's state stays); `bump`: as a new
        round (a region's merge: members that missed it see they are behind)."""
        with self._state_lock:
            copy_into(self.state.params, params)
            if bump:
                self.state.round += 1
            self._state_changed()
        copy_into(self.local_params, self.state.params)
        if bump and self.swarm is not None:
            self.swarm.moved_to(self.state.round)  # our rounds' frames for the round we skipped are stale
        self._publish("training")

    # ------------------------------------------------------------------ what a gossip round uses

    def step_to(self, gradient: torch.Tensor, rnd: int) -> None:
        """Step θ with `gradient` (flat fp32) as the outer step that makes round `rnd`, and continue the local model
        from the new θ (a gossip round: our own state's step, `diloco.gossip`)."""
        with self._state_lock:
            outer_step(self.state.outer, self.state.params, gradient, self.outer_lr_schedule(rnd))
            self.state.round = rnd
            self._state_changed()
        copy_into(self.local_params, self.state.params)

    def close_round(self, report: RoundReport, moved_seconds: float) -> RoundReport:
        """Account and report a round that `step_to` applied (`moved_seconds`: its time on the network), after the
        checkpoint it makes due, if any."""
        self._checkpoint_if_due()
        self.accounting.round_moved(report.bytes_sent + report.bytes_received, moved_seconds)
        return self._report(report)

    def bytes_on_wire(self) -> tuple[int, int]:
        """(sent, received) bytes of this peer so far, every message included."""
        return self.swarm.bytes_on_wire() if self.swarm is not None else (0, 0)
