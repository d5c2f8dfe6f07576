"""The real command line in this process: typer's runner over `diloco.cli.main.app`, as `main()` runs it past its
own check of `--`. Tests of input the CLI must refuse run it here (a `python -m diloco` costs about 2 s of
imports), with the work each command would start once its input is checked made to fail the test
(`refuse_to_start`)."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import Result
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.launcher import split_command


def invoke(argv: list[str], **kwargs: Any) -> Result:
    """`diloco ARGV [-- CMD]` (`argv` without the `diloco`); `kwargs` go to the runner (`env=...`)."""
    args, command = split_command(argv)
    assert command is None or args[:1] in (["start"], ["join"])  # main() refuses the rest itself
    return CliRunner().invoke(app, args, obj={"command": command}, prog_name="diloco", **kwargs)


def refuse_to_start(monkeypatch: pytest.MonkeyPatch, *targets: str) -> None:
    """Each of `targets` (dotted names: what a command calls once its input is checked, to start peers, train or
    measure) fails the test if called, so input accepted by mistake fails at once instead of starting that work
    inside the test."""
    for target in targets:
        def started(*_args: object, _target: str = target, **_kwargs: object) -> None:
            raise AssertionError(f"the input was accepted: the command went on to call {_target}")
        monkeypatch.setattr(target, started)
