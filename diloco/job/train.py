"""The default job: the bundled byte-level GPT on the bundled corpus (Python's standard library
source), trained by one DiLoCo worker. `diloco start`, `diloco join` and `diloco demo` run it, so a
swarm can be tried with the CLI alone.

Every peer builds the model from the same seed (so a swarm starts from one θ even before anyone
downloads state), draws batches from its own data shard, takes `inner_steps` AdamW steps per
round, and stops when the swarm's global round reaches `rounds`. The held-out loss is always
measured on the global (outer) parameters.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import torch

from diloco.compression.pipeline import parse as parse_compression

from ..checkpoint import CheckpointError, require_safetensors
from ..config import ConfigError
from ..environment import SHARDS, data_shard
from ..fragments import FragmentError, HSchedule, StreamingConfig, check_rounds, inner_steps_at
from ..metrics import MetricsWriter, write_failures, write_status
from ..outer import OuterFactory, default_outer
from ..swarm import Swarm, defences
from ..lifecycle import end_run, final_fields
from ..wrapper import DiLoCo, RoundReport
from .corpus import BatchSampler, Corpus, CorpusConfig, evaluate, heldout_batches
from .model import GPTConfig, build_model

log = logging.getLogger(__name__)


SCHEDULES = ("constant", "cosine")
ADAMW_BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0
"""The inner AdamW's settings and the gradient clipping, for DiLoCo workers and data-parallel alike."""


def inner_lr(step: int, *, lr: float, warmup: int, total: int, schedule: str = "constant") -> float:
    """The inner learning rate of 0-based inner step `step` of `total`: a linear warmup over `warmup` steps,
    then `lr` (constant) or a cosine from `lr` down to lr/10 at the last step (cosine). The same function
    drives data-parallel training in `diloco bench convergence`, so both follow one schedule."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant" or total <= warmup + 1:
        return lr
    progress = min(1.0, (step - warmup) / (total - warmup - 1))
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


STOPPED = 10.0
"""A step whose wall time exceeds this multiple of its CPU time was stopped (SIGSTOP, a swap storm), not computing:
`throttle_seconds` counts it as that multiple. Sharing the cores slows a step by a small factor (three workers and
their daemons on two cores: 2-3×), and the throttle keeps that: a worker F times as slow stays F times as slow."""


def throttle_seconds(slowdown: float, wall: float, cpu: float | None) -> float:
    """How long `--slowdown` sleeps after a step's forward and backward took `wall` seconds: (F − 1) × their time,
    which on a CPU (`cpu`: the process's CPU time in them) is at most `STOPPED` × the CPU time: a process stopped
    meanwhile (SIGSTOP 4 s inside a step slept 28 s more at F = 8) did no work a slower machine would take longer
    for."""
    return (slowdown - 1) * (wall if cpu is None else max(0.0, min(wall, STOPPED * cpu)))


def _outer_dp_scale(rnd: int, *, first: int, warmup: int, total: int, schedule: str) -> float:
    """Data-parallel's lr factor for the round that commits step first+rnd-1 (`inner_lr` at lr 1)."""
    return inner_lr(first + rnd - 1, lr=1.0, warmup=warmup, total=total, schedule=schedule)


class _ClippedAdamW(torch.optim.AdamW):
    """AdamW that first clips its parameters' gradients to a total norm of `max_norm`: data-parallel's
    optimizer step on the mean gradient, as the inner step clips each worker's own."""

    def __init__(self, params: list[torch.Tensor], max_norm: float, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.max_norm = max_norm

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        scale = self.max_norm / (float(norm) + 1e-6)  # clip_grad_norm_'s rule, into new tensors: the
        if scale < 1.0:                                 # gradients are views of the round's aggregate
            for p in params:
                p.grad = p.grad * scale
        return super().step(closure)


def data_parallel_outer(lr: float, max_norm: float) -> OuterFactory:
    """The outer optimizer of data-parallel training through the swarm: the inner AdamW's settings, stepping
    the global model with the swarm's mean gradient, clipped first."""
    return lambda params: _ClippedAdamW(params, max_norm, lr=lr, betas=ADAMW_BETAS, weight_decay=WEIGHT_DECAY)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    rounds: int = 10
    """Stop when the global round reaches this many committed rounds."""
    inner_steps: int = 50
    """H: inner AdamW steps per round."""
    round_seconds: float | None = None
    """Rounds by time instead of H: train inner steps for this many seconds a round, however many that is on this
    machine; each worker's pseudo-gradient counts by the steps it covers (`DiLoCo(round_seconds=...)`)."""
    adaptive: bool = False
    """Adaptive rounds by time: a round lasts `inner_steps` steps of the swarm's fastest worker, however many the
    others manage meanwhile (`DiLoCo(adaptive=True)`)."""
    slowdown: float = 1.0
    """Benchmarks: every inner step takes this many times as long (it sleeps (F − 1) × its forward and backward
    time), playing a slower machine (`diloco bench hetero`). On a CPU that time is at most 10× their CPU time
    (`throttle_seconds`): a process stopped (SIGSTOP) meanwhile does not sleep for it too (a 4 s SIGSTOP in a step
    slept 28 s more at F = 8)."""
    h_schedule: HSchedule = ()
    """Change H during the run: (after this many outer steps, H from then on) pairs, e.g. ((80, 10),): H=10
    for the outer steps after the 80th (`diloco.fragments.parse_h_schedule` reads '80:10')."""
    batch_size: int = 8
    """Sequences per inner step."""
    lr: float = 2e-3
    """Inner AdamW learning rate (after a linear warmup of `warmup` steps)."""
    warmup: int = 20
    """Inner steps of linear learning-rate warmup."""
    schedule: str = "constant"
    """Inner learning rate after the warmup: constant, or cosine (down to a tenth of lr at the run's last
    inner step, `total_steps`; `inner_lr`)."""
    outer_lr: float | None = None
    """Outer SGD learning rate (default: 0.7, or 1.0 when the compression has error feedback)."""
    outer_momentum: float | None = None
    """Outer SGD Nesterov momentum (default: 0.9, or 0 when the compression has error feedback)."""
    outer_warmup: int = 0
    """Rounds of linear outer-lr warmup (0: none; `DiLoCo(outer_warmup=...)`)."""
    data_parallel: bool = False
    """Train data-parallel through the swarm instead of DiLoCo: every step's gradients are averaged by a round
    (H=1), and AdamW steps the global model with them (`data_parallel_outer`). The baseline of `diloco bench
    race`; the same transport, codec and fault handling as DiLoCo's rounds."""
    seed: int = 0
    """Model initialization seed; the same on every peer."""
    init_from: str | None = None
    """Start from these model weights instead of the seed's initialization: a safetensors file of the model
    (`save_weights`); every peer must be given the same one. A warm start, e.g. from data-parallel training."""
    first_step: int = 0
    """Inner steps this run continues from (with init_from): the lr schedule goes on from there, and every peer
    skips the batches of its shard that those steps took."""
    shard: int | None = None
    """Data shard of this peer (default: derived from its peer id); a command under the launcher reads it as
    `DiLoCo.data_shard`."""
    d_model: int = 192
    """Width of the GPT."""
    n_layer: int = 4
    """Transformer blocks of the GPT."""
    context: int = 128
    """Bytes of context."""
    corpus_bytes: int = 8 << 20
    """Bytes of the standard library taken as the corpus."""
    eval_batches: int = 8
    """Held-out batches for the final evaluation."""
    eval_every: int = 0
    """Also evaluate every this many rounds (0: only at the end)."""
    threads: int = 1
    """torch CPU threads for this peer."""
    device: str = "auto"
    """Where the model trains: auto (the first CUDA GPU when torch has one, else the CPU), cpu, cuda or cuda:N.
    The global state stays in host memory either way (`DiLoCo(global_device=...)`)."""
    wait_for: int = 1
    """Peers (self included) to wait for before the first inner step (for at most `wait_timeout`, 120 s)."""
    wait_timeout: float = 120.0
    """Seconds to wait for them; then train with whoever is there."""
    streaming: StreamingConfig = StreamingConfig(fragments=1)
    """Streaming DiLoCo: the fragments the model is synchronized in (1: plain DiLoCo; `rounds` still counts
    outer steps, each of which synchronizes every fragment once), overlap τ, mixing α, whole-step overlap."""
    checkpoint_dir: str | None = None
    """Write checkpoints here (atomic, verified; the newest 3 are kept), and a final one on leaving."""
    checkpoint_every: int = 0
    """Also checkpoint every this many committed rounds (0: only the final one)."""
    resume: bool = False
    """Start from the newest verified checkpoint in checkpoint_dir (if the swarm is ahead, catch up)."""
    save_final: str | None = None
    """Write the final global model here at the end (a safetensors state dict: `DiLoCo.save_final`)."""

    def __post_init__(self) -> None:
        for name in ("rounds", "inner_steps", "batch_size", "d_model", "n_layer", "context", "eval_batches", "threads",
                     "wait_for"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr < 1:
            raise ConfigError(f"lr must be in (0, 1), got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.outer_lr is not None and self.outer_lr <= 0:
            raise ConfigError(f"outer_lr must be > 0, got {self.outer_lr}")
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.outer_warmup < 0:
            raise ConfigError(f"outer_warmup must be >= 0 rounds, got {self.outer_warmup}")
        if self.data_parallel:
            if self.inner_steps != 1:
                raise ConfigError(f"data-parallel averages gradients every step: set --inner-steps 1 (rounds then "
                                  f"count steps), got {self.inner_steps}")
            if self.outer_lr is not None or self.outer_momentum is not None or self.outer_warmup:
                raise ConfigError("data-parallel steps AdamW with --lr, --warmup and --schedule: leave --outer-lr, "
                                  "--outer-momentum and --outer-warmup unset")
            if (self.streaming.fragments or 1) != 1 or self.streaming.overlap or self.h_schedule:
                raise ConfigError("data-parallel synchronizes the whole gradient every step: leave --fragments, "
                                  "--overlap and --h-schedule unset")
        if not 1 <= self.slowdown < float("inf"):
            raise ConfigError(f"--slowdown must be a factor >= 1 (1: full speed), got {self.slowdown}")
        if (self.round_seconds is not None or self.adaptive) and self.data_parallel:
            raise ConfigError("--round-seconds or --adaptive and --data-parallel do not go together: data-parallel "
                              "rounds are steps")
        if self.d_model % 4:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by the 4 attention heads")
        if self.streaming.fragments is None:
            raise ConfigError("the bundled job counts rounds in fragments: give StreamingConfig(fragments=P), "
                              "not blocks_per_fragment")
        try:
            check_rounds(self.inner_steps, self.fragments, self.streaming, self.h_schedule, self.round_seconds,
                         self.adaptive)
        except FragmentError as e:
            raise ConfigError(str(e)) from e
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume needs checkpoint_dir (--checkpoint-dir DIR)")
        for flag, given in (("--checkpoint-dir", self.checkpoint_dir), ("--save-final", self.save_final)):
            if given:
                try:
                    require_safetensors()
                except CheckpointError as e:
                    raise ConfigError(f"{flag}: {e}") from None
        if self.first_step < 0:
            raise ConfigError(f"first_step must be >= 0, got {self.first_step}")
        if self.init_from is not None:
            if not os.path.isfile(self.init_from):
                raise ConfigError(f"init_from: {self.init_from} is not a file; give the safetensors file of the "
                                  "model's weights to start from")
            try:
                require_safetensors()
            except CheckpointError as e:
                raise ConfigError(f"--init-from: {e}") from None
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        training_device(self.device)  # raises ConfigError for a device this machine does not have
        if self.fragments > self.n_layer:
            raise ConfigError(f"fragments ({self.fragments}) cannot exceed the model's {self.n_layer} blocks (--layers)")

    @property
    def fragments(self) -> int:
        """P: the fragments the model is synchronized in."""
        return self.streaming.fragments or 1

    @property
    def round_schedule(self) -> HSchedule:
        """`h_schedule` in global rounds, as the wrapper counts them (P rounds per outer step)."""
        return tuple((after * self.fragments, h) for after, h in self.h_schedule)

    @property
    def total_steps(self) -> int:
        """Inner steps per worker in the whole run (`rounds` outer steps at the H each one has)."""
        return sum(inner_steps_at(k, self.inner_steps, self.h_schedule) for k in range(self.rounds))


def training_device(spec: str, flag: str = "--device") -> torch.device:
    """The device `JobConfig.device` names on this machine. Raises ConfigError (naming `flag`) for a malformed
    name or a device this machine's torch cannot use, saying what to give instead."""
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"{flag} {spec!r} is not a device: give auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"{flag} {spec!r}: the bundled job trains on cpu or cuda; give auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError(f"{flag} {spec!r}: this torch sees no CUDA GPU (torch.cuda.is_available() is False: "
                          f"a CPU-only build or no driver); use --device cpu")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ConfigError(f"{flag} {spec!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                          f"numbered from 0")
    return torch.device("cuda", index)


def save_weights(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """The model's weights as a safetensors file (`JobConfig.init_from` reads it; tied weights once)."""
    from safetensors.torch import save_model

    save_model(model, str(path))


def load_weights(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """Load `save_weights`'s file into `model`; raises ConfigError if it is not this model's."""
    from safetensors.torch import load_model

    try:
        load_model(model, str(path), strict=True)
    except Exception as e:  # noqa: BLE001 - a file of another model, or not a safetensors file at all
        raise ConfigError(f"init_from: {path} does not hold this model's weights ({type(e).__name__}: {e}); "
                          "give the file save_weights wrote for the same --d-model, --layers and --context") from None


def load_corpus(cfg: JobConfig) -> Corpus:
    return Corpus.load(CorpusConfig(max_bytes=cfg.corpus_bytes, context=cfg.context))


def round_status(rnd: int, rounds: int, fragments: int, fragment: int, committed: bool, reason: str, peers: int,
                 loss: float | None, bytes_sent: int, bytes_received: int, mean_bps: float) -> str:
    """What a peer shows after a round: 'round 3/10, loss 2.345, 0.85 Mbit/s, 4 peers, sent 4.2 MB, recv
    4.1 MB' (most telling first; bytes so far, mean bandwidth of the run so far); a failed round says why."""
    where = f"round {rnd // fragments}/{rounds}" + (f" (fragment {fragment})" if fragments > 1 else "")
    if not committed:
        return f"{where}, not committed: {reason}"
    return (f"{where}, loss {'-' if loss is None else f'{loss:.3f}'}, {mean_bps * 8 / 1e6:.2f} Mbit/s, "
            f"{peers} peer{'s' if peers != 1 else ''}, sent {bytes_sent / 1e6:.1f} MB, recv {bytes_received / 1e6:.1f} MB")


def run_job(cfg: JobConfig, swarm: Swarm | None, *, metrics: MetricsWriter | None = None,
            status_path: str | os.PathLike[str] | None = None, stop: threading.Event | None = None,
            corpus: Corpus | None = None, on_step: Callable[[DiLoCo], None] | None = None,
            progress: Callable[[float, float | None, str | None], None] | None = None,
            round_clock: Callable[[DiLoCo], float] | None = None,
            others_steps: Sequence[float] | None = None, end: threading.Event | None = None) -> dict[str, Any]:
    """Train until the global round reaches cfg.rounds, or the whole swarm's run ends (`diloco.ending`; `end` set:
    we announce one), or `stop` is set; returns the final summary.
    `corpus`: `load_corpus(cfg)` already loaded (workers in one process share it, read-only).
    `on_step(d)`: called after every inner step (the simulator's fault plans act there).
    `progress(done, total, status)`: outer rounds done (fractional between rounds) of `cfg.rounds`
    after every inner step, with a new status (`round_status`) after every round. `round_clock(d)`: the seconds rounds by
    time count instead of the wall clock's (the simulator's workers count simulated time: their steps at their
    speed), and then no time limit; `others_steps`: the other workers' step times in those seconds, which an adaptive
    round and τ by time read instead of the records (the simulator's: deterministic, not the heartbeat's timing)."""
    stop = stop or threading.Event()
    metrics = metrics or MetricsWriter(None)
    torch.set_num_threads(cfg.threads)
    corpus = corpus or load_corpus(cfg)
    device = training_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # what CUDA calls without a device index (and NCCL) use
    model = build_model(GPTConfig(context=cfg.context, d_model=cfg.d_model, n_layer=cfg.n_layer), seed=cfg.seed)
    if cfg.init_from is not None:
        load_weights(model, cfg.init_from)
    model.to(device)  # the same initial weights on every device: built on the CPU, then moved
    # Data-parallel: the "inner step" is SGD at lr 1 without clipping, so a round's pseudo-gradient is this step's
    # gradient and the outer AdamW steps with their mean; DiLoCo: AdamW inner steps, clipped.
    inner: torch.optim.Optimizer = (torch.optim.SGD(model.parameters(), lr=1.0) if cfg.data_parallel else
                                    torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=ADAMW_BETAS,
                                                      weight_decay=WEIGHT_DECAY))
    peer = swarm.peer_id if swarm is not None else "local"
    shard = data_shard(peer, cfg.shard)
    sampler = BatchSampler(corpus.train, batch_size=cfg.batch_size, context=cfg.context, seed=cfg.seed,
                           shard=shard, num_shards=SHARDS)
    sampler.skip(cfg.first_step)  # the batches the run we continue took
    heldout = heldout_batches(corpus.heldout, batch_size=16, context=cfg.context, max_batches=cfg.eval_batches)
    started = time.monotonic()
    clock = {"start": started, "eval": 0.0}

    def train_seconds() -> float:
        """Training time: from the first inner step, held-out evaluations left out."""
        return round(time.monotonic() - clock["start"] - clock["eval"], 3)
    steps_at_round = [0]

    def on_round(r: RoundReport) -> None:
        fields = dict(peer=peer, round=r.round, committed=r.committed, reason=r.reason, peers=r.peers,
                      loss=d.loss, bytes_sent=r.bytes_sent, bytes_received=r.bytes_received,
                      payload_bytes=r.payload_bytes, bits_per_param=round(r.bits_per_param, 5),
                      seconds=round(r.seconds, 3), step=r.step, tokens=r.step * cfg.batch_size * cfg.context,
                      digest=d.member.report_digest(r), fragment=r.fragment, blocked=r.blocked, resynced=r.resynced, merge=r.merge,
                      round_steps=d.member.standing.covered,
                      phases={k: round(v, 3) for k, v in r.phases.items()}, **d.usage().as_dict())
        if cfg.eval_every and r.committed and r.round % cfg.eval_every == 0:
            t = time.monotonic()
            with d.global_weights():
                fields["eval_loss"] = evaluate(model, heldout)
            clock["eval"] += time.monotonic() - t
        fields["train_seconds"] = train_seconds()
        metrics.write("round", **fields)
        if progress is not None:
            sent, recv = d.bytes_on_wire()
            frags = len(d.fragments)
            steps_at_round[0] = d.steps
            progress(r.round / frags, cfg.rounds,
                     round_status(r.round, cfg.rounds, frags, r.fragment, r.committed, r.reason, r.peers, d.loss,
                                  sent, recv, d.usage().mean_bytes_per_second))

    error_feedback = swarm is not None and parse_compression(swarm.cfg.round.compression).ef is not None
    outer = (data_parallel_outer(cfg.lr, CLIP_NORM) if cfg.data_parallel else
             default_outer(error_feedback, cfg.outer_lr, cfg.outer_momentum))
    # data-parallel: the lr schedule moves to the outer AdamW; round r commits step r-1
    schedule = (partial(_outer_dp_scale, first=cfg.first_step, warmup=cfg.warmup, total=cfg.first_step + cfg.rounds,
                        schedule=cfg.schedule) if cfg.data_parallel else None)
    d = DiLoCo(model, inner, swarm=swarm, inner_steps=cfg.inner_steps, h_schedule=cfg.round_schedule,
               on_round=on_round, outer_optimizer=outer,
               outer_warmup=cfg.outer_warmup, outer_lr_schedule=schedule,
               streaming=cfg.streaming, checkpoint_dir=cfg.checkpoint_dir, checkpoint_every=cfg.checkpoint_every,
               round_seconds=cfg.round_seconds, adaptive=cfg.adaptive)
    if round_clock is not None:
        d.engine.clock = partial(round_clock, d)
    if others_steps is not None and d.engine.pace is not None:
        d.engine.pace.others = lambda: others_steps
    if cfg.resume and not d.resume():
        log.info("event=resume_skipped reason=no verified checkpoint in %s", cfg.checkpoint_dir)
    target = cfg.rounds * len(d.fragments)  # a round synchronizes one fragment
    ended = [False]  # the whole swarm's run ended (`diloco.ending`)
    total_steps = cfg.total_steps
    with d:
        if swarm is not None and cfg.wait_for > 1:
            seen = swarm.wait_for_peers(cfg.wait_for, cfg.wait_timeout)
            log.info("event=peers_present count=%d wanted=%d", seen, cfg.wait_for)
            d.engine.restart_clock()  # rounds by time: the first span counts from here, not from the wait
        clock["start"] = time.monotonic()
        # a safety net if the swarm never commits: four times the run's steps (adaptive: the fastest worker's), or
        # with rounds by time its seconds
        max_steps = total_steps * 4 if cfg.round_seconds is None else None
        time_limit = clock["start"] + 4 * target * (cfg.round_seconds or 0) + 60

        def go_on() -> bool:
            if end is not None and end.is_set():  # SIGUSR2: end the whole swarm's run (`diloco.ending`)
                d.end_swarm()
            if d.ended:
                ended[0] = True
                return False
            if max_steps is not None:
                return d.steps < max_steps
            return round_clock is not None or time.monotonic() < time_limit
        # A round on the wire counts: with overlap its result is applied on leaving the `with` (flush).
        while d.round + d.pending_rounds < target and not stop.is_set() and go_on():
            if not cfg.data_parallel:
                for group in inner.param_groups:
                    group["lr"] = inner_lr(cfg.first_step + d.swarm_step, lr=cfg.lr, warmup=cfg.warmup,
                                           total=cfg.first_step + total_steps, schedule=cfg.schedule)
            x, y = sampler.next()
            computed, worked = time.monotonic(), time.process_time() if cfg.slowdown > 1 else 0.0
            _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            loss.backward()
            if not cfg.data_parallel:  # data-parallel clips the mean gradient, in the outer step
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            d.report_loss(loss.item())
            if cfg.slowdown > 1:
                time.sleep(throttle_seconds(cfg.slowdown, time.monotonic() - computed,
                                            time.process_time() - worked if device.type == "cpu" else None))
            inner.step()  # the wrapper's hook synchronizes every inner_steps-th call
            inner.zero_grad(set_to_none=True)
            if on_step is not None:
                on_step(d)
            if progress is not None:  # between rounds: the share of this round's inner steps taken
                slot = d.inner_steps_now / len(d.fragments)
                progress((d.round + min(1.0, (d.steps - steps_at_round[0]) / slot)) / len(d.fragments), cfg.rounds,
                         None)
            if status_path and (d.steps % 5 == 0 or d.steps == 1):
                sent, recv = d.bytes_on_wire()
                usage = d.usage()
                write_status(status_path, peer=peer, round=d.round // len(d.fragments), step=d.steps, loss=d.loss,
                             bytes_sent=sent, bytes_received=recv, utilization=usage.utilization,
                             blocked_seconds=usage.blocked_seconds, mean_bps=usage.mean_bytes_per_second,
                             peak_bps=usage.peak_bytes_per_second)
    trained = train_seconds()
    # the end every run shares (`diloco.lifecycle`): a peer still behind downloads the final state from us, and the
    # final checkpoint (also on SIGTERM / Ctrl-C, which end the loop above)
    end_run(d, completed=not stop.is_set() and (d.round >= target or ended[0]))
    with d.global_weights():
        eval_loss = evaluate(model, heldout)
    if cfg.save_final:
        d.save_final(cfg.save_final)
    sent, recv = d.bytes_on_wire()
    synced = [r for r in d.reports if r.committed]
    bits = sum(r.bits_per_param for r in synced) / len(synced) if synced else 0.0
    summary = dict(final_fields(d), peer=peer, round=d.round // len(d.fragments), fragment_rounds=d.round,
                   saved=cfg.save_final,
                   eval_loss=eval_loss, device=str(device), compression=d.compression,
                   bits_per_param_sync=round(bits, 5), params=sum(p.numel() for p in model.parameters()),
                   bytes_sent=sent, bytes_received=recv, wall_seconds=round(time.monotonic() - started, 2),
                   train_seconds=trained, data_parallel=cfg.data_parallel,
                   stopped=stop.is_set(), run_ended=ended[0], fragments=len(d.fragments), overlap=cfg.streaming.overlap,
                   alpha=cfg.streaming.alpha, outer_overlap=cfg.streaming.outer_overlap, usage=d.usage().as_dict(),
                   rollbacks=d.rollbacks,
                   write_failures=dict(sorted(write_failures.items())),
                   **defences(swarm))
    metrics.write("final", **summary)
    metrics.flush()
    if status_path:
        write_status(status_path, done=True, step=d.steps, loss=d.loss, **summary)
    return summary
