"""`diloco start/join --config FILE.toml` (diloco/cli/options.py): a lab's settings in one file, the command line
overriding it, and a file that is wrong refused before anything starts, naming the file, the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_util import invoke

import diloco.cli.main as cli

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lab.toml"


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """What `start`/`join` would run with: the swarm's and the job's configurations they build, taken where the
    command would go on to start the peer."""
    seen: dict[str, object] = {}

    def peer(initial, swarm, aggregation, peer_options, job, out, ctx):
        seen["swarm"], seen["job"] = cli._configs(swarm, aggregation, peer_options, *job)
        seen["peer"], seen["out"], seen["initial"] = peer_options, out, initial

    monkeypatch.setattr(cli, "_peer", peer)
    return seen


def test_the_example_file_sets_every_group_and_the_command_line_overrides_it(settings):
    result = invoke(["join", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRQPiyGWQQdn3DaPhb84P9MBDWaM43QfaVX9YR9qxStbP",
                     "--config", str(EXAMPLE), "--rounds", "200", "--gather-timeout", "30"])
    assert result.exit_code == 0, result.output
    swarm, job, peer, out = settings["swarm"], settings["job"], settings["peer"], settings["out"]
    assert (swarm.run_id, swarm.round.min_peers, swarm.round.result_timeout, swarm.heartbeat_ttl) == ("lab-run", 2, 180.0, 60.0)
    assert swarm.round.gather_timeout == 30.0 and job.rounds == 200  # the command line wins
    assert (swarm.round.compression, swarm.round.robust.clip) == ("e3m0", 3.0)
    assert (job.inner_steps, job.outer_warmup, job.streaming.fragments) == (100, 2, 2)
    assert (peer.host, peer.port, str(out.metrics)) == ("0.0.0.0", 31337, "run.jsonl")
    assert (job.checkpoint_dir, job.checkpoint_every) == ("checkpoints", 10)


def test_keys_may_use_underscores_and_a_no_flag(settings, tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("inner_steps = 7\nresume = true\nannounce = ['/ip4/203.0.113.5/tcp/31337']\n")
    result = invoke(["start", "--config", str(path), "--checkpoint-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert settings["job"].inner_steps == 7 and settings["job"].resume is True
    assert settings["peer"].announce == ["/ip4/203.0.113.5/tcp/31337"]


@pytest.mark.parametrize("text, needle", [
    ("gather-timout = 3\n", "unknown setting 'gather-timout' (did you mean 'gather-timeout'?)"),
    ("gather-timeout = 'soon'\n", "gather-timeout = 'soon': "),
    ("rounds = 3\n[job]\nrounds = 4\n", "'rounds' is set twice"),
    ("announce = '/ip4/1.2.3.4/tcp/5'\n", "'announce' takes a list, e.g. announce = [\"/ip4/1.2.3.4/tcp/5\"]"),
    ("rounds = [3]\n", "'rounds' takes one value"),
    ("rounds = \n", "not valid TOML"),
    ("inner-steps = 0\n", "inner_steps must be >= 1"),  # the same check as on the command line
])
def test_a_wrong_file_is_refused_with_exit_2_naming_the_file_and_the_fix(settings, tmp_path, text, needle):
    path = tmp_path / "lab.toml"
    path.write_text(text)
    result = invoke(["start", "--config", str(path)])
    assert result.exit_code == 2 and "peer" not in settings, result.output
    said = _flat(result.output)  # the message as one line, whatever the terminal's width wrapped
    assert _flat(needle) in said, result.output
    assert "must be" in needle or _flat(f"--config {path}") in said, result.output


def _flat(text: str) -> str:
    return "".join(text.replace("│", "").split())


def test_a_missing_file_is_named(settings, tmp_path):
    result = invoke(["start", "--config", str(tmp_path / "nope.toml")])
    assert result.exit_code == 2 and "cannot read it" in result.output and "peer" not in settings


def test_help_shows_the_extras_to_install_verbatim():
    """Rich's markup would eat `[tensorboard]` out of `pip install "diloco[tensorboard]"` (diloco/cli/options.py,
    `plain`)."""
    out = invoke(["start", "--help"], env={"COLUMNS": "250"})
    assert out.exit_code == 0 and 'pip install "diloco[tensorboard]"' in out.output, out.output
    assert 'pip install "diloco[wandb]"' in out.output


def test_under_a_command_the_files_bundled_job_settings_are_named_as_unused(monkeypatch, tmp_path):
    """A lab's file may serve the bundled job and a script under the launcher alike: with `-- CMD` the settings
    only the bundled job reads are named in a note (on the command line they would exit 2: test_multiproc.py)."""
    launched: list[list[str]] = []

    def launch(initial, command, *args, **kwargs):
        launched.append(command)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "_launch", launch)
    monkeypatch.chdir(tmp_path)
    result = invoke(["start", "--config", str(EXAMPLE), "--", "python", "train.py"])
    assert result.exit_code == 0 and launched == [["python", "train.py"]], result.output
    assert "note: --config sets --inner-steps, --outer-warmup, --rounds, --fragments, which only the bundled job " \
           "reads" in result.stderr, result.stderr
