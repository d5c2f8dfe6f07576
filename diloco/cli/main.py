"""The `diloco` command line: start a swarm, join one, or run a local demo swarm.

    diloco start                       # first peer; prints its address and the join line
    diloco join /ip4/…/p2p/12D3Koo…    # any other peer, on any machine that can reach it
    diloco start -- torchrun --nproc-per-node 2 train.py   # your own script as this site's worker
    diloco demo                        # 4 peers on this machine, live view, summary
    diloco simulate --workers 16 --rounds 2 -H 10   # 16 workers in one process, projected onto links
    diloco plot run.jsonl              # a run's curves (loss vs tokens, bytes, time) as PNG files

Bad input exits with status 2 and a message that names the fix, before any network I/O.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, List, NoReturn, Optional

import typer

from ..bench.chaos import ChaosSetup
from ..bench.hetero import HeteroSetup
from ..comms import CollectiveConfig
from ..config import ConfigError, SwarmConfig
from ..job.train import JobConfig, training_device
from ..sinks import SinkConfig
from .demo import DEMO_COMPRESSION, DEMO_JOB
from .options import (CONFIG, AggregationOptions, Group, JobOptions, ModelOptions, OutputOptions, PeerJobOptions, PeerOptions,
                      RunOptions, StreamingOptions, SwarmOptions, command, job_config, typer_option)

if TYPE_CHECKING:
    import torch


app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n\n")[0])

Quiet = typer_option(OutputOptions, "quiet")
"""--quiet of the commands that take no OutputOptions (bench, status, plot)."""
RunId = typer_option(SwarmOptions, "run_id")
"""--run-id of `diloco status`, which observes a swarm without joining it."""
ReportJson = typer.Option(None, "--json", help="Write the report as JSON here.")
"""--json of the benchmarks."""
LossPlot = typer.Option(None, "--plot", help="Draw held-out loss vs training time as PNG here.")
"""--plot of the benchmarks that race variants to a held-out loss."""
LabWorkdir = typer.Option(None, help="Keep peers' logs and metrics here (default: a temp dir).")
"""--workdir of the benchmarks that run real peers."""
LabLr = typer.Option(4e-3, help="Inner AdamW lr.")
LabWidth = typer.Option(64, help="Model width.")
LabLayers = typer.Option(2, help="Transformer blocks.")
"""The bundled model of the benchmarks on an emulated WAN (`diloco.bench.lab.LabModel`)."""


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _configs(swarm: SwarmOptions, aggregation: AggregationOptions, peer: PeerOptions,
             *job: Group) -> tuple[SwarmConfig, JobConfig]:
    """The swarm's and the job's settings from a peer command's option groups; exits 2 naming what is wrong."""
    try:
        return swarm.config(aggregation, peer), job_config(*job)
    except ConfigError as e:
        _fail(str(e))


def _device(spec: str, flag: str = "--device") -> torch.device:
    """The device a --device option names on this machine; exits 2 saying what to give instead."""
    try:
        return training_device(spec, flag)
    except ConfigError as e:
        _fail(str(e))


def _sinks(tensorboard: Optional[Path], wandb: Optional[str]) -> SinkConfig:
    """What --tensorboard / --wandb ask for, with their packages checked; exits 2 naming the install line."""
    from ..sinks import SinkError

    sinks = SinkConfig(tensorboard=str(tensorboard) if tensorboard else None, wandb=wandb or None)
    try:
        sinks.require()
    except SinkError as e:
        _fail(str(e))
    return sinks


def _secret(path: Optional[Path], run_id: str, *, create: bool) -> tuple[str, str]:
    """The swarm secret and where it came from (see `diloco.credentials.resolve`); exits 2 naming the fix."""
    from ..credentials import CredentialError, resolve

    try:
        return resolve(path, run_id=run_id, create=create)
    except CredentialError as e:
        _fail(str(e))


def _join_line(command: str, where: str) -> str:
    """The join line with the secret's source, never the secret itself."""
    if where.startswith("$"):
        return f"{command}\n  (with {where[1:]} set to the same secret there)"
    path = where.removeprefix("created ")
    return (f"{command} --secret-file {Path(path).name}\n  (first copy {path} to that machine over a secure channel, "
            "e.g. scp; keep it private)")


def _run_peer(initial: list[str], *, host: str, port: int, announce: Optional[List[str]],
              address_file: Optional[Path], metrics: Optional[Path], status_file: Optional[Path],
              swarm_cfg: SwarmConfig, job: JobConfig, secret_from: str, quiet: bool = False,
              sinks: SinkConfig = SinkConfig()) -> None:
    from ..comms.faults import FaultPlan
    from ..comms.fdlimit import raise_open_files_limit
    from ..comms.hello import HandshakeError
    from ..metrics import MetricsWriter
    from ..progress import Reporter
    from ..sinks import SinkError
    from ..connect import SwarmError
    from ..swarm import Banned, Swarm
    from ..job.train import run_job
    from ..wrapper import subnormals_flushed

    raise_open_files_limit()  # before the daemon starts: it inherits the limit
    try:
        faults = FaultPlan.from_env()  # tests and chaos runs: DILOCO_FAULTS, read here and nowhere else
    except ValueError as e:
        _fail(f"DILOCO_FAULTS: {e}")
    # Every thread of the peer flushes subnormal floats, the swarm's too (its event loop decodes and averages): the
    # setting is a thread's own, and a thread takes it from the one that starts it, so it comes before the swarm.
    with subnormals_flushed():
        try:
            swarm = Swarm.join(initial, swarm_cfg, host=host, port=port, announce=announce, faults=faults) if initial \
                else Swarm.start(swarm_cfg, host=host, port=port, announce=announce, faults=faults)
        except (SwarmError, HandshakeError) as e:
            _fail(str(e), code=1)
        stop = threading.Event()

        def on_signal(signum: int, _frame: object) -> None:
            typer.echo(f"received {signal.Signals(signum).name}: finishing the current round, then leaving", err=True)
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        end = threading.Event()

        def on_end(_signum: int, _frame: object) -> None:
            typer.echo("received SIGUSR2: announcing the end of the whole run; every peer ends at the same round",
                       err=True)
            end.set()

        signal.signal(signal.SIGUSR2, on_end)
        try:
            typer.echo(f"peer {swarm.peer_id} in run {swarm_cfg.run_id!r}, swarm secret from {secret_from}")
            typer.echo(f"end the whole run, every peer on one final model: kill -USR2 {os.getpid()}")
            for addr in swarm.addresses:
                typer.echo(f"  address: {addr}")
            if not initial:
                typer.echo(f"others join with:\n  {_join_line(swarm.join_command(), secret_from)}")
                watch = swarm.join_command().replace("diloco join", "diloco status", 1)
                where = "" if secret_from.startswith("$") else f" --secret-file {secret_from.removeprefix('created ')}"
                typer.echo(f"watch the swarm with:\n  {watch}{where}")
            if line := _waiting_line(job.wait_for, first=not initial):
                typer.echo(line)
            if address_file:
                tmp = Path(str(address_file) + ".tmp")
                tmp.write_text("\n".join(swarm.addresses) + "\n")
                os.replace(tmp, address_file)
            try:
                writer = MetricsWriter(metrics, sinks.open(swarm.peer_id, swarm_cfg.run_id,
                                                           _run_config(swarm_cfg, job)))
            except SinkError as e:
                _fail(str(e), code=1)
            # progress: a live line on a terminal, a line per round elsewhere or with --verbose's log lines
            live = not logging.getLogger("diloco").isEnabledFor(logging.INFO)
            try:
                with Reporter.for_command(quiet=quiet, live=live) as rep, \
                        rep.task("training", job.rounds, unit="rounds") as task:
                    summary = run_job(job, swarm, metrics=writer, status_path=status_file, stop=stop,
                                      progress=task.update, end=end)
            except (HandshakeError, Banned) as e:  # our model or codec differs from the swarm's; the swarm banned us
                _fail(str(e), code=1)
            finally:
                writer.close()
            ended = " (the whole run ended there, as a peer was asked)" if summary.get("run_ended") else ""
            typer.echo(f"done: round {summary['round']}{ended}, held-out loss {summary['eval_loss']:.4f}, "
                       f"sent {summary['bytes_sent'] / 1e6:.1f} MB, received {summary['bytes_received'] / 1e6:.1f} MB")
        finally:
            swarm.close()


def _waiting_line(wait_for: int, *, first: bool) -> str:
    """What a peer does before its first step: wait for `wait_for` peers, or (the `first` of a swarm) train alone
    meanwhile; "" for a joiner that waits for nobody."""
    if wait_for > 1:
        return f"waiting for {wait_for} peers (this one included, up to 120 s) before the first step"
    if not first:
        return ""
    return ("training now, alone until others join (they download its state); --wait-for N waits for N peers first, "
            "and a short run may end before anyone joins")


def _run_config(swarm_cfg: SwarmConfig, job: JobConfig) -> dict[str, Any]:
    """The settings of a run, for W&B's run config: the job's and the swarm's, never the secret."""
    from dataclasses import asdict

    return {**asdict(job), **swarm_cfg.settings()}


@app.command(context_settings={"allow_extra_args": True})  # a command without `--` is refused in _command
@command(SwarmOptions, AggregationOptions, PeerOptions, JobOptions, ModelOptions, RunOptions, PeerJobOptions,
         StreamingOptions, OutputOptions)
def start(swarm: SwarmOptions, aggregation: AggregationOptions, peer: PeerOptions, job: JobOptions, model: ModelOptions,
          run: RunOptions, mine: PeerJobOptions, streaming: StreamingOptions, out: OutputOptions,
          config: Optional[Path] = CONFIG, ctx: typer.Context = typer.Option(None, hidden=True)) -> None:
    """Start a swarm and print the line others run to join. Trains the bundled model, or runs your own
    command as this site's worker: `diloco start [OPTIONS] -- CMD [ARGS...]`."""
    _peer([], swarm, aggregation, peer, (job, model, run, mine, streaming), out, ctx)


@app.command()
@command(SwarmOptions, AggregationOptions, PeerOptions, JobOptions, ModelOptions, RunOptions, PeerJobOptions,
         StreamingOptions, OutputOptions)
def join(swarm: SwarmOptions, aggregation: AggregationOptions, peer: PeerOptions, job: JobOptions, model: ModelOptions,
         run: RunOptions, mine: PeerJobOptions, streaming: StreamingOptions, out: OutputOptions,
         addresses: List[str] = typer.Argument(..., help="Address(es) of running peers, tried in order."),
         config: Optional[Path] = CONFIG, ctx: typer.Context = typer.Option(None, hidden=True)) -> None:
    """Join a running swarm at ADDRESSES and train with it: the bundled model, or your own command as this
    site's worker: `diloco join ADDR [OPTIONS] -- CMD [ARGS...]`."""
    from ..connect import SwarmError, validate_addrs

    try:
        validate_addrs(addresses)
    except SwarmError as e:
        command = [a for a in addresses if not a.startswith("/")]
        _fail(str(e) + (f"; to run your own command as this site's worker, put `--` before it: diloco join ADDR "
                        f"[OPTIONS] -- {' '.join(command)}" if command and command != addresses else ""))
    _peer(addresses, swarm, aggregation, peer, (job, model, run, mine, streaming), out, ctx)


def _peer(initial: list[str], swarm: SwarmOptions, aggregation: AggregationOptions, peer: PeerOptions,
          job: tuple[Group, ...], out: OutputOptions, ctx: typer.Context) -> None:
    """start and join: this peer trains the bundled job, or runs the user's command as its site's worker."""
    command = _command(ctx, peer.max_restarts)
    if command is not None:
        _unused_by_command(ctx, (peer, *job))
    swarm_cfg, job_cfg = _configs(swarm, aggregation, peer, *job)
    sinks = _sinks(out.tensorboard, out.wandb)
    secret, where = _secret(peer.secret_file, swarm.run_id, create=not initial)
    _setup_logging(peer.verbose)  # once the input checked: a refused command changes nothing
    if command is not None:
        _launch(initial, command, swarm_cfg, secret, where, host=peer.host, port=peer.port, announce=peer.announce,
                address_file=peer.address_file, metrics=out.metrics, sinks=sinks, checkpoint_dir=job_cfg.checkpoint_dir,
                checkpoint_every=job_cfg.checkpoint_every, max_restarts=peer.max_restarts, wait_for=job_cfg.wait_for,
                shard=job_cfg.shard)
    swarm_cfg = replace(swarm_cfg, secret=secret)
    _run_peer(initial, host=peer.host, port=peer.port, announce=peer.announce, address_file=peer.address_file,
              metrics=out.metrics, status_file=peer.status_file, swarm_cfg=swarm_cfg, job=job_cfg, secret_from=where,
              quiet=out.quiet, sinks=sinks)


@app.command()
@command(JobOptions.defaults(rounds=DEMO_JOB.rounds, inner_steps=DEMO_JOB.inner_steps), ModelOptions, RunOptions,
         StreamingOptions, AggregationOptions.defaults(compression=DEMO_COMPRESSION), OutputOptions)
def demo(job: JobOptions, model: ModelOptions, run: RunOptions, streaming: StreamingOptions,
         aggregation: AggregationOptions, out: OutputOptions,
         peers: int = typer.Option(4, help="Peers to run on this machine."),
         json_path: Optional[Path] = typer.Option(None, "--json", help="Write the final summary as JSON here."),
         workdir: Optional[Path] = LabWorkdir,
         live: bool = typer.Option(True, help="Show the live view on a terminal (off: plain progress lines)."),
         ) -> None:
    """Run a local swarm of PEERS processes on 127.0.0.1 training the bundled model, with a live view.
    --metrics collects every peer's round lines (each with its 'peer')."""
    from .demo import DemoConfig, run_demo

    try:
        cfg = DemoConfig(peers=peers, job=job_config(job, model, run, streaming), swarm=aggregation.config())
    except ConfigError as e:
        _fail(str(e))
    code = run_demo(cfg, workdir=workdir, metrics=out.metrics, json_path=json_path, live=live, quiet=out.quiet,
                    sinks=_sinks(out.tensorboard, out.wandb))
    raise typer.Exit(code)


@app.command()
@command(JobOptions, ModelOptions, RunOptions, StreamingOptions, AggregationOptions)
def simulate(
    job: JobOptions, model: ModelOptions, run: RunOptions, streaming: StreamingOptions, aggregation: AggregationOptions,
    workers: int = typer.Option(4, help="Workers (M), all in this process on an in-process network."),
    bandwidth_mbit: float = typer.Option(100.0, help="Projected link of each worker, Mbit/s per direction."),
    latency_ms: float = typer.Option(50.0, help="Projected one-way latency between workers, ms."),
    step_seconds: Optional[float] = typer.Option(None, help="Compute time of an inner step (default: measured here)."),
    speeds: Optional[str] = typer.Option(None, help="Relative worker speeds, comma-separated (e.g. 1,1,1,0.5)."),
    loss: float = typer.Option(0.0, help="Projected packet loss rate of every link (caps TCP throughput)."),
    link: List[str] = typer.Option([], help="One worker's own link, W=MBIT:MS[:LOSS] (e.g. 3=20:150:0.01); repeatable."),
    round_overhead_ms: float = typer.Option(0.0, help="What a round takes on the workers' own machines beyond its "
                                                      "time on the link, ms (measured there, e.g. by `diloco bench "
                                                      "hetero`); 0: the link alone."),
    regions: Optional[str] = typer.Option(None, help="The region of each worker, comma-separated (e.g. eu,eu,us,us): "
                                                     "rounds inside each region, merges between them "
                                                     "(docs/REGIONS.md); the links above are then those between "
                                                     "regions."),
    region_link: List[str] = typer.Option([], help="The link inside one region, NAME=MBIT:MS[:LOSS] (e.g. "
                                                   "eu=1000:5); repeatable; default: the workers' own links."),
    merge_every: int = typer.Option(4, help="With --regions: region rounds between two merges."),
    topology: str = typer_option(SwarmOptions, "topology"),
    gossip_group: int = typer_option(SwarmOptions, "gossip_group"),
    faults: Optional[str] = typer.Option(None, help="Fault plan: a JSON file (docs/SIMULATE.md), or random:N for N "
                                                     "faults drawn from --seed."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the summary as JSON here."),
    quiet: bool = Quiet,
) -> None:
    """Simulate a swarm of WORKERS in this process (the real round protocol, codecs, fragments and outer
    optimizer) and project wall clock, blocking and compute utilization onto the given links."""
    import json

    from ..progress import Reporter
    from ..sim.faults import load_plan, random_plan
    from ..sim.simulate import NetworkModel, parse_link, parse_region_link, simulate as run_simulation

    try:
        speed_list = tuple(float(v) for v in speeds.split(",")) if speeds else ()
    except ValueError:
        _fail(f"--speeds must be comma-separated numbers, got {speeds!r}")
    try:
        swarm_cfg = aggregation.config(run_id="simulate", merge_every=merge_every, topology=topology,
                                       gossip_group=gossip_group)
        job_cfg = job_config(job, model, run, streaming)
    except ConfigError as e:
        _fail(str(e))
    rounds, fragments, seed = job_cfg.rounds, job_cfg.fragments, run.seed
    try:
        net = NetworkModel(bandwidth_mbit=bandwidth_mbit, latency_ms=latency_ms, loss=loss, step_seconds=step_seconds,
                           speeds=speed_list, links=tuple(parse_link(x) for x in link),
                           region_links=tuple(parse_region_link(x) for x in region_link),
                           round_overhead_ms=round_overhead_ms)
        region_list = tuple(r.strip() for r in regions.split(",")) if regions else ()
        if workers < 1 or (speed_list and len(speed_list) != workers):
            raise ConfigError(f"--workers must be >= 1 and --speeds must list one speed per worker ({workers})")
        if faults and faults.startswith("random:"):
            count = faults.removeprefix("random:")
            if not count.isdigit():
                raise ConfigError(f"--faults random:N needs a count, got {faults!r}")
            plan = random_plan(seed, workers, rounds * fragments, int(count))
        else:
            plan = load_plan(faults, workers) if faults else []
    except ConfigError as e:
        _fail(str(e))
    try:
        with Reporter.for_command(quiet=quiet) as rep, rep.task("simulate") as task:
            summary = run_simulation(job_cfg, workers, swarm=swarm_cfg, net=net, faults=plan, progress=task.update,
                                     regions=region_list)
    except ConfigError as e:
        _fail(str(e))
    for fault in summary["faults_fired"]:
        typer.echo(f"fault fired: {fault}")
    p = summary["projection"]
    states = f"digest {summary['digest']}" if topology != "gossip" else \
        f"{len(summary['digests'])} states (gossip: each worker steps its own)"
    typer.echo(f"{workers} workers, round {summary['round']}: held-out loss {summary['eval_loss']:.4f} (worker 0), "
               f"{states}, {summary['bytes_sent'] / 1e6:.2f} MB sent, "
               f"{summary['bits_per_param_sync']:.3f} bits/param/sync ({summary['wall_seconds']:.1f} s here)")
    if region_list:
        inside = ", ".join(f"{name} {ln.bandwidth_mbit:g} Mbit/s {ln.latency_ms:g} ms" for name, ln in net.region_links)
        inside = inside or "inside: the workers' own links"
        typer.echo(f"projected with regions ({inside}; between: {bandwidth_mbit:g} "
                   f"Mbit/s, {latency_ms:g} ms) at {summary['step_seconds']:.4f} s a step: wall {p['wall_seconds']:.1f} s, "
                   f"{p['merges']} merges taking {p['merge_seconds']:.1f} s, downloads {p['download_seconds']:.1f} s, "
                   f"compute utilization {p['min_utilization']:.1%} (least busy worker)")
    else:
        typer.echo(f"projected on {bandwidth_mbit:g} Mbit/s, {latency_ms:g} ms links at {summary['step_seconds']:.4f} s "
                   f"a step: wall {p['wall_seconds']:.1f} s, blocked {p['blocked_seconds']:.1f} s, "
                   f"compute utilization {p['min_utilization']:.1%} (least busy worker)")
    if json_path:
        json_path.write_text(json.dumps(summary, indent=2) + "\n")


@app.command()
def status(
    addresses: List[str] = typer.Argument(..., help="Address(es) of any peer of the swarm, tried in order."),
    run_id: str = RunId,
    secret_file: Optional[Path] = typer.Option(None, "--secret-file", help="The swarm's secret file (or set "
                                               "DILOCO_SECRET): its DHT answers only peers that hold it."),
    interval: float = typer.Option(2.0, help="Seconds between the two reads that measure rates (with --watch: "
                                             "between refreshes)."),
    watch: bool = typer.Option(False, "--watch", help="Keep reading and showing the swarm every --interval seconds "
                                                      "(a live table on a terminal, plain lines elsewhere) until "
                                                      "Ctrl-C."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table (with --watch: one line per "
                                                         "refresh)."),
) -> None:
    """Who is in the swarm at ADDRESSES: status, round, inner steps per second, loss, bandwidth, compute
    utilization, last heartbeat."""
    import json

    from rich.console import Console

    from . import statusview
    from .status import observe
    from ..comms.faults import clock_from_env
    from ..connect import SwarmError, validate_addrs

    try:
        validate_addrs(addresses)
    except SwarmError as e:
        command = [a for a in addresses if not a.startswith("/")]
        _fail(str(e) + (f"; to run your own command as this site's worker, put `--` before it: diloco join ADDR "
                        f"[OPTIONS] -- {' '.join(command)}" if command and command != addresses else ""))
    if interval <= 0:
        _fail("--interval must be > 0 seconds")
    secret, _ = _secret(secret_file, run_id, create=False)
    clock_from_env()  # tests: this machine's wall clock stepped
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    if watch:
        _watch(addresses, run_id, secret, interval, json_out)
        return
    try:
        rows = observe(addresses, run_id, secret, interval=interval)
    except RuntimeError as e:
        _fail(str(e), code=1)
    if json_out:
        typer.echo(json.dumps([r.to_json() for r in rows], indent=2))
        return
    Console(width=max(Console().width, 170)).print(statusview.table(rows, run_id))
    if not rows:
        typer.echo(f"no peer records for run {run_id!r} (wrong --run-id?)", err=True)


def _watch(addresses: List[str], run_id: str, secret: str, interval: float, json_out: bool) -> None:
    """`diloco status --watch`: a rich Live table on a terminal, else plain lines (or JSON lines); Ctrl-C
    (or SIGTERM) ends it with status 0."""
    from rich.console import Console
    from rich.live import Live

    from . import statusview
    from .status import PeerStatus, swarm_time, watch

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    console = Console(width=max(Console().width, 170))
    live = None if json_out or not sys.stdout.isatty() else Live(console=console, auto_refresh=False)

    def show(rows: list[PeerStatus]) -> None:
        now = swarm_time()  # the time the rows' heartbeat ages are read on
        if json_out:
            typer.echo(statusview.json_line(rows, now))
        elif live is not None:
            live.update(statusview.table(rows, run_id, caption=f"every {interval:g} s; Ctrl-C to stop"), refresh=True)
        else:
            typer.echo("\n".join(statusview.lines(rows, run_id, now)))
        sys.stdout.flush()

    try:
        if live is not None:
            live.start()
        watch(addresses, run_id, secret, show, interval=interval, stop=stop)
    except RuntimeError as e:
        _fail(str(e), code=1)
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()


@app.command()
def plot(
    runs: List[Path] = typer.Argument(..., help="Metrics files (JSON lines written by --metrics), one or more."),
    out: Path = typer.Option(Path("plots"), "--out", help="Folder to write the PNG files to."),
    metric: str = typer.Option("loss", help="What to plot: a numeric field of the round lines (loss, eval_loss, "
                                            "utilization, seconds, ...)."),
) -> None:
    """Draw RUNS' curves: METRIC against tokens (or inner steps), bytes on the wire and wall-clock time, one
    curve per peer, as PNG files in --out."""
    from ..bench.curves import Run, plot_runs
    from ..metrics import read_jsonl
    from ..bench.plot import PlotError, require_matplotlib

    missing = [str(p) for p in runs if not p.is_file()]
    if missing:
        _fail(f"no such metrics file: {', '.join(missing)} (write one with --metrics PATH)")
    try:
        require_matplotlib()
        names = [p.stem for p in runs]
        loaded = [Run(p.stem if names.count(p.stem) == 1 else str(p), read_jsonl(p)) for p in runs]
        written = plot_runs(loaded, out, metric)
    except PlotError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot write the plots to {out}: {e}", code=1)
    for path in written:
        typer.echo(f"wrote {path}")


@app.command()
def export(
    checkpoint_dir: Path = typer.Argument(..., help="A run's --checkpoint-dir (its newest verified checkpoint)."),
    out: Path = typer.Argument(..., help="The safetensors file to write."),
) -> None:
    """Write the global model of the newest verified checkpoint in CHECKPOINT_DIR as a plain state dict OUT
    (safetensors): each parameter under the model's name, tied ones under each name, for `load_state_dict` or
    `from_pretrained`."""
    from ..checkpoint import CheckpointError
    from ..persist import export as export_model

    if not checkpoint_dir.is_dir():
        _fail(f"no such checkpoint directory: {checkpoint_dir} (a run's --checkpoint-dir)")
    try:
        target, loaded = export_model(checkpoint_dir, out)
    except CheckpointError as e:
        _fail(str(e), code=1)
    except OSError as e:
        _fail(f"cannot write {out}: {e}", code=1)
    typer.echo(f"wrote {target}: the global model of round {loaded.step} ({loaded.path.name})")


bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks (results: docs/BENCHMARKS.md).")
app.add_typer(bench_app, name="bench")


@bench_app.command("codecs")
def bench_codecs_cmd(
    specs: Optional[List[str]] = typer.Option(None, "--spec", help="Pipeline to measure (repeatable; default: all)."),
    sizes: List[int] = typer.Option([16 << 20, 64 << 20], "--size", help="Elements per input (repeatable)."),
    inputs: List[str] = typer.Option(["gaussian", "demo"], "--input", help="gaussian and/or demo (repeatable)."),
    repeats: int = typer.Option(3, help="Runs per measurement; the median is reported."),
    threads: int = typer.Option(2, help="torch CPU threads."),
    device: str = typer.Option("cpu", help="Where the inputs are: cpu, or cuda (encoding then includes what "
                                           "crosses to the host; auto: cuda if there is one)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Write torch.profiler and cProfile tables of one "
                                                                   "encode and one decode of each pipeline here."),
    quiet: bool = Quiet,
) -> None:
    """Encode/decode speed (as a ratio to torch.clone), bits/param and error of each pipeline."""
    import platform

    import torch
    from rich.console import Console

    from ..bench.codecs import DEFAULT_SPECS, CodecResult, bench_codecs, make_inputs, markdown_table, write_json
    from ..bench.devices import device_name
    from ..progress import Reporter
    from diloco.compression.pipeline import parse

    specs = list(specs or DEFAULT_SPECS)
    for spec in specs:
        try:
            parse(spec)
        except ValueError as e:
            _fail(f"--spec {spec!r}: {e}")
    bad = [k for k in inputs if k not in ("gaussian", "demo")]
    if bad or not inputs:
        _fail(f"--input must be gaussian or demo, got {bad or inputs}")
    if repeats < 1 or any(n < 1 for n in sizes):
        _fail("--repeats and --size must be >= 1")
    where = _device(device)
    torch.set_num_threads(threads)
    console = Console()
    with Reporter.for_command(quiet=quiet) as rep, \
            rep.task("codecs", total=len(specs) * len(sizes) * len(inputs), unit="runs") as task:
        task.update(status="making the inputs" + (" (25 training steps for the demo input)" if "demo" in inputs else ""))
        data = make_inputs(sizes, inputs)
        task.update(status=f"{repeats} repeat{'s' if repeats != 1 else ''} of each pipeline")

        def measured(r: CodecResult) -> None:
            rep.say(f"{r.input:>14} {r.spec:<32} {r.bits_per_param:8.4f} bits/param  err {r.rel_l2_error:.4f}  "
                    f"encode {r.encode_x:6.1f}× clone  decode {r.decode_x:6.1f}× clone")
            task.advance()

        results = bench_codecs(specs, data, repeats, progress=measured, device=str(where), profile=profile)
    console.print(markdown_table(results), markup=False, soft_wrap=True)
    if json_path:
        write_json(results, json_path, {"machine": platform.machine(), "threads": threads, "repeats": repeats,
                                        "torch": torch.__version__, "cores": os.cpu_count(),
                                        "device": device_name(where)})


@bench_app.command("convergence")
@command(ModelOptions)
def bench_convergence_cmd(
    model: ModelOptions,
    workers: List[int] = typer.Option([4], help="Workers (M) of every variant; repeat it to run several M, each "
                                               "against its own data-parallel baseline."),
    steps: int = typer.Option(400, help="Inner steps per worker (the token budget); a multiple of every variant's H."),
    variant: List[str] = typer.Option(list(("h50", "h100", "streaming", "sparse")), help=(
        "Variants to run, by name (h50, h100, streaming, sparse), each optionally with knobs changed: "
        "'h50,outer_lr=0.5,outer_momentum=0.8', 'sparse,H=20' (knobs: H, compression, fragments, overlap, alpha, "
        "outer_lr, outer_momentum, outer_warmup, lr, h_schedule: 80:10 or 80:10+95:5). Repeat it.")),
    data_parallel_only: bool = typer.Option(False, "--data-parallel-only", help="Run only the data-parallel "
                                            "baselines (e.g. to extend an lr sweep), no variant."),
    dp_lr: List[float] = typer.Option([], help="Inner lr of data-parallel training; repeat it to tune over several "
                                              "(gaps are to the best). Default: --lr."),
    lr: float = typer.Option(2e-3, help="Inner AdamW lr of the DiLoCo workers."),
    warmup: int = typer.Option(20, help="Inner steps of linear lr warmup (data-parallel and workers alike)."),
    schedule: str = typer.Option("constant", help="Inner lr after the warmup, for data-parallel and workers alike: "
                                                  "constant, or cosine (down to lr/10 at the last step)."),
    threads: int = typer.Option(1, help="torch CPU threads per worker (data-parallel: M times as many, up to the cores)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    plots_dir: Optional[Path] = typer.Option(None, "--plots", help="Evaluate during training and write PNG plots "
                                                                  "(loss vs tokens, loss vs bytes) into this folder."),
    replot: Optional[Path] = typer.Option(None, "--replot", help="Do not train: draw the --plots of a result written "
                                                                "by --json (it must hold curves, from a run with --plots)."),
    quiet: bool = Quiet,
) -> None:
    """B1: held-out loss and bytes of DiLoCo variants against synchronous data-parallel training."""
    import platform

    import torch
    from rich.console import Console

    from ..bench.convergence import check_budget, markdown_table, parse_variant, plots, replot_rows, run, write_json
    from ..bench.plot import PlotError, require_matplotlib
    from ..progress import Reporter

    if replot is not None and plots_dir is None:
        _fail("--replot draws plots: give the folder to write them to with --plots DIR")
    try:
        job = job_config(model, threads=threads, lr=lr, warmup=warmup, schedule=schedule)
        chosen = () if data_parallel_only else tuple(parse_variant(v) for v in variant)
        if plots_dir is not None:
            require_matplotlib()  # before a run of minutes, not after it
    except (ConfigError, PlotError, ValueError) as e:
        _fail(str(e))
    if min(workers) < 1 or steps < 1:
        _fail(f"--workers must be >= 1 and --steps >= 1, got {workers} and {steps}")
    try:
        for v in chosen:
            check_budget(v, steps)
    except ValueError as e:
        _fail(str(e))
    bad_lr = [x for x in dp_lr if not 0 < x < 1]
    if bad_lr:
        _fail(f"--dp-lr must be in (0, 1), got {bad_lr[0]}")
    console = Console()
    if replot is not None and plots_dir is not None:
        try:
            rows, tokens_per_step = replot_rows(replot)
            written = plots(rows, plots_dir, tokens_per_step)
        except (OSError, ValueError, KeyError, PlotError) as e:
            _fail(f"cannot replot {replot}: {type(e).__name__}: {e}", code=1)
        for path in written:
            console.print(f"wrote {path}", markup=False)
        return
    rows = []
    with Reporter.for_command(quiet=quiet) as rep:
        for m in workers:
            rows += run(job, m, steps, chosen, progress=lambda r: rep.say(
                f"M={r['workers']} {r['variant']:<36} held-out loss {r['eval_loss']:.4f}  "
                f"{r['bytes_sent'] / 1e6:10.1f} MB  ({r['wall_seconds']:.0f} s)"), curves=plots_dir is not None,
                reporter=rep, dp_lrs=dp_lr)
    console.print(markdown_table(rows), markup=False, soft_wrap=True)
    if plots_dir is not None:
        for path in plots(rows, plots_dir, job.batch_size * job.context):
            console.print(f"wrote {path}", markup=False)
    if json_path:
        write_json(rows, json_path, {"workers": workers if len(workers) > 1 else workers[0], "steps": steps,
                                     "batch_size": job.batch_size, "d_model": job.d_model, "layers": job.n_layer,
                                     "context": job.context, "lr": lr, "dp_lrs": dp_lr or [lr], "warmup": warmup,
                                     "schedule": schedule, "variants": variant, "threads": threads,
                                     "torch": torch.__version__, "machine": platform.machine(),
                                     "cores": os.cpu_count()})


@bench_app.command("wrapper")
@command(ModelOptions)
def bench_wrapper_cmd(
    model: ModelOptions,
    inner_steps: List[int] = typer.Option([50, 100, 500], "--inner-steps", "-H", help="H of the wrapped runs; repeat "
                                                                                       "it."),
    steps: int = typer.Option(500, help="Timed inner steps per run (after 20 untimed)."),
    repeats: int = typer.Option(3, help="Runs of each H (each steps the bare and the wrapped loop in turns); "
                                                   "the median is reported."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: 1 for a model on the CPU; for a "
                                                     "model on a GPU torch's own, one a core, as in your process: "
                                                     "the host's cores step θ kept in host memory)."),
    compression: str = typer.Option("fp32", help="Compression of the local synchronization."),
    device: str = typer.Option("cpu", help="Where the model trains: cpu, cuda, cuda:N (auto: cuda if there is one)."),
    global_device: str = typer.Option("cpu", help="Where the wrapper keeps θ and the outer state (its default: "
                                                  "host memory; cuda keeps them next to the model)."),
    flush_denormal: bool = typer.Option(True, help="Flush subnormal floats to zero in both loops: on a CPU, "
                                                   "DiLoCo's weights meet subnormals that plain training's do not "
                                                   "(docs/BENCHMARKS.md, B5)."),
    loops: bool = typer.Option(True, help="Time the training loops (bare and each H); --no-loops times only the "
                                          "synchronization against its floor (a large model trains slowly on a CPU)."),
    checkpoints: bool = typer.Option(False, "--checkpoints", help="Also time a synchronization that makes a "
                                     "periodic checkpoint due (written beside training) against the same checkpoint "
                                     "written on the training thread (into a temporary directory)."),
    autocast: bool = typer.Option(False, "--autocast", help="Forward passes under bf16 autocast (fp32 weights), in "
                                  "both loops, as large models train on a GPU."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Write a torch.profiler table of the timed "
                                           "synchronizations' rounds here (operators by time; GPU kernels too)."),
    json_path: Optional[Path] = ReportJson,
    quiet: bool = Quiet,
) -> None:
    """B5: the wrapper's cost per inner step, against the bare loop, and a synchronization's time on the training
    thread against the floor measured in the same process (one process, no network; --d-model 768 --layers 12
    is 85M parameters)."""
    import platform

    import torch
    from rich.console import Console

    from ..bench.devices import device_name
    from ..bench.wrapper import WrapperSetup, checkpoint_table, markdown_table, run, sync_table, write_json
    from ..progress import Reporter

    if steps < 1 or repeats < 1 or min(inner_steps) < 1:
        _fail(f"--steps, --repeats and every -H must be >= 1, got {steps}, {repeats}, {inner_steps}")
    where, global_where = _device(device), _device(global_device, "--global-device")
    if threads is None:
        threads = 1 if where.type == "cpu" else torch.get_num_threads()
    try:
        setup = WrapperSetup(job=job_config(model, threads=threads), inner_steps=tuple(inner_steps), steps=steps,
                             repeats=repeats, compression=compression, device=str(where),
                             global_device=str(global_where), flush_denormal=flush_denormal,
                             checkpoints=checkpoints, autocast=autocast, profile=profile)
        CollectiveConfig(compression=compression)
    except ConfigError as e:
        _fail(str(e))
    with Reporter.for_command(quiet=quiet) as rep, rep.task("wrapper", unit="runs") as task:
        report = run(setup, tick=lambda done, total, status: task.update(done, total, status), loops=loops)
    if loops:
        Console().print(markdown_table(report), markup=False, soft_wrap=True)
    Console().print(sync_table(report["sync"]), markup=False, soft_wrap=True)
    if checkpoints:
        Console().print(checkpoint_table(report["checkpoint"]), markup=False, soft_wrap=True)
    if json_path:
        write_json(report, json_path, {"inner_steps": inner_steps, "steps": steps, "repeats": repeats,
                                       "threads": threads, "compression": compression,
                                       "flush_denormal": flush_denormal, "autocast": autocast,
                                       "batch_size": setup.job.batch_size, "context": setup.job.context,
                                       "d_model": setup.job.d_model, "layers": setup.job.n_layer,
                                       "params": report["params"], "torch": torch.__version__,
                                       "machine": platform.machine(), "cores": os.cpu_count(),
                                       "device": device_name(where), "global_device": str(global_where)})


@bench_app.command("transfer")
@command(ModelOptions)
def bench_transfer_cmd(
    model: ModelOptions,
    device: str = typer.Option("auto", help="Where the model lives: auto (cuda if there is one), cpu, cuda, cuda:N."),
    repeats: int = typer.Option(5, help="Runs of each move; the median is reported."),
    json_path: Optional[Path] = ReportJson,
) -> None:
    """What a synchronization moves between the model's device and the global state in host memory: Δ to the
    host, θ back (pageable and pinned), against forming Δ on the device."""
    import platform

    import torch
    from rich.console import Console

    from ..bench.transfer import TransferSetup, markdown_table, run
    from ..bench.wrapper import write_json  # the same report file as bench wrapper's: {"setup": ..., **report}
    from ..job.model import GPTConfig

    if repeats < 1:
        _fail(f"--repeats must be >= 1, got {repeats}")
    where = _device(device)
    try:
        cfg = job_config(model)
    except ConfigError as e:
        _fail(str(e))
    report = run(TransferSetup(GPTConfig(context=cfg.context, d_model=cfg.d_model, n_layer=cfg.n_layer),
                               device=str(where), repeats=repeats))
    Console().print(markdown_table(report), markup=False, soft_wrap=True)
    if json_path:
        write_json(report, json_path, {"d_model": cfg.d_model, "layers": cfg.n_layer, "repeats": repeats,
                                       "torch": torch.__version__, "machine": platform.machine()})


@bench_app.command("overlap")
def bench_overlap_cmd(
    peers: int = typer.Option(2, help="Peers, each in its own network namespace."),
    rate: float = typer.Option(1.0, help="Link rate per host, Mbit/s (1 Mbit/s for 1.85M parameters is like 1 Gbit/s for 1.85B)."),
    delay: float = typer.Option(50.0, help="One-way delay per link, ms."),
    inner_steps: int = typer.Option(60, "--inner-steps", "-H", help="Inner steps per outer step (H)."),
    outer_steps: int = typer.Option(3, help="Outer steps per variant."),
    fragments: int = typer.Option(4, help="Fragments of the streaming variants."),
    tau: int = typer.Option(10, help="Overlap (tau, inner steps) of the streaming + overlap variant."),
    compression: str = typer.Option("e3m0", help="Compression pipeline of every variant."),
    json_path: Optional[Path] = ReportJson,
    workdir: Optional[Path] = LabWorkdir,
    quiet: bool = Quiet,
) -> None:
    """B4: compute utilization of plain DiLoCo vs streaming + overlap on an emulated WAN link (needs root)."""
    from rich.console import Console

    from ..bench.overlap import OverlapSetup, markdown_table, run, write_json
    from ..progress import Reporter
    from ..fragments import FragmentError, StreamingConfig, check_schedule
    from ..bench.wan import WanError, check_privileges

    try:
        check_privileges()
        check_schedule(inner_steps, fragments, StreamingConfig(fragments=fragments, overlap=tau))
        CollectiveConfig(compression=compression)
    except (WanError, FragmentError, ConfigError) as e:
        _fail(str(e))
    if peers < 2 or outer_steps < 1 or rate <= 0 or delay < 0:
        _fail("--peers must be >= 2, --outer-steps >= 1, --rate > 0 and --delay >= 0")
    console = Console()
    setup = OverlapSetup(peers=peers, rate_mbit=rate, delay_ms=delay, inner_steps=inner_steps,
                         outer_steps=outer_steps, fragments=fragments, tau=tau, compression=compression)
    try:
        with Reporter.for_command(quiet=quiet) as rep, rep.task("overlap", unit="variants") as task:
            report = run(setup, workdir=workdir, progress=rep.say, tick=task.update)
    except (WanError, RuntimeError) as e:
        _fail(str(e), code=1)
    console.print(f"a full-model synchronization costs ~{report['full_sync_costs_inner_steps']} inner steps "
                  "on this link (plain DiLoCo's blocked time per round / time per inner step)")
    console.print(markdown_table(report), markup=False, soft_wrap=True)
    if json_path:
        write_json(report, json_path)


@bench_app.command("race")
def bench_race_cmd(
    peers: int = typer.Option(2, help="Peers of every racer, each in its own network namespace."),
    rate: float = typer.Option(10.0, help="Link rate per host, Mbit/s."),
    delay: float = typer.Option(50.0, help="One-way delay per link, ms."),
    dp_steps: int = typer.Option(400, help="Data-parallel steps; its final held-out loss is the finish line."),
    dp_lr: float = typer.Option(4e-3, help="Data-parallel's AdamW lr (4e-3: the best of 1e-3, 2e-3, 4e-3, 8e-3 at 400 steps, docs/BENCHMARKS.md)."),
    steps: int = typer.Option(2000, help="Inner steps each DiLoCo racer may take to reach the finish line."),
    lr: float = typer.Option(4e-3, help="The DiLoCo racers' inner AdamW lr."),
    inner_steps: int = typer.Option(50, "--inner-steps", "-H", help="H of the DiLoCo racers."),
    fragments: int = typer.Option(2, help="Fragments of the streaming racer."),
    tau: int = typer.Option(5, help="Inner steps a streaming exchange overlaps."),
    d_model: int = typer.Option(64, help="Model width (every racer)."),
    layers: int = LabLayers,
    context: int = typer.Option(64, help="Bytes of context."),
    json_path: Optional[Path] = ReportJson,
    plot_path: Optional[Path] = LossPlot,
    workdir: Optional[Path] = LabWorkdir,
    quiet: bool = Quiet,
) -> None:
    """The race on a slow link: data-parallel, DiLoCo and streaming DiLoCo on one emulated WAN (needs root),
    timed until each reaches data-parallel's final held-out loss."""
    from ..bench import race

    def setup() -> race.RaceSetup:
        return race.RaceSetup(peers=peers, rate_mbit=rate, delay_ms=delay, dp_steps=dp_steps, dp_lr=dp_lr,
                              steps=steps, lr=lr, inner_steps=inner_steps, fragments=fragments, tau=tau,
                              d_model=d_model, layers=layers, context=context)

    _lab_bench(race, setup, "race", "racers", json_path, plot_path, workdir, quiet)


_HETERO = HeteroSetup()  # the defaults of `bench hetero`, declared once there


@bench_app.command("hetero")
def bench_hetero_cmd(
    slowdowns: str = typer.Option("1,2,4", help="How many times as long each worker's inner step takes, one worker "
                                                "per host (the bench throttles them)."),
    rate: float = typer.Option(50.0, help="Link rate per host, Mbit/s."),
    delay: float = typer.Option(50.0, help="One-way delay per link, ms."),
    inner_steps: int = typer.Option(500, "--inner-steps", "-H", help="H of the fixed-H variants."),
    rounds: int = typer.Option(4, help="Rounds of the fixed-H run that waits for the slowest (the finish line)."),
    grace: float = typer.Option(1.0, help="Gather timeout of the fixed-H run that goes on without the slow, s."),
    overlap: int = typer.Option(50, help="τ of the overlapped rounds by time, inner steps of the fastest worker."),
    round_seconds: Optional[float] = typer.Option(None, help="A round by time, s (default: H × the fastest "
                                                             "worker's step time in the first run)."),
    compare: str = typer.Option(",".join(_HETERO.compared), help="The variants run after fixed H waiting for the "
                                "slowest (always first: the finish line), comma-separated: without (fixed H going "
                                "on without the slow), time (rounds by time), overlap (overlapped), adaptive."),
    lr: float = LabLr,
    d_model: int = LabWidth,
    layers: int = LabLayers,
    json_path: Optional[Path] = ReportJson,
    plot_path: Optional[Path] = LossPlot,
    workdir: Optional[Path] = LabWorkdir,
    quiet: bool = Quiet,
) -> None:
    """Workers of unequal speed on an emulated WAN (needs root): fixed H waiting for the slowest, fixed H going on
    without it, rounds by time (--round-seconds), plain and overlapped, and adaptive rounds (--adaptive), timed until
    each reaches the first one's final held-out loss."""
    from ..bench import hetero

    def setup() -> hetero.HeteroSetup:
        try:
            factors = tuple(float(s) for s in slowdowns.split(","))
        except ValueError:
            raise ValueError(f"--slowdowns {slowdowns!r}: expected numbers separated by commas, e.g. 1,2,4") from None
        return hetero.HeteroSetup(slowdowns=factors, rate_mbit=rate, delay_ms=delay, inner_steps=inner_steps,
                                  rounds=rounds, grace=grace, overlap=overlap, round_seconds=round_seconds, lr=lr,
                                  d_model=d_model, layers=layers,
                                  compared=tuple(c.strip() for c in compare.split(",") if c.strip()))

    _lab_bench(hetero, setup, "hetero", "variants", json_path, plot_path, workdir, quiet)


def _lab_bench(module: Any, setup: Callable[[], Any], task: str, unit: str, json_path: Optional[Path],
               plot_path: Optional[Path], workdir: Optional[Path], quiet: bool) -> None:
    """A benchmark of variants on one emulated WAN (`bench race`, `bench regions`): check root and the setup
    (exit 2 naming the fix) and matplotlib before minutes of runs, run `module.run`, print `module.markdown_table`,
    write the JSON and `module.plot`."""
    from rich.console import Console

    from ..bench.plot import PlotError, require_matplotlib
    from ..bench.race import write_json
    from ..bench.wan import WanError, check_privileges
    from ..progress import Reporter

    try:
        check_privileges()
        made = setup()
        if plot_path is not None:
            require_matplotlib()  # before minutes of runs, not after them
    except (WanError, ValueError, PlotError) as e:
        _fail(str(e))
    try:
        with Reporter.for_command(quiet=quiet) as rep, rep.task(task, unit=unit) as bar:
            report = module.run(made, workdir=workdir, progress=rep.say, tick=bar.update)
    except (WanError, RuntimeError) as e:
        _fail(str(e), code=1)
    console = Console()
    console.print(module.markdown_table(report), markup=False, soft_wrap=True)
    if json_path:
        write_json(report, json_path)
    if plot_path:
        console.print(f"wrote {module.plot(report, plot_path)}")


@bench_app.command("regions")
def bench_regions_cmd(
    regions: str = typer.Option("0,0,1,1", help="The region of each peer (one peer per host), e.g. 0,0,1,1."),
    rate: float = typer.Option(10.0, help="Each host's link inside its region, Mbit/s."),
    delay: float = typer.Option(5.0, help="One-way delay inside a region, ms."),
    cross_rate: float = typer.Option(1.0, help="Each host's link to the other regions, Mbit/s."),
    cross_delay: float = typer.Option(50.0, help="One-way delay between regions, ms."),
    steps: int = typer.Option(1000, help="Flat DiLoCo's inner steps per peer: its final loss is the finish line."),
    budget: int = typer.Option(1600, help="Inner steps per peer each regions variant may take to get there."),
    inner_steps: int = typer.Option(50, "--inner-steps", "-H", help="H of every variant."),
    merge_every: str = typer.Option("4,8", help="Region rounds between merges: a regions variant for each."),
    gossip: bool = typer.Option(True, help="Also run gossip (--topology gossip) for the same budget."),
    lr: float = LabLr,
    d_model: int = LabWidth,
    layers: int = LabLayers,
    json_path: Optional[Path] = ReportJson,
    plot_path: Optional[Path] = LossPlot,
    workdir: Optional[Path] = LabWorkdir,
    quiet: bool = Quiet,
) -> None:
    """Flat DiLoCo against regions (--region) and gossip (--topology gossip) on an emulated two-region network
    (needs root), timed until each reaches flat DiLoCo's final held-out loss (docs/REGIONS.md, docs/GOSSIP.md)."""
    from ..bench import regions as bench

    def setup() -> bench.RegionsSetup:
        try:
            hosts = tuple(int(r) for r in regions.split(","))
            merges = tuple(int(k) for k in merge_every.split(","))
        except ValueError:
            raise ValueError(f"--regions {regions!r} / --merge-every {merge_every!r}: expected numbers separated by "
                             "commas, e.g. 0,0,1,1 and 4,8") from None
        return bench.RegionsSetup(regions=hosts, rate_mbit=rate, delay_ms=delay, cross_rate_mbit=cross_rate,
                                  cross_delay_ms=cross_delay, steps=steps, budget=budget, inner_steps=inner_steps,
                                  merge_every=merges, gossip=gossip, lr=lr, d_model=d_model, layers=layers)

    _lab_bench(bench, setup, "regions", "variants", json_path, plot_path, workdir, quiet)


@bench_app.command("flood")
def bench_flood_cmd(
    peers: int = typer.Option(3, help="Peers of the swarm (real daemons on 127.0.0.1, one secret)."),
    numel: int = typer.Option(1 << 20, help="fp32 values each peer contributes a round."),
    rounds: int = typer.Option(20, help="Rounds per phase (quiet, flooded, quiet again)."),
    flooders: int = typer.Option(2, help="Processes without the secret flooding every peer."),
    concurrency: int = typer.Option(16, help="Calls each flooder keeps in flight per peer."),
    body_kib: int = typer.Option(1024, help="Body each flooding call declares, KiB."),
    patience: float = typer.Option(5.0, help="Seconds a flooding call waits for its answer before the flooder "
                                             "gives up on it and opens another."),
    tarpit: bool = typer.Option(True, help="Hold repeat refusals (comms/tarpit.py); --no-tarpit answers every "
                                           "refusal at once, the control."),
    pin: bool = typer.Option(True, help="Swarm on the first half of the cores, flooders on the rest (as if the "
                                        "attackers ran on their own machines)."),
    stalled: int = typer.Option(0, help="Instead of calls: each flooder opens this many streams to every peer and "
                                        "sends nothing on them (0: flood with calls)."),
    target: str = typer.Option("libp2p", help="Where the rounds go and the flood comes: libp2p (the daemons' port) "
                                              "or data (the direct data plane's port: a call is a handshake proving "
                                              "another swarm's key, a stalled stream a silent TCP connection)."),
    json_path: Optional[Path] = ReportJson,
    quiet: bool = Quiet,
) -> None:
    """Round time of a swarm while processes without its secret flood it with calls,
    or hold streams open without sending anything (--stalled), at the libp2p port or the data port (--target)."""
    from ..bench.flood import FloodSetup, markdown, run, write_json
    from ..progress import Reporter

    if peers < 2 or numel < 1 or rounds < 1 or flooders < 1 or concurrency < 1 or body_kib < 0 or patience <= 0 \
            or stalled < 0 or target not in ("libp2p", "data"):
        _fail("--peers must be >= 2; --numel, --rounds, --flooders and --concurrency >= 1; --body-kib and "
              "--stalled >= 0; --patience > 0; --target libp2p or data")
    with Reporter.for_command(quiet=quiet) as rep, rep.task("flood", unit="rounds") as task:
        report = run(FloodSetup(peers=peers, numel=numel, rounds=rounds, flooders=flooders, concurrency=concurrency,
                                body_kib=body_kib, patience=patience, tarpit=tarpit, pin=pin, stalled=stalled,
                                target=target),
                     progress=rep.say, tick=task.update)
    typer.echo(markdown(report))
    if json_path:
        write_json(report, json_path)


_CHAOS = ChaosSetup()  # the defaults of `bench chaos`, declared once there


@bench_app.command("chaos")
def bench_chaos_cmd(
    workers: int = typer.Option(_CHAOS.workers, help="Workers of the swarm (bundled-job peers, each on a host of "
                                                     "the WAN lab, or with --no-wan on 127.0.0.1; one secret; with "
                                                     "--site-ranks the last one is a torchrun site)."),
    seconds: float = typer.Option(_CHAOS.seconds, help="How long the faults go on (and the undisturbed baseline "
                                                       "runs)."),
    every: float = typer.Option(_CHAOS.every, help="Mean seconds between two faults."),
    seed: int = typer.Option(_CHAOS.seed, help="Seed of the fault plan (kinds, targets, times, durations)."),
    faults: Optional[str] = typer.Option(None, help="Kinds of faults, comma-separated (default: every kind; without "
                               "--wan every kind but the links'): kill (SIGKILL, "
                               "restarted from its checkpoint under the same identity), stop (SIGSTOP for a while), "
                               "leave (Ctrl-C, for good), join (a new worker), clock (a worker's wall clock steps 30 s "
                               "ahead or behind for a while), readonly and full (the checkpoint directory; root), "
                               "with --wan: partition (a minority cut off), flap, lossy, slow "
                               "(a worker's link), and with --regions: repkill (the next representative to merge, "
                               "right after its merge)."),
    restart_after: float = typer.Option(_CHAOS.restart_after, help="Seconds a killed worker stays down."),
    stop_max: float = typer.Option(_CHAOS.stop_seconds[1], help="Longest SIGSTOP, seconds (the shortest is 1)."),
    outage_max: float = typer.Option(_CHAOS.outage_seconds[1], help="Longest partition, lossy or slow link, "
                                     "read-only or full disk, seconds (the shortest is 5)."),
    wan: bool = typer.Option(_CHAOS.wan, help="Every worker on a host of its own in a WAN lab (root; the link "
                                              "faults need it); --no-wan: every worker on 127.0.0.1."),
    rate: float = typer.Option(_CHAOS.rate_mbit, help="With --wan: each host's link, Mbit/s."),
    delay: float = typer.Option(_CHAOS.delay_ms, help="With --wan: one-way delay of each link, ms."),
    regions: int = typer.Option(_CHAOS.regions, help="Regions of the swarm (worker i in region r<i mod N>, "
                                                     "docs/REGIONS.md); 0: a flat swarm."),
    gossip: bool = typer.Option(_CHAOS.gossip, "--gossip", help="The swarm gossips (--topology gossip, fp32; "
                                "docs/GOSSIP.md): no global state, so forks do not apply."),
    heal: float = typer.Option(_CHAOS.heal, help="Seconds after the last fault, everyone back, before the swarm "
                                                 "stops."),
    site_ranks: int = typer.Option(_CHAOS.site_ranks, help="The last worker is a site of this many ranks (the bundled "
                                   "model under torchrun, DDP on gloo, under the launcher): a kill SIGKILLs one rank "
                                   "and the launcher restarts the site, a stop freezes every rank; 0: lone workers."),
    job: str = typer.Option(" ".join(_CHAOS.job), help="Flags of the bundled job every worker runs (model, H, "
                                                       "timeouts)."),
    baseline: bool = typer.Option(True, help="Run the same swarm undisturbed first (goodput is against it)."),
    workdir: Optional[Path] = typer.Option(None, help="Keep the workers' logs, metrics and checkpoints here "
                                                      "(default: a temporary directory)."),
    json_path: Optional[Path] = ReportJson,
    quiet: bool = Quiet,
) -> None:
    """A real swarm under random faults (SIGKILL and restart, SIGSTOP, leaving, joining, a clock step, a read-only or
    full disk; with --wan partitions, flapping, lossy and slow links) against the same swarm undisturbed: goodput,
    time to the next commit and to each worker's return, stalls, forks. With no flags, the full soak (root): six
    workers, the last a 2-rank torchrun site, on the WAN lab for 20 minutes, a fault of any kind about every 15 s;
    without root: --no-wan --faults kill,stop,leave,join,clock."""
    import shlex
    import tempfile

    from ..bench.chaos import DISK_KINDS, KINDS, LINK_KINDS, REGION_KINDS, ROOTLESS_KINDS, markdown, run, write_json
    from ..progress import Reporter

    kinds = tuple(k.strip() for k in (faults or "").split(",") if k.strip())  # none given: the setup's default
    if faults is not None and not kinds or set(kinds) - set(KINDS) - set(REGION_KINDS):
        _fail(f"--faults {faults!r}: name kinds among {', '.join((*KINDS, *REGION_KINDS))}, comma-separated")
    if set(kinds) & set(REGION_KINDS) and not regions:
        _fail(f"--faults {faults!r}: {', '.join(REGION_KINDS)} hits a region's representative: add --regions N")
    if regions < 0 or regions == 1:
        _fail(f"--regions {regions}: give 2 or more regions, or 0 for a flat swarm")
    if gossip and regions:
        _fail("--gossip and --regions are two topologies: give one of them")
    if workers < 2 or seconds <= 0 or every <= 0 or restart_after < 0 or stop_max < 1 or heal < 0 or outage_max < 5:
        _fail("--workers must be >= 2; --seconds and --every > 0; --restart-after and --heal >= 0; --stop-max >= 1; "
              "--outage-max >= 5")
    if set(kinds) & set(LINK_KINDS) and not wan:
        _fail(f"--faults {faults!r}: {', '.join(LINK_KINDS)} are faults of the WAN lab's links: add --wan (root)")
    try:  # what the setup checks itself (--site-ranks), said as any refusal here; it fills in the default kinds
        setup = ChaosSetup(workers=workers, seconds=seconds, every=every, seed=seed, kinds=kinds,
                           restart_after=restart_after, stop_seconds=(1.0, stop_max), heal=heal,
                           outage_seconds=(5.0, outage_max), wan=wan, rate_mbit=rate, delay_ms=delay, regions=regions,
                           gossip=gossip, site_ranks=site_ranks, job=tuple(shlex.split(job)), baseline=baseline)
    except ValueError as e:
        _fail(f"{e}")
    if (wan or set(setup.kinds) & set(DISK_KINDS)) and os.geteuid() != 0:
        _fail("--wan (on by default) and the disk faults (readonly, full) need root (network namespaces, mounts): "
              "run as root, or without them: --no-wan --faults " + ",".join(ROOTLESS_KINDS))
    where = workdir or Path(tempfile.mkdtemp(prefix="diloco-chaos-"))
    with Reporter.for_command(quiet=quiet) as rep, rep.task("chaos", unit="s") as task:
        report = run(setup, where, progress=rep.say, tick=task.update)
    if json_path:
        write_json(report, json_path)
    typer.echo(markdown(report))
    typer.echo(f"logs, metrics and checkpoints: {where}")


@bench_app.command("size")
def bench_size_cmd(
    sizes: str = typer.Option("10M,30M,100M,300M", help="Model sizes, comma-separated (M = million parameters)."),
    codec: List[str] = typer.Option(["fp32", "e3m0"], "--codec", help="Compression of the rounds (repeatable)."),
    rounds: int = typer.Option(3, help="Rounds at each size (after the first, which both peers take together)."),
    part: str = typer.Option("all", help="rounds (round time and memory by size), catchup (a joiner's catch-up "
                                        "from 1, 2 and 3 peers on emulated links; needs root) or all."),
    catchup_params: str = typer.Option("25M", help="Model size for the catch-up part."),
    rate_mbit: float = typer.Option(200.0, help="Catch-up part: every host's uplink, Mbit/s."),
    json_path: Optional[Path] = ReportJson,
) -> None:
    """The sync path at size: round time, bytes and peak memory per peer of 2 real peers from 10M to 300M
    parameters (fp32, e3m0), and a joiner's catch-up time from 1, 2 and 3 serving peers on emulated links."""
    import json

    from ..bench.size import SizeSetup, markdown, run

    def count(text: str) -> int:
        text = text.strip().upper()
        return int(float(text[:-1]) * 1e6) if text.endswith("M") else int(text)

    if part not in ("rounds", "catchup", "all"):
        _fail(f"--part must be rounds, catchup or all, got {part!r}")
    try:
        size_list = tuple(count(x) for x in sizes.split(",")) if part != "catchup" else ()
        setup = SizeSetup(sizes=size_list, codecs=tuple(codec), rounds=rounds, catchup=part != "rounds",
                          catchup_params=count(catchup_params), rate_mbit=rate_mbit)
    except ValueError:
        _fail(f"--sizes and --catchup-params take counts like 10M or 2500000, got {sizes!r} / {catchup_params!r}")
    if rounds < 1 or any(n < 1 for n in setup.sizes):
        _fail("--rounds and every size must be >= 1")
    result = run(setup, say=lambda text: typer.echo(text, err=True))
    typer.echo(markdown(result))
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))


@bench_app.command("transport")
def bench_transport_cmd(
    peers: List[int] = typer.Option([2, 4, 8], "--peers", "-N", help="Peers of the loopback swarms (repeatable)."),
    payload_mb: List[float] = typer.Option([1.0, 10.0, 100.0], "--payload-mb",
                                           help="The model's fp32 size in MB (repeatable)."),
    rounds: int = typer.Option(3, help="Rounds timed at each point (after any taken before every peer was in)."),
    part: str = typer.Option("all", help="loopback (against plain TCP), wan (against an emulated link's rate; "
                                        "needs root) or all."),
    wan_peers: List[int] = typer.Option([2], "--wan-peers", help="Peers on the emulated WAN (repeatable)."),
    wan_payload_mb: float = typer.Option(20.0, help="The model's fp32 size on the emulated WAN, MB."),
    rate_mbit: float = typer.Option(50.0, help="Emulated WAN: every host's uplink, Mbit/s."),
    delay_ms: float = typer.Option(25.0, help="Emulated WAN: one-way delay, ms."),
    direct: bool = typer.Option(True, "--direct/--no-direct", help="The peers' rounds on the direct data plane (the "
                                "default), or every byte through libp2p (--no-direct)."),
    data_streams: int = typer.Option(SwarmConfig().data_streams, help="Direct connections a peer opens to one member "
                                     "at most (the peers' --data-streams)."),
    relay: bool = typer.Option(False, "--relay", help="Each point again through a relay: peer 0 serves as one, the "
                               "others wait there (--reach relay), so every call between two of them crosses peer 0 "
                               "(3 peers at least; docs/USAGE.md, \"Behind NAT\")."),
    json_path: Optional[Path] = ReportJson,
) -> None:
    """A round's goodput over the swarm's transport: N real peers on loopback against a plain TCP copy of the
    same bytes, and on an emulated WAN against the link's rate."""
    import json

    from ..bench.transport import TransportSetup, markdown, run

    if part not in ("loopback", "wan", "all"):
        _fail(f"--part must be loopback, wan or all, got {part!r}")
    loopback, wan = part != "wan", part != "loopback"  # the parts that run: only their options are checked
    sizes = [*(peers if loopback else []), *(wan_peers if wan else [])]
    payloads = [*(payload_mb if loopback else []), *([wan_payload_mb] if wan else [])]
    if rounds < 1 or any(n < 2 for n in sizes) or any(mb <= 0 for mb in payloads) or data_streams < 1:
        _fail("--rounds must be >= 1, every --peers/--wan-peers >= 2, every payload > 0 and --data-streams >= 1")
    if relay and (any(n < 3 for n in sizes) or not direct):
        _fail("--relay needs every --peers/--wan-peers >= 3 (a relayed pair besides the relay) and the data plane "
              "(not --no-direct)")
    if wan and (rate_mbit <= 0 or delay_ms < 0):
        _fail("--rate-mbit must be > 0 and --delay-ms >= 0")
    setup = TransportSetup(peers=tuple(peers), payload_mb=tuple(payload_mb), rounds=rounds, wan=wan,
                           loopback=loopback, wan_peers=tuple(wan_peers), wan_payload_mb=wan_payload_mb,
                           rate_mbit=rate_mbit, delay_ms=delay_ms, direct=direct, data_streams=data_streams,
                           relay=relay)
    result = run(setup, say=lambda text: typer.echo(text, err=True))
    typer.echo(markdown(result))
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))


@bench_app.command("site")
def bench_site_cmd(
    ranks: int = typer.Option(2, help="Ranks of the torchrun site (gloo)."),
    sharding: str = typer.Option("ddp", help="How the site holds the model: ddp (replicas) or fsdp (FSDP2 shards)."),
    width: int = typer.Option(512, help="Hidden width of the benchmark MLP (4 layers): how long a step takes."),
    inner_steps: int = typer.Option(20, "--inner-steps", "-H", help="Inner steps per round (H)."),
    steps: int = typer.Option(200, help="Inner steps timed per overhead run."),
    json_path: Optional[Path] = ReportJson,
    quiet: bool = Quiet,
) -> None:
    """A torchrun site as one worker: the wrapper's inner-step overhead, WAN bytes per round vs a lone
    process, and the time from a rank's crash to the restarted site's first committed round."""
    import json

    from ..bench.site import SiteSetup, markdown, run
    from ..progress import Reporter

    if ranks < 2 or width < 1 or inner_steps < 1 or steps < 1:
        _fail("--ranks must be >= 2; --width, --inner-steps and --steps >= 1")
    if sharding not in ("ddp", "fsdp"):
        _fail(f"--sharding must be ddp or fsdp, not {sharding!r}")
    with Reporter.for_command(quiet=quiet) as rep, rep.task("site", unit="stages") as task:
        result = run(SiteSetup(ranks=ranks, width=width, inner_steps=inner_steps, steps=steps, sharding=sharding),
                     say=rep.say, tick=task.update)
    typer.echo(markdown(result))
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))


def _command(ctx: typer.Context, max_restarts: int) -> list[str] | None:
    """The command after `--` (`main` takes it off the arguments), checked; exits 2 naming the fix."""
    from ..launcher import LaunchError, check_command

    command = (ctx.obj or {}).get("command") if ctx is not None else None
    extra = list(ctx.args) if ctx is not None else []
    if extra:
        _fail(f"unexpected argument(s) {' '.join(extra)!r}: to run your own command as this site's worker, put `--` "
              f"before it: diloco {ctx.info_name} [OPTIONS] -- {' '.join(extra)}")
    try:
        if command is not None:
            check_command(command, max_restarts)
        elif max_restarts:
            raise LaunchError("--max-restarts applies to a command of yours: add `-- CMD [ARGS...]`")
    except LaunchError as e:
        _fail(str(e))
    return command


def _unused_by_command(ctx: typer.Context, groups: tuple[Group, ...]) -> None:
    """Under `-- CMD`: an option of the bundled job given on the command line exits 2 (the command never sees it);
    one from a --config file is named in a warning (a lab's file may serve both)."""
    from .options import bundled_only, long_flag

    given: dict[str, list[str]] = {"COMMANDLINE": [], "DEFAULT_MAP": []}
    for group in groups:
        for name in sorted(bundled_only(type(group))):
            source = ctx.get_parameter_source(name)
            if source is not None and source.name in given:
                given[source.name].append(long_flag(type(group), name))
    if given["COMMANDLINE"]:
        _fail(f"{', '.join(given['COMMANDLINE'])}: the bundled job's, which your command never sees (it runs its own "
              "loop, model and schedule): drop them, or give your script what it needs (e.g. DiLoCo(model, opt, "
              "inner_steps=H) for -H). `diloco start --help` lists what reaches a command.")
    if given["DEFAULT_MAP"]:
        typer.echo(f"note: --config sets {', '.join(given['DEFAULT_MAP'])}, which only the bundled job reads: your "
                   "command does not see them", err=True)


def _launch(initial: list[str], command: list[str], swarm_cfg: SwarmConfig, secret: str, where: str, *,
            host: str, port: int, announce: Optional[List[str]], address_file: Optional[Path],
            metrics: Optional[Path], sinks: SinkConfig, checkpoint_dir: Optional[str], checkpoint_every: int,
            max_restarts: int, wait_for: int, shard: Optional[int]) -> NoReturn:
    """Run the user's `command` as this site's worker (`diloco.launcher`) and exit with its status."""
    import shlex
    import shutil

    from ..environment import Launch
    from ..lines import write_lines
    from ..launcher import Supervisor, free_port, private_copy, run_dir

    workdir = run_dir()
    try:
        secret_file = private_copy(workdir, "secret", secret) if where.startswith("$") else \
            where.removeprefix("created ")
        identity = swarm_cfg.identity_file or str(workdir / "identity.key")  # one peer id across restarts
        launch = Launch(swarm=replace(swarm_cfg, identity_file=identity), secret_file=secret_file,
                        peers=tuple(initial), host=host, port=port or free_port(host), announce=tuple(announce or ()),
                        wait_for=wait_for,
                        address_file=str(workdir / "address"), peers_file=str(workdir / "peers"),
                        metrics=str(metrics) if metrics else None, sinks=sinks,
                        checkpoint_dir=checkpoint_dir,
                        checkpoint_every=checkpoint_every, shard=shard, end_file=str(workdir / "end"))

        def on_address(addrs: list[str]) -> None:
            typer.echo(f"site peer {addrs[0].rsplit('/p2p/', 1)[-1]} in run {swarm_cfg.run_id!r}, swarm secret from "
                       f"{where}")
            for addr in addrs:
                typer.echo(f"  address: {addr}")
            typer.echo(f"end the whole run, every peer on one final model: kill -USR2 {os.getpid()}")
            if not initial:
                addr = next((a for a in addrs if "/127.0.0.1/" not in a), addrs[0])
                typer.echo("others join with:\n  " + _join_line(f"diloco join {addr} --run-id {swarm_cfg.run_id}",
                                                                  where) + f"\n  followed by -- {shlex.join(command)}")
            if line := _waiting_line(wait_for, first=not initial):
                typer.echo(line)
            if address_file:
                write_lines(address_file, addrs)

        code = Supervisor(command, launch, max_restarts=max_restarts, on_address=on_address).run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    raise typer.Exit(code)


def main(argv: Optional[List[str]] = None) -> None:
    """The `diloco` entry point. Everything after the first `--` is the user's command (start / join)."""
    from ..launcher import split_command

    args, command = split_command(sys.argv[1:] if argv is None else argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack on stderr
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Ctrl-C stops every command, whatever the process inherited: one started while its parent ignored SIGINT
        # (C's system() does, for as long as it runs; a shell, for a job it starts with &) begins with it ignored,
        # and Python then never installs its KeyboardInterrupt (seen: tests/test_status.py, parallel workers)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if command is not None and not (args and args[0] in ("start", "join")):
        typer.echo("error: only `diloco start` and `diloco join` run a command of yours (`-- CMD`); "
                   "e.g. diloco start -- python train.py", err=True)
        sys.exit(2)
    app(args=args, obj={"command": command}, prog_name="diloco")


if __name__ == "__main__":
    main()
