"""Every `diloco …` command in README.md and docs/*.md goes through the real CLI, so an example cannot
drift from the options again.

Where the commands come from: fenced and indented code blocks (one command a line, `\\` continues it,
`#` starts a comment) and inline code spans that start with `diloco `. A span that only names a
command (`diloco join`) must have a `--help`; `diloco start/join` names both; `[--opt V]` is optional
(the command is run without it and with it); capitalized placeholders (ADDR, RUN, FILE, DIR, N, M,
PLAN) and `$A` (defined in docs/BENCHMARKS.md) are filled in below.

What each command does here:
- `simulate`, `bench codecs`: run for real in this process at a reduced size (options appended at the
  end, where the last one wins): a tiny model, the fewest inner steps a round allows, one round unless
  a fault plan needs more, at most 2 workers unless the command pins them (`--speeds`, `--faults`,
  `--link`). Commands that differ from one already run in the same test process only in their option values
  (or that play the same fault plan) are parsed and validated, then stopped at the run. Each part of five commands
  of a document is a test of its own, so the suite's workers share them.
- `bench convergence` (its smallest budget is 500 inner steps, about 20 s here; the real run at test
  size is tests/test_bench_convergence.py), `start`, `join`, `status` (and `status --watch`), `demo` (real peers,
  tests/test_multiproc.py), `start/join ... -- CMD` (the launcher, tests/test_launcher.py), `bench
  overlap`, `bench race` and `bench hetero` (root and network namespaces, tests/test_bench_overlap.py,
  tests/test_bench_race.py and tests/test_bench_hetero.py), `bench flood` (real daemons,
  tests/test_auth.py), `bench chaos` (minutes of real workers under faults, tests/test_bench_chaos.py), `bench
  site` (torchrun sites), `bench size` (models of up to 300M parameters,
  tests/test_bench_size.py), `bench wrapper` (minutes of training, tests/test_bench_wrapper.py): parsed and
  validated by the real command, which
  must get as far as the call that would start the work (then stopped there, before any network I/O).
- `plot`, `bench convergence --replot` (redraws saved curves), `bench transfer` (a second at the bundled
  model's size): run for real, on a small metrics file (`run.jsonl`) and the saved B1 result.
- `make X`: the Makefile has target X.
- a GPU benchmark (`--device cuda`) on a machine without a GPU: as written, on the CPU.
- a command's bare name (`diloco bench overlap`, `diloco join`): its `--help` works.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

import cli_util

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PEER = "12D3KooWEyoppNCUx8Yx66oV9fJnriXwCcXwDDUA2kj6vnc6iDEp"
SECRET = "s" * 43
PLACEHOLDERS = {"ADDR": f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER}", "RUN": "lab-run", "FILE": "diloco-lab-run.secret",
                "DIR": "ckpt", "N": "2", "M": "2", "PLAN": "plan.json"}


# ---------------------------------------------------------------------- finding the examples


def _code_blocks(text: str) -> tuple[list[str], str]:
    """Lines of fenced and indented code blocks, and the text without the fenced ones."""
    fenced = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
    lines = [ln for lang, block in fenced.findall(text) if lang.strip() in ("bash", "sh", "shell", "console")
             for ln in block.splitlines()]  # other fences hold output, layouts, JSON
    prose = fenced.sub("", text)
    in_block, after_blank = False, True
    for ln in prose.splitlines():  # an indented block starts after a blank line
        if ln.startswith("    ") and (in_block or after_blank):
            lines.append(ln.strip())
            in_block = True
        elif ln.strip():
            in_block = False
        after_blank = not ln.strip()
    return lines, prose


def _commands_in(text: str) -> list[str]:
    """Every `diloco`/`make` command of a document, continuation lines joined, comments removed."""
    lines, prose = _code_blocks(text)
    out, pending = [], ""
    for ln in lines:
        if ln.rstrip().endswith("\\"):
            pending += ln.rstrip()[:-1] + " "
            continue
        out.append(pending + ln)
        pending = ""
    out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    commands = []
    for cmd in out:
        cmd = cmd.strip().removeprefix("/usr/bin/time -v ")
        words = cmd.split()
        if words and words[0] in ("diloco", "make") and (len(words) > 1 or words[0] == "diloco"):
            commands.append(cmd)  # a bare `make` is the tool, not a command
    return commands


def _expand(cmd: str, variables: dict[str, str]) -> list[list[str]]:
    """argv lists for one documented command: `a/b` subcommands, optional [..] parts, placeholders."""
    for name, value in variables.items():
        cmd = cmd.replace(f"${name}", value)
    optional = re.findall(r"\[([^\]]+)\]", cmd)
    variants = []
    for with_optional in (False, True) if optional else (False,):
        text = re.sub(r"\[([^\]]+)\]", (lambda m: m.group(1)) if with_optional else "", cmd)
        words = [PLACEHOLDERS.get(w, w) for w in shlex.split(text, comments=True)]
        if len(words) == 1:  # `diloco` itself
            variants.append(words)
            continue
        variants += [[words[0], s, *words[2:]] for s in words[1].split("/")]
    return variants


def examples(docs: list[Path] = DOCS) -> list[tuple[str, list[str]]]:
    found = []
    for doc in docs:
        text = doc.read_text()
        variables = dict(re.findall(r'\b([A-Z])="([^"]+)"', " ".join(text.split())))
        for cmd in _commands_in(text):
            for argv in _expand(cmd, variables):
                found.append((f"{doc.name}: {cmd}", argv))
    return [pair for k, pair in enumerate(found) if pair[1] not in [f[1] for f in found[:k]]]


def test_the_docs_have_the_examples_this_test_expects_to_find():
    """A guard for the extraction itself: it sees the README's code blocks, docs' spans and blocks."""
    argvs = [" ".join(argv) for _, argv in examples()]
    for expected in ("make demo", "make test", "diloco start --host 0.0.0.0 --port 31337 --run-id lab-run",
                     "diloco join /ip4/203.0.113.5/tcp/31337/p2p/12D3KooWAbc", "diloco simulate --workers 16",
                     "diloco bench overlap", "diloco status /ip4/127.0.0.1", "diloco demo --peers 8 --no-live",
                     "diloco simulate --workers 2 --rounds 3 -H 60 --compression e3m0 --bandwidth-mbit 1",
                     "diloco simulate --workers 8 --rounds 10 -H 20 --d-model 64 --layers 2 --compression fp32 --faults",
                     "diloco bench convergence --plots docs/img", "diloco bench codecs --spec e3m0"):
        assert any(a.startswith(expected) for a in argvs), (expected, argvs)


# ---------------------------------------------------------------------- running them


class Reached(Exception):
    """The command got past parsing and validation to the call that starts the work."""


def _stop_at(monkeypatch: pytest.MonkeyPatch, target: str, name: str, seen: list[Any]) -> None:
    def stop(*args: Any, **kwargs: Any) -> None:
        seen.append((args, kwargs))
        raise Reached(name)
    monkeypatch.setattr(target, stop)


STOPPED_AT = {  # command -> what would start the work (network, real peers, root, or a long budget)
    ("diloco", "start"): "diloco.cli.main._run_peer", ("diloco", "join"): "diloco.cli.main._run_peer",
    ("diloco", "status"): "diloco.cli.status.observe", ("diloco", "demo"): "diloco.cli.demo.run_demo",
    ("diloco", "bench", "overlap"): "diloco.bench.overlap.run", ("diloco", "bench", "flood"): "diloco.bench.flood.run",
    ("diloco", "bench", "convergence"): "diloco.bench.convergence.run", ("diloco", "bench", "site"): "diloco.bench.site.run",
    ("diloco", "bench", "size"): "diloco.bench.size.run", ("diloco", "bench", "wrapper"): "diloco.bench.wrapper.run",
    ("diloco", "bench", "transport"): "diloco.bench.transport.run", ("diloco", "bench", "race"): "diloco.bench.race.run",
    ("diloco", "bench", "regions"): "diloco.bench.regions.run", ("diloco", "bench", "chaos"): "diloco.bench.chaos.run",
    ("diloco", "bench", "hetero"): "diloco.bench.hetero.run",
    ("diloco", "export"): "diloco.persist.export",  # run for real in tests/test_final_model.py
}
LAUNCHED = "diloco.cli.main._launch"
"""`diloco start/join ... -- CMD` runs the user's command as the site's worker: stopped there."""
RUN_REDUCED = {("diloco", "simulate"): "diloco.sim.simulate.simulate", ("diloco", "bench", "codecs"): "diloco.bench.codecs.bench_codecs"}


def invoke(argv: list[str]) -> Any:
    """`diloco ARGS [-- CMD]` as `diloco.cli.main.main` runs it, in this process."""
    return cli_util.invoke(argv[1:])


def _command(argv: list[str]) -> tuple[str, ...]:
    return tuple(argv[:3]) if argv[1] == "bench" else tuple(argv[:2])


def _value(argv: list[str], flag: str, default: str) -> str:
    hits = [argv[i + 1] for i, w in enumerate(argv[:-1]) if w == flag]
    return hits[-1] if hits else default


def reduced(argv: list[str]) -> list[str]:
    """The command at test size: options appended (for single-valued options click keeps the last)."""
    if argv[1] == "simulate":
        fragments, overlap = int(_value(argv, "--fragments", "1")), int(_value(argv, "--overlap", "0"))
        pinned = any(w in argv for w in ("--speeds", "--faults", "--link", "--regions"))  # these name each worker
        slot = overlap + 1 if "--faults" not in argv else 2  # a restarted worker must step once before it syncs
        extra = ["-H", str(fragments * slot), "--d-model", "16", "--layers", str(fragments), "--batch-size", "2"]
        extra += [] if "--faults" in argv else ["--rounds", "1"]
        extra += [] if pinned else ["--workers", str(min(2, int(_value(argv, "--workers", "4"))))]
        return argv + extra
    if argv[1:3] == ["bench", "codecs"]:  # --size and --input add to a list: the documented ones go
        kept = [w for i, w in enumerate(argv) if w not in ("--size", "--input") and argv[i - 1] not in ("--size",
                                                                                                      "--input")]
        return kept + ["--size", "4096", "--input", "gaussian", "--repeats", "1"]
    return argv


def _run_key(argv: list[str]) -> tuple[str, ...]:
    """Commands with the same key are run for real once: the same options (values aside), or the same
    fault plan (a plan pins the workers and rounds, so these runs cost the most)."""
    if "--faults" in argv:
        return (*_command(argv), "--faults", _value(argv, "--faults", ""))
    return (*_command(argv), *sorted({w for w in argv if w.startswith("-")}))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding what the examples read: the secret file `diloco start` would have
    written (copied over, as the README says), fault plans (docs/SIMULATE.md's, and the repo's), a settings
    file (examples/lab.toml)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DILOCO_SECRET", SECRET)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # python, torchrun
    (tmp_path / "diloco-lab-run.secret").write_text(SECRET + "\n")
    (tmp_path / "diloco-lab-run.secret").chmod(0o600)
    plan = re.search(r"```json\n(.*?)```", (ROOT / "docs" / "SIMULATE.md").read_text(), re.S)
    assert plan, "docs/SIMULATE.md lost its example fault plan"
    (tmp_path / "plan.json").write_text(plan.group(1))
    (tmp_path / "lab.toml").write_text((ROOT / "examples" / "lab.toml").read_text())  # a lab's settings file
    (tmp_path / "ckpt").mkdir()  # DIR: a run's checkpoint directory (`diloco export` stops before reading it)
    for d in ("benchmarks/results", "docs/img"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "benchmarks" / "poison-plan.json").write_text((ROOT / "benchmarks" / "poison-plan.json").read_text())
    for saved in ("convergence-2026-11-23.json",):  # what `bench convergence --replot` redraws
        (tmp_path / "benchmarks" / "results" / saved).write_text((ROOT / "benchmarks" / "results" / saved).read_text())
    (tmp_path / "run.jsonl").write_text("".join(  # what `diloco plot run.jsonl` draws: a run's round lines
        '{"event": "round", "peer": "A", "time": %d, "step": %d, "tokens": %d, "loss": %.1f, "bytes_sent": 100, '
        '"bytes_received": 90}\n' % (100 + i, 10 * i, 1280 * i, 5 - i / 10) for i in range(1, 4)))
    return tmp_path


def _on_this_machine(argv: list[str]) -> list[str]:
    """A GPU benchmark's command (`--device cuda`, `--global-device cuda`) as it runs on a machine without a GPU:
    on the CPU, every other option as written (the GPU itself: tests/test_gpu.py, `make test-gpu`)."""
    import torch

    if torch.cuda.is_available():
        return argv
    return [("cpu" if a.startswith("cuda") and argv[i - 1] in ("--device", "--global-device") else a)
            for i, a in enumerate(argv)]


RAN: set[tuple[str, ...]] = set()
"""Commands run for real in this process already (per test worker: a document's tests may run in another)."""


PART = 5
"""Commands per test: a document's commands in parts, so that the suite's workers share them and no part nears
the test timeout on a loaded machine (BENCHMARKS.md's, in one test, took 102 s of the 120)."""
PARTS = [(doc, i) for doc in DOCS for i in range(max(1, -(-len(examples([doc])) // PART)))]


@pytest.mark.parametrize("doc, part", PARTS, ids=[f"{d.name}-{i}" for d, i in PARTS])
def test_every_documented_command_runs_or_reaches_its_work(doc: Path, part: int, workdir: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    """One part of one document's commands."""
    makefile = (ROOT / "Makefile").read_text()
    ran = RAN
    for where, argv in examples([doc])[part * PART:(part + 1) * PART]:
        if argv[0] == "make":
            assert re.search(rf"^{re.escape(argv[1])}:", makefile, re.M), where
            continue
        if len(argv) <= 2 or argv[1:] == ["bench", argv[2]] or "--help" in argv:  # a name: it has a --help
            result = invoke([*argv, "--help"] if "--help" not in argv else argv)
            assert result.exit_code == 0, (where, result.output)
            continue
        command = _command(argv)
        argv = _on_this_machine(argv)
        seen: list[Any] = []
        with monkeypatch.context() as m:
            m.setattr("diloco.bench.wan.check_privileges", lambda: None)  # bench overlap: stopped before root matters
            target = LAUNCHED if "--" in argv else None if "--replot" in argv else \
                "diloco.cli.status.watch" if "--watch" in argv else STOPPED_AT.get(command)
            if target is None and _run_key(argv) in ran and command in RUN_REDUCED:  # the same options ran already
                target = RUN_REDUCED[command]  # (the cheap ones, `plot`, `bench transfer`, run again)
            if target is not None:
                _stop_at(m, target, where, seen)
            result = invoke(reduced(argv))
        if target is not None:
            assert isinstance(result.exception, Reached), (where, result.exit_code, result.output)
            assert seen, where
        else:
            assert result.exit_code == 0, (where, " ".join(reduced(argv)), result.output, result.exception)
            ran.add(_run_key(argv))


def test_the_docs_have_simulate_and_bench_codecs_commands_that_run_for_real():
    """The docs hold `simulate` and `bench codecs` commands, which the parts above run for real (the first of each
    set of options in a test process; `RUN_REDUCED` names no stopping point for them otherwise)."""
    keys = {_run_key(_on_this_machine(argv)) for _, argv in examples() if argv[0] == "diloco" and len(argv) > 2}
    assert any(k[:2] == ("diloco", "simulate") for k in keys) and any(k[:3] == ("diloco", "bench", "codecs")
                                                                       for k in keys)
