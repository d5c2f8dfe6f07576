"""TensorBoard and W&B next to the JSON lines (diloco/sinks.py, diloco/metrics.py): what reaches each,
read back from the files they write; W&B offline without an API key (no network); a missing package
named with its install line; a failing sink never stops the peer. The real-swarm halves: `diloco start`
(tests/test_status.py), `diloco demo` (tests/test_multiproc.py), a launched worker (tests/test_launcher.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping

import pytest
import wandb_offline

from diloco import metrics
from diloco.metrics import MetricsWriter, read_jsonl
from diloco.sinks import SinkConfig, scalars, wandb_mode
from fresh import fresh_python


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under `log_dir`, by tag: (step, value), as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B with no API key anywhere it looks (so diloco picks offline), writing under tmp_path. At the end
    its service process is stopped, as it is when a peer's process exits."""
    import wandb

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc from `wandb login`
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wbconfig"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    try:
        yield tmp_path / "wb"
    finally:
        wandb.teardown()


@pytest.mark.unit
def test_scalars_are_the_finite_numbers_flattened() -> None:
    fields = {"time": 1.5, "loss": 2.5, "peers": 3, "committed": True, "reason": "", "digest": "ab",
              "nan": float("nan"), "usage": {"utilization": 0.9, "deep": {"x": 1}}, "banned": ["a"], "none": None}
    assert scalars(fields, "round") == {"round/loss": 2.5, "round/peers": 3.0, "round/committed": 1.0,
                                        "round/usage/utilization": 0.9, "round/usage/deep/x": 1.0}


@pytest.mark.unit
def test_wandb_goes_offline_without_a_key(tmp_path: Path) -> None:
    no_netrc = str(tmp_path / "none")
    assert wandb_mode({}, no_netrc)[0] == "offline" and "wandb sync" in wandb_mode({}, no_netrc)[1]
    assert wandb_mode({"WANDB_API_KEY": "k"}, no_netrc)[0] == "online"
    assert wandb_mode({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, no_netrc)[0] == "offline"
    assert wandb_mode({"WANDB_MODE": "disabled"}, no_netrc)[0] == "disabled"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai login user password secretkey\n")
    netrc.chmod(0o600)
    assert wandb_mode({}, str(netrc))[0] == "online"
    assert wandb_mode({"WANDB_BASE_URL": "https://wandb.example.org"}, str(netrc))[0] == "offline"


def test_round_lines_reach_tensorboard_and_offline_wandb(tmp_path: Path, offline_wandb: Path) -> None:
    sinks = SinkConfig(tensorboard=str(tmp_path / "tb"), wandb="diloco-test")
    writer = MetricsWriter(tmp_path / "m.jsonl", sinks.open("12D3KooPeer", "run-x", {"inner_steps": 5, "lr": 0.1}))
    for i in range(1, 4):
        writer.write("round", peer="12D3KooPeer", round=i, step=5 * i, loss=5.0 - i, bytes_sent=100 * i,
                     committed=True, reason="", usage={"utilization": 0.5 + i / 10})
    writer.write("final", step=15, eval_loss=1.25, usage={"utilization": 0.8})
    writer.close()
    # `finish()` hands the run to W&B's service process, which may still be writing its file: read it once
    # the service has stopped, as when a peer's process exits (seen once: no history yet, on a busy machine)
    import wandb
    wandb.teardown()

    assert [line["round"] for line in read_jsonl(tmp_path / "m.jsonl") if line["event"] == "round"] == [1, 2, 3]
    tb = tensorboard_scalars(tmp_path / "tb" / "12D3KooPeer")  # one run per peer
    assert tb["round/loss"] == [(5, 4.0), (10, 3.0), (15, 2.0)]
    assert [v for _, v in tb["round/usage/utilization"]] == pytest.approx([0.6, 0.7, 0.8])
    assert tb["final/eval_loss"] == [(15, 1.25)]

    (run_dir,) = offline_wandb.glob("wandb/offline-run-*")  # offline: no key anywhere, no network touched
    rows = wandb_offline.history(run_dir)
    assert [r["round/loss"] for r in rows if "round/loss" in r] == [4.0, 3.0, 2.0]
    assert [r["round/step"] for r in rows if "round/step" in r] == [5, 10, 15]
    assert [r["final/eval_loss"] for r in rows if "final/eval_loss" in r] == [1.25]
    info = wandb_offline.run_info(run_dir)
    assert (info.display_name, info.run_group, info.project) == ("12D3KooPeer", "run-x", "diloco-test")
    config = {item.key: json.loads(item.value_json) for item in info.config.update}
    assert config["inner_steps"] == 5 and config["lr"] == 0.1


class Broken:
    """A sink whose every call fails, as a full disk or a dead W&B service would make it."""

    name = "tensorboard"

    def log(self, event: str, fields: Mapping[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        raise RuntimeError("already gone")


@pytest.mark.unit
def test_a_failing_sink_is_counted_and_the_json_lines_go_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(metrics, "write_failures", metrics.write_failures.__class__())
    monkeypatch.setattr(metrics, "_logged", set())
    writer = MetricsWriter(tmp_path / "m.jsonl", [Broken()])
    writer.write("round", round=1)
    writer.write("round", round=2)
    writer.close()
    assert [line["round"] for line in read_jsonl(tmp_path / "m.jsonl")] == [1, 2]
    assert dict(metrics.write_failures) == {"tensorboard": 2}
    assert caplog.text.count("event=tensorboard_write_failed") == 1 and "training goes on" in caplog.text
    assert "event=tensorboard_close_failed" in caplog.text


@pytest.mark.parametrize("flag, value, extra", [("--tensorboard", "tb", "tensorboard"), ("--wandb", "proj", "wandb")])
def test_a_missing_package_is_named_before_anything_starts(tmp_path: Path, flag: str, value: str, extra: str) -> None:
    out = fresh_python("from diloco.cli.main import main\n"
                       f"main(['start', {flag!r}, {value!r}, '--secret-file', {str(tmp_path / 's')!r}])",
                       without=[extra], cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert f'{flag} needs the {extra} package, which is not installed' in out.stderr
    assert f'pip install "diloco[{extra}]"' in out.stderr
    assert not (tmp_path / "s").exists()  # stopped before even the secret was created
