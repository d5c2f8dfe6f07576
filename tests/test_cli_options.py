"""Each knob declared once (diloco/cli/options.py): the option groups the commands share, their defaults
taken from the configurations they feed, and the flags the demo hands its peers read back to the same job."""

from __future__ import annotations

import difflib
import logging
from dataclasses import fields
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from diloco import RobustConfig
from diloco.cli import main
from diloco.cli.demo import DEMO_JOB, DemoConfig, peer_command, peer_device
from diloco.cli.options import (AggregationOptions, JobOptions, ModelOptions, PeerJobOptions, PeerOptions, RunOptions,
                                StreamingOptions, SwarmOptions, command, docs_of, flags, help_of,
                                option)
from diloco.comms import CollectiveConfig
from diloco.config import SwarmConfig
from diloco.fielddocs import field_docs
from diloco.fragments import StreamingConfig
from diloco.job.train import JobConfig

pytestmark = pytest.mark.unit


class _Stop(Exception):
    pass


def _configs_of(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> tuple[SwarmConfig, JobConfig]:
    """What `diloco ARGS` would run a peer with (stopped before any network I/O)."""
    seen: dict[str, Any] = {}

    def stop(initial: list[str], **kw: Any) -> None:
        seen.update(kw, initial=initial)
        raise _Stop

    monkeypatch.setattr(main, "_run_peer", stop)
    monkeypatch.setenv("DILOCO_SECRET", "s" * 43)
    result = CliRunner().invoke(main.app, args, obj={})
    assert isinstance(result.exception, _Stop), result.output
    return seen["swarm_cfg"], seen["job"]


def test_a_default_is_declared_once_in_the_configuration_the_option_feeds(monkeypatch):
    swarm, job = _configs_of(monkeypatch, ["start"])
    assert (swarm.round.gather_timeout, swarm.round.result_timeout, swarm.round.reduce_timeout) == \
        (CollectiveConfig().gather_timeout, CollectiveConfig().result_timeout, CollectiveConfig().reduce_timeout)
    assert swarm == SwarmConfig(secret=swarm.secret)  # every swarm default is the config's own
    assert job == JobConfig()


GROUPS = (AggregationOptions, SwarmOptions, PeerOptions, ModelOptions, JobOptions, RunOptions, PeerJobOptions,
          StreamingOptions)


def test_a_settings_help_is_written_once_the_docstring_of_its_configuration_field():
    """An option without help of its own shows its configuration field's docstring (`diloco start --help` prints
    it); an option with its own help does not repeat that docstring (a near copy fails here: write it once, in the
    field's docstring, unless the command line needs other words)."""
    own = 0
    for group in GROUPS:
        docs = docs_of(group)
        for f in fields(group):
            if f.metadata["help"] is None:
                assert help_of(group, f.name) == docs[f.name]
            elif f.name in docs:
                own += 1
                ratio = difflib.SequenceMatcher(None, f.metadata["help"], docs[f.name]).ratio()
                assert ratio < 0.8, (group.__name__, f.name, f.metadata["help"], docs[f.name])
    assert own < 10  # the few that name other flags or a format of the command line's own
    shown = " ".join(CliRunner().invoke(main.app, ["start", "--help"], env={"COLUMNS": "400"}).output.split())
    assert field_docs(CollectiveConfig)["gather_timeout"] in shown and field_docs(StreamingConfig)["alpha"] in shown
    with pytest.raises(TypeError, match="needs a docstring on the field of the same name in SwarmConfig or CollectiveConfig"):
        help_of(_undocumented(), "nowhere")


def _undocumented() -> type:
    """A group whose option gives no help and names no documented field."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Undocumented(SwarmOptions):
        nowhere: int = option(0)
    return Undocumented


def test_field_docstrings_are_read_from_the_source():
    from dataclasses import dataclass

    @dataclass
    class Settings:
        a: int = 1
        """The first
        one."""
        b: int = 2
        c: int = 3
        """The third."""

    assert field_docs(Settings) == {"a": "The first one.", "c": "The third."}


def test_start_and_join_take_the_same_options():
    def names(cmd: str) -> set[str]:
        group = typer.main.get_group(main.app)
        return {p.name for p in group.commands[cmd].params if p.name}

    assert names("start") == names("join") - {"addresses"}
    assert {"gather_timeout", "round_timeout", "pattern", "n_layer", "checkpoint_dir", "tensorboard"} \
        <= names("start")


def test_the_demo_hands_its_peers_flags_that_read_back_to_its_job(monkeypatch, tmp_path):
    job = JobConfig(rounds=3, inner_steps=12, batch_size=4, d_model=32, n_layer=2, outer_lr=0.5, outer_momentum=0.8,
                    outer_warmup=5, seed=7, threads=2, eval_every=2,
                    streaming=StreamingConfig(fragments=2, pattern="sequential", overlap=1, alpha=0.5))
    cfg = DemoConfig(peers=3, job=job, swarm=SwarmConfig(round=CollectiveConfig(
        compression="q8", robust=RobustConfig(clip=2.0, trim=0.1, ban_after=5))))
    argv = peer_command(cfg, 1, "demo-run", tmp_path, "/ip4/127.0.0.1/tcp/1/p2p/" + "12D3KooW" + "a" * 44)
    assert argv[3:5] == ["join", argv[4]]
    swarm, got = _configs_of(monkeypatch, ["start", *argv[5:]])
    for f in fields(JobOptions) + fields(ModelOptions) + fields(RunOptions):
        assert getattr(got, f.name) == getattr(job, f.name), f.name
    assert got.streaming == job.streaming
    assert (got.shard, got.wait_for) == (1, 3)
    assert (swarm.round.compression, swarm.round.robust, swarm.run_id) == ("q8", cfg.swarm.round.robust, "demo-run")
    assert flags(DEMO_JOB, RunOptions, PeerJobOptions) == []  # at their defaults: nothing to say
    assert flags(JobConfig(resume=True, checkpoint_dir="c"), PeerJobOptions) == ["--checkpoint-dir", "c", "--resume"]


def test_the_demo_spreads_its_peers_over_the_gpus_only_for_device_auto(tmp_path):
    assert [peer_device("auto", i, 2) for i in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert peer_device("auto", 3, 1) == peer_device("auto", 3, 0) == "auto"  # one GPU or none: auto decides
    assert peer_device("cuda:1", 0, 4) == "cuda:1" and peer_device("cpu", 2, 4) == "cpu"  # a choice is kept
    argv = peer_command(DemoConfig(peers=3), 2, "demo-run", tmp_path, None, gpus=2)
    assert argv[argv.index("--device") + 1] == "cuda:0" and argv.count("--device") == 1
    assert "--device" not in peer_command(DemoConfig(peers=3), 2, "demo-run", tmp_path, None, gpus=1)
    cpu = DemoConfig(job=JobConfig(device="cpu"))
    argv = peer_command(cpu, 1, "demo-run", tmp_path, None, gpus=2)
    assert argv[argv.index("--device") + 1] == "cpu" and argv.count("--device") == 1


def test_the_demo_takes_the_run_options_and_hands_them_to_its_peers(monkeypatch, tmp_path):
    demos = []
    monkeypatch.setattr("diloco.cli.demo.run_demo", lambda cfg, **_: demos.append(cfg) or 0)
    out = CliRunner().invoke(main.app, ["demo", "--device", "cpu", "--threads", "2", "--seed", "3", "--eval-every", "2"])
    assert out.exit_code == 0, out.output
    (cfg,) = demos
    assert (cfg.job.device, cfg.job.threads, cfg.job.seed, cfg.job.eval_every) == ("cpu", 2, 3, 2)
    argv = peer_command(cfg, 1, "demo-run", tmp_path, None, gpus=2)  # a choice of device is every peer's
    assert [argv[argv.index(flag) + 1] for flag in ("--device", "--threads", "--seed", "--eval-every")] == \
        ["cpu", "2", "3", "2"]


def test_the_demo_is_the_job_with_its_own_defaults():
    group = typer.main.get_group(main.app)
    defaults = {p.name: p.default for p in group.commands["demo"].params}
    assert (defaults["rounds"], defaults["inner_steps"], defaults["compression"]) == (8, 25, "e3m0")
    assert DEMO_JOB == JobConfig(rounds=8, inner_steps=25)


def test_an_option_declared_twice_is_refused_and_groups_take_only_their_options():
    with pytest.raises(TypeError, match=r"declared twice: \['run_id'\]"):
        @command(SwarmOptions)
        def twice(swarm: SwarmOptions, run_id: str = typer.Option("x")) -> None:
            pass
    with pytest.raises(TypeError, match="has no option"):
        AggregationOptions.defaults(rounds=3)
    assert option(1, help="h").metadata["help"] == "h"


@pytest.mark.parametrize("args, needle", [
    (["start", "--h-schedule", "80"], "--h-schedule: H schedule '80': write ROUNDS:H pairs"),
    (["start", "--init-from", "no-such.safetensors"], "is not a file"),
    (["start", "--data-parallel"], "set --inner-steps 1"),
    (["start", "--data-parallel", "-H", "1", "--outer-lr", "0.5"], "leave --outer-lr"),
    (["start", "--device", "cuda:99"], "--device 'cuda:99': this "),  # no CUDA, or fewer than 100 GPUs
    (["simulate", "--device", "gpu"], "--device 'gpu' is not a device: give auto, cpu, cuda or cuda:N"),
    (["demo", "--device", "cuda:99"], "--device 'cuda:99': this "),
    (["bench", "transfer", "--device", "mps"], "--device 'mps': the bundled job trains on cpu or cuda"),
    (["bench", "wrapper", "--global-device", "cuda:99"], "--global-device 'cuda:99': this "),
])
def test_a_bad_training_flag_exits_2_naming_the_fix_before_any_network(args, needle):
    logging_before = [(name, logging.getLogger(name).level) for name in ("", "hivemind", "asyncio")]
    out = CliRunner().invoke(main.app, args)
    assert out.exit_code == 2 and needle in out.output, out.output
    # a refused command changed nothing: not even the logging it sets up to run
    assert [(name, logging.getLogger(name).level) for name in ("", "hivemind", "asyncio")] == logging_before
