"""The command line's options, each declared once, in groups the commands share.

A group is a frozen dataclass whose fields are options: the field's default is the option's default,
taken from the configuration it feeds (`SwarmConfig`, `JobConfig`, its `StreamingConfig`), so a default
lives in one place; its metadata holds the flag names, and the help where the command line needs its own
words (it names other flags, or a format of its own). Elsewhere the help is the docstring of the configuration's
field of the same name (`diloco.fielddocs`), so a setting is explained once. `command(*groups)` gives a typer
command the groups' options next to its own and hands it one typed object per group:

    @app.command()
    @command(AggregationOptions, JobOptions)
    def simulate(aggregation: AggregationOptions, job: JobOptions, workers: int = typer.Option(4)) -> None:
        swarm_cfg, job_cfg = aggregation.config(run_id="simulate"), job_config(job)

A command that wants other defaults for a group (the demo's shorter run) passes them:
`command(JobOptions.defaults(rounds=8, inner_steps=25))`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Sequence, TypeVar

import typer

from ..comms import CollectiveConfig
from ..comms.robust import RobustConfig
from ..config import ConfigError, SwarmConfig
from ..fielddocs import field_docs
from ..fragments import FragmentError, StreamingConfig, format_h_schedule, parse_h_schedule
from ..job.train import JobConfig

_G = TypeVar("_G")
_SWARM, _JOB = SwarmConfig(), JobConfig()
_ROUND = _SWARM.round
_STREAM = _JOB.streaming


def option(default: Any, *flags: str, help: str | None = None, hidden: bool = False) -> Any:
    """A group's field that is a command-line option (`flags`: its names when not derived from the field; `help`:
    when not the docstring of the group's configuration field of the same name)."""
    return field(default=default, metadata={"flags": flags, "help": help, "hidden": hidden})


class Group:
    """Base of the option groups."""

    _overrides: typing.ClassVar[dict[str, Any]] = {}
    documented_by: typing.ClassVar[tuple[type, ...]] = ()
    """The configurations whose field docstrings are the help of this group's options that give none."""

    @classmethod
    def defaults(cls: type[_G], **overrides: Any) -> type[_G]:
        """This group with other defaults for some options (same names, same help)."""
        unknown = set(overrides) - {f.name for f in fields(cls)}  # type: ignore[arg-type]
        if unknown:
            raise TypeError(f"{cls.__name__} has no option {sorted(unknown)}")
        return type(cls.__name__, (cls,), {"_overrides": {**cls._overrides, **overrides}})  # type: ignore[attr-defined]

    def job_fields(self) -> dict[str, Any]:
        """What this group sets in a JobConfig: its fields under their names (paths as strings)."""
        return {f.name: str(v) if isinstance(v := getattr(self, f.name), Path) else v
                for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def option_value(cls, name: str, value: Any) -> Any:
        """A configuration's value of field `name` as this group's option holds it (`job_fields` reversed)."""
        return value


def plain(help: str) -> str:
    """`help` as typer's rich help shows it verbatim: a bracket opens no markup (`pip install "diloco[wandb]"`)."""
    return help.replace("[", "\\[")


BUNDLED_PANEL = "The bundled job (not passed to your command after --)"
"""Where `--help` lists the options of the bundled job, which a command of yours (`diloco start -- CMD`) never sees."""


def help_of(group: type[Group], name: str) -> str:
    """The help of `group`'s option `name`: its own, or its configuration field's docstring."""
    f = next(f for f in fields(group) if f.name == name)  # type: ignore[arg-type]
    if f.metadata["help"] is not None:
        return str(f.metadata["help"])
    doc = docs_of(group).get(name)
    if doc is None:
        where = " or ".join(c.__name__ for c in group.documented_by) or "its configuration"
        raise TypeError(f"{group.__name__}.{name}: an option without help needs a docstring on the field of the same "
                        f"name in {where}")
    return doc


def docs_of(group: type[Group]) -> dict[str, str]:
    """The field docstrings of `group`'s configurations (the first that documents a name wins)."""
    docs: dict[str, str] = {}
    for cls in reversed(group.documented_by):
        docs.update(field_docs(cls))
    return docs


def typer_option(group: type[Group], name: str) -> Any:
    """The typer option of `group`'s field `name`, as a command's parameter default: also for a command
    that takes that one option rather than the whole group (`--quiet` of the benchmarks)."""
    f = next(f for f in fields(group) if f.name == name)  # type: ignore[arg-type]
    panel = BUNDLED_PANEL if name in bundled_only(group) else None
    return typer.Option(group._overrides.get(name, f.default), *f.metadata["flags"], help=plain(help_of(group, name)),
                        hidden=f.metadata["hidden"], rich_help_panel=panel)


def long_flag(group: type[Group], name: str) -> str:
    """The long flag of `group`'s field `name` (`--fragment-pattern` for `pattern`)."""
    f = next(f for f in fields(group) if f.name == name)  # type: ignore[arg-type]
    return next((x for x in f.metadata["flags"] if x.startswith("--")), "--" + name.replace("_", "-"))


def bundled_only(group: type[Group]) -> set[str]:
    """The options of `group` that only the bundled job reads: under `diloco start/join -- CMD` the launcher hands
    the swarm's settings, checkpoints, metrics and whom to wait for to your command, and nothing of these (your
    script has its own loop, model, data and schedule)."""
    if group.__name__ in ("JobOptions", "ModelOptions", "RunOptions", "StreamingOptions"):
        return {f.name for f in fields(group)}  # type: ignore[arg-type]
    return {"PeerJobOptions": {"resume", "save_final"},
            "PeerOptions": {"status_file"}}.get(group.__name__, set())


def _parameters(group: type[Group]) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(group)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=typer_option(group, f.name),
                              annotation=hints[f.name]) for f in fields(group)]  # type: ignore[arg-type]


def command(*groups: type[Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the options of `groups`: it is called with one instance of each group, in order, as
    its first positional arguments, then its own parameters (which keep their own typer declarations)."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(fn).parameters.values())[len(groups):]
        own_hints = typing.get_type_hints(fn)
        own = [p.replace(annotation=own_hints.get(p.name, p.annotation)) for p in own]
        group_params = [_parameters(g) for g in groups]
        every = [p.name for ps in group_params for p in ps] + [p.name for p in own]
        clash = sorted({n for n in every if every.count(n) > 1})
        if clash:
            raise TypeError(f"{fn.__name__}: options declared twice: {clash}")

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            made = [g(**{p.name: kwargs.pop(p.name) for p in ps}) for g, ps in zip(groups, group_params)]
            return fn(*made, *args, **kwargs)

        params = [p for ps in group_params for p in ps]
        positional = [p for p in own if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keyword = [p for p in own if p not in positional]
        run.__signature__ = inspect.Signature([*positional, *keyword, *params])  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in run.__signature__.parameters.values()}  # type: ignore[attr-defined]
        del run.__wrapped__  # typer must read the signature above, not fn's
        return run
    return wrap


# ---------------------------------------------------------------------- the groups


@dataclass(frozen=True)
class AggregationOptions(Group):
    """How pseudo-gradients travel and are averaged (`SwarmConfig`: every peer of a swarm must agree on the
    compression)."""

    documented_by = (CollectiveConfig, RobustConfig)

    compression: str = option(_ROUND.compression)
    clip: float = option(_ROUND.robust.clip)
    trim: float = option(_ROUND.robust.trim)
    ban_after: int = option(_ROUND.robust.ban_after)

    def round(self, **more: Any) -> CollectiveConfig:
        """The round's settings these options give (`more`: the others). Raises ConfigError naming what is wrong."""
        robust = RobustConfig(clip=self.clip, trim=self.trim, ban_after=self.ban_after)
        return CollectiveConfig(compression=self.compression, robust=robust, **more)

    def config(self, **more: Any) -> SwarmConfig:
        """Raises ConfigError naming the field that is wrong."""
        return SwarmConfig(round=self.round(), **more)

    @classmethod
    def of(cls, cfg: SwarmConfig) -> AggregationOptions:
        """The options that give `cfg`'s aggregation (`config` reversed)."""
        robust = cfg.round.robust
        return cls(compression=cfg.round.compression, clip=robust.clip, trim=robust.trim, ban_after=robust.ban_after)


@dataclass(frozen=True)
class SwarmOptions(Group):
    """A peer's swarm: its namespace, quorum and deadlines (`SwarmConfig`)."""

    documented_by = (SwarmConfig, CollectiveConfig)

    run_id: str = option(_SWARM.run_id, "--run-id")
    min_peers: int = option(_ROUND.min_peers)
    gather_timeout: float = option(_ROUND.gather_timeout)
    round_timeout: float = option(_ROUND.result_timeout, help="Seconds after a round starts by which it commits or is "
                                                              "abandoned (result_timeout; span owners reduce within "
                                                              "two thirds of it, reduce_timeout).")
    heartbeat_ttl: float = option(_SWARM.heartbeat_ttl)
    region: str = option(_SWARM.region, help="This peer's region (e.g. eu-west): rounds run among the peers of a "
                                             "region, and every --merge-every of them the regions merge "
                                             "(docs/REGIONS.md). Default: a flat swarm.")
    merge_every: int = option(_SWARM.merge_every)
    global_lr: float = option(_SWARM.global_lr)
    global_momentum: float = option(_SWARM.global_momentum)
    topology: str = option(_SWARM.topology)
    gossip_group: int = option(_SWARM.gossip_group)

    def config(self, aggregation: AggregationOptions, peer: PeerOptions) -> SwarmConfig:
        """Raises ConfigError naming the field that is wrong."""
        rnd = aggregation.round(min_peers=self.min_peers, gather_timeout=self.gather_timeout,
                                result_timeout=self.round_timeout, reduce_timeout=self.round_timeout * 2 / 3)
        return SwarmConfig(round=rnd, run_id=self.run_id, heartbeat_ttl=self.heartbeat_ttl,
                           allow_peers=tuple(peer.allow_peer or ()),
                           identity_file=str(peer.identity) if peer.identity else None, region=self.region,
                           merge_every=self.merge_every, global_lr=self.global_lr,
                           global_momentum=self.global_momentum, topology=self.topology,
                           gossip_group=self.gossip_group, data_port=peer.data_port if peer.direct else None,
                           data_announce=peer.data_announce, data_streams=peer.data_streams, relay=peer.relay,
                           relay_circuits=peer.relay_circuits, relay_rate=peer.relay_rate, reach=peer.reach)


@dataclass(frozen=True)
class PeerOptions(Group):
    """A peer process on the network: where it listens, its credentials and identity, what it writes."""

    documented_by = (SwarmConfig,)

    host: str = option("127.0.0.1", help="Address to listen on; 0.0.0.0 to accept peers from other machines.")
    port: int = option(0, help="TCP port to listen on (0: any free port).")
    announce: Optional[List[str]] = option(None, help="Multiaddr others should dial, e.g. /ip4/203.0.113.5/tcp/31337 "
                                                      "(behind NAT).")
    secret_file: Optional[Path] = option(None, "--secret-file", help="File holding the swarm secret (start: created if "
                                         "missing; default diloco-RUN_ID.secret). Or set DILOCO_SECRET.")
    allow_peer: Optional[List[str]] = option(None, "--allow-peer", help="Only talk to this peer id (repeatable); "
                                                                        "default: anyone with the secret.")
    identity: Optional[Path] = option(None, "--identity", help="This peer's key file (created if missing, mode 600): "
                                      "its peer id then survives restarts, as other sites' --allow-peer need. "
                                      "Default: a new id per run.")
    direct: bool = option(True, "--direct/--no-direct", help="Move the rounds' bytes on direct TCP connections "
                          "between members (the data port; authenticated and encrypted), libp2p where one cannot be "
                          "made; --no-direct: everything through libp2p (docs/PROTOCOL.md, \"The data plane\").")
    data_port: int = option(0, help="TCP port of the data plane (0: any free port).")
    data_announce: str = option("", help="host:port others should dial for the data port (behind NAT: the "
                                         "forwarded port); default: the --announce host, else where it listens.")
    data_streams: int = option(_SWARM.data_streams)
    relay: bool = option(_SWARM.relay, "--relay")
    relay_circuits: int = option(_SWARM.relay_circuits)
    relay_rate: float = option(_SWARM.relay_rate)
    reach: str = option(_SWARM.reach)
    address_file: Optional[Path] = option(None, help="Write this peer's addresses to this file once up.")
    status_file: Optional[Path] = option(None, help="Keep this peer's status here (the demo reads it).", hidden=True)
    max_restarts: int = option(0, help="With `-- CMD`: start the command again this many times if it fails (it "
                                       "rejoins and downloads the swarm's state, or resumes from --checkpoint-dir).")
    verbose: bool = option(False, "--verbose", "-v", help="Log every round event.")


@dataclass(frozen=True)
class ModelOptions(Group):
    """The bundled model and its batches (`JobConfig`; the fields are its fields)."""

    documented_by = (JobConfig,)

    batch_size: int = option(_JOB.batch_size)
    d_model: int = option(_JOB.d_model)
    n_layer: int = option(_JOB.n_layer, "--layers")
    context: int = option(_JOB.context)


@dataclass(frozen=True)
class JobOptions(Group):
    """The bundled job's training run (`JobConfig`; the fields are its fields)."""

    documented_by = (JobConfig,)

    rounds: int = option(_JOB.rounds)
    inner_steps: int = option(_JOB.inner_steps, "--inner-steps", "-H")
    round_seconds: Optional[float] = option(_JOB.round_seconds, "--round-seconds")
    adaptive: bool = option(_JOB.adaptive, "--adaptive")
    slowdown: float = option(_JOB.slowdown, hidden=True)
    h_schedule: str = option("", "--h-schedule", help="Change H during the run: 'R:H' pairs, e.g. '80:10' (after 80 "
                                                      "outer steps, H=10) or '80:10,95:5'.")
    outer_lr: Optional[float] = option(_JOB.outer_lr)
    outer_momentum: Optional[float] = option(_JOB.outer_momentum)
    outer_warmup: int = option(_JOB.outer_warmup)
    lr: float = option(_JOB.lr)
    warmup: int = option(_JOB.warmup)
    schedule: str = option(_JOB.schedule)
    data_parallel: bool = option(_JOB.data_parallel, "--data-parallel")

    def job_fields(self) -> dict[str, Any]:
        """JobConfig holds the H schedule as pairs. Raises ConfigError naming what is wrong."""
        try:
            return {**super().job_fields(), "h_schedule": parse_h_schedule(self.h_schedule)}
        except ValueError as e:
            raise ConfigError(f"--h-schedule: {e}") from e

    @classmethod
    def option_value(cls, name: str, value: Any) -> Any:
        return format_h_schedule(value) if name == "h_schedule" else value


@dataclass(frozen=True)
class RunOptions(Group):
    """How this process runs the bundled job (`JobConfig`): seed, threads, evaluation."""

    documented_by = (JobConfig,)

    seed: int = option(_JOB.seed)
    init_from: Optional[Path] = option(None, "--init-from")
    first_step: int = option(_JOB.first_step)
    threads: int = option(_JOB.threads)
    device: str = option(_JOB.device)
    eval_every: int = option(_JOB.eval_every)


@dataclass(frozen=True)
class PeerJobOptions(Group):
    """A peer's own part of the job (`JobConfig`): its data shard, whom to wait for, its checkpoints."""

    documented_by = (JobConfig,)

    shard: Optional[int] = option(_JOB.shard)
    wait_for: int = option(_JOB.wait_for)
    checkpoint_dir: Optional[Path] = option(None)
    checkpoint_every: int = option(_JOB.checkpoint_every)
    resume: bool = option(_JOB.resume, "--resume")
    save_final: Optional[Path] = option(None, "--save-final")


@dataclass(frozen=True)
class StreamingOptions(Group):
    """Streaming DiLoCo (`StreamingConfig`, which `JobConfig.streaming` holds; the fields are its fields)."""

    documented_by = (StreamingConfig,)

    fragments: int = option(_STREAM.fragments)
    pattern: str = option(_STREAM.pattern, "--fragment-pattern")
    overlap: int = option(_STREAM.overlap, "--overlap")
    alpha: float = option(_STREAM.alpha)
    outer_overlap: str = option(_STREAM.outer_overlap)

    def config(self) -> StreamingConfig:
        """Raises FragmentError naming the knob that is wrong."""
        return StreamingConfig(fragments=self.fragments, pattern=self.pattern, overlap=self.overlap, alpha=self.alpha,
                               outer_overlap=self.outer_overlap)

    def job_fields(self) -> dict[str, Any]:
        """JobConfig holds these as one StreamingConfig. Raises ConfigError naming the knob that is wrong."""
        try:
            return {"streaming": self.config()}
        except FragmentError as e:
            raise ConfigError(str(e)) from e


def read_settings(path: Path, params: Sequence[Any]) -> dict[str, Any]:
    """The settings a TOML file gives a command whose options are `params`: {option name: value}.

    The file's keys are the command's long options without their dashes (`gather-timeout = 30`; `_` for `-`
    works too), at its top level or in tables, which only group them (`[swarm]`, `[job]`: any names). Raises
    ConfigError naming the file, the key and the fix."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from e
    by_key: dict[str, Any] = {}  # typer's click options (typer.core.TyperOption), by the flags a key may name
    for p in params:
        if p.param_type_name == "option" and not p.hidden and p.name not in ("config", "help"):
            for flag in (*p.opts, *p.secondary_opts):
                if flag.startswith("--"):
                    by_key[flag[2:]] = p
            by_key.setdefault(str(p.name).replace("_", "-"), p)
    out: dict[str, Any] = {}
    for key, value in _flat(data):
        option = by_key.get(key.replace("_", "-"))
        if option is None:
            near = difflib.get_close_matches(key.replace("_", "-"), list(by_key), n=1)
            raise ConfigError(f"--config {path}: unknown setting {key!r}"
                              + (f" (did you mean {near[0]!r}?)" if near else "")
                              + "; a setting is a long option of this command without its dashes, e.g. "
                                "gather-timeout = 30 (see --help)")
        if "--" + key.replace("_", "-") in option.secondary_opts and isinstance(value, bool):
            value = not value  # no-live = true: live is off
        name = str(option.name)
        if name in out:
            raise ConfigError(f"--config {path}: {key!r} is set twice (as {name.replace('_', '-')})")
        if option.multiple and not isinstance(value, list):
            raise ConfigError(f"--config {path}: {key!r} takes a list, e.g. {key} = [\"{value}\"]")
        if not option.multiple and isinstance(value, (list, dict)):
            raise ConfigError(f"--config {path}: {key!r} takes one value, not {type(value).__name__} {value!r}")
        out[name] = value
    return out


def _flat(data: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(key, value) of a settings file, its tables opened (their names only group the settings)."""
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _flat(value)
        else:
            yield key, value


def load_config(ctx: typer.Context, _param: typer.CallbackParam, path: Optional[Path]) -> Optional[Path]:
    """`--config FILE.toml`'s callback: the file's settings become the command's defaults, so that any option
    given on the command line overrides them. Exits 2 naming the file, the setting and the fix."""
    if path is None:
        return None
    hint = f"--config {path}"
    try:
        settings = read_settings(path, ctx.command.params)
    except ConfigError as e:
        raise typer.BadParameter(str(e).removeprefix(f"{hint}: "), param_hint=hint) from e
    for param in ctx.command.params:
        if param.name in settings:
            try:
                _convert(ctx, param, settings[param.name])
            except Exception as e:  # noqa: BLE001 - click's BadParameter (typer vendors its own click)
                raise typer.BadParameter(f"{param.name.replace('_', '-')} = {settings[param.name]!r}: "
                                         f"{getattr(e, 'message', e)}", param_hint=hint) from e
    ctx.default_map = {**(ctx.default_map or {}), **settings}
    return path


def _convert(ctx: typer.Context, param: Any, value: Any) -> None:
    """Convert `value` as the command line would convert it for `param`, raising what it would raise (so that a
    wrong type in the file is reported with the file's name)."""
    if isinstance(value, bool) and getattr(param, "is_flag", False):
        return
    if hasattr(param, "type_cast_value"):  # typer on click
        param.type_cast_value(ctx, value)
    else:  # typer with its own click (0.2x)
        param.get_runtime_param().coerce(value, param=param, ctx=ctx)


CONFIG = typer.Option(None, "--config", is_eager=True, callback=load_config, metavar="FILE.toml",
                      help=plain("Read settings from this TOML file: each key a long option without its dashes "
                                 "(gather-timeout = 30, compression = \"e3m0\"), at the top or in [tables] that group "
                                 "them; the command line overrides the file (docs/CLI.md, \"Settings files\")."))
"""`--config FILE.toml` of the peer commands (`diloco start/join`)."""


JOB_GROUPS = (JobOptions, ModelOptions, RunOptions, PeerJobOptions, StreamingOptions)
"""The groups of JobConfig: their fields are its fields, or (streaming) its StreamingConfig's."""


@dataclass(frozen=True)
class OutputOptions(Group):
    """Where a run's metrics go besides the terminal, and how much the terminal shows."""

    metrics: Optional[Path] = option(None, help="Append one JSON line per round (and a final one) to this file.")
    tensorboard: Optional[Path] = option(None, "--tensorboard", help="Also log every round to TensorBoard event files "
                                         "in DIR/<peer id> (`tensorboard --logdir DIR`). Needs: pip install "
                                         "\"diloco[tensorboard]\".")
    wandb: Optional[str] = option(None, "--wandb", help="Also log every round to this Weights & Biases project "
                                  "(offline, into ./wandb, without an API key or with WANDB_MODE=offline). Needs: "
                                  "pip install \"diloco[wandb]\".")
    quiet: bool = option(False, "--quiet", "-q", help="Show no progress (results and errors still print). Progress "
                                                      "goes to stderr: a live view on a terminal, plain lines "
                                                      "elsewhere (a log, CI).")


def job_config(*groups: Group, **more: Any) -> JobConfig:
    """The JobConfig of a command's job groups (`JOB_GROUPS`; defaults for the fields none of them has).
    Raises ConfigError naming the field that is wrong."""
    kwargs: dict[str, Any] = {k: v for g in groups for k, v in g.job_fields().items()}
    return JobConfig(**kwargs, **more)


def flags(values: object, *groups: type[Group]) -> list[str]:
    """The command-line flags that set the options of `groups` to `values`' attributes of the same names
    (a JobConfig, a StreamingConfig, or a group's own values: `AggregationOptions.of(swarm_cfg)`), leaving out those
    at the option's default: what the options read back.
    The demo starts its peers with them."""
    out: list[str] = []
    for group in groups:
        for f in fields(group):  # type: ignore[arg-type]
            value = group.option_value(f.name, getattr(values, f.name))
            if value == f.default:
                continue
            flag = long_flag(group, f.name)
            if isinstance(value, bool):
                out += [flag] if value else []
            elif value is not None:
                out += [flag, str(value)]
    return out
