"""`diloco bench transfer` (what a synchronization moves between the model's device and host memory) on the
CPU; on a GPU: tests/test_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from diloco.bench.devices import device_name
from diloco.bench.transfer import TransferSetup, parameter_shapes, run
from diloco.cli import main
from diloco.config import ConfigError
from diloco.job.model import GPTConfig, build_model
from diloco.job.train import JobConfig, training_device

pytestmark = pytest.mark.unit


def test_the_shapes_moved_are_the_bundled_gpts_trainable_parameters():
    cfg = GPTConfig(d_model=32, n_layer=2)
    assert parameter_shapes(cfg) == [tuple(p.shape) for p in build_model(cfg, seed=0).parameters()]


def test_a_cpu_run_times_both_moves_of_a_sync_over_the_whole_model():
    report = run(TransferSetup(GPTConfig(d_model=32, n_layer=2), device="cpu", repeats=2))
    params = sum(p.numel() for p in build_model(GPTConfig(d_model=32, n_layer=2), seed=0).parameters())
    assert report["device"] == "cpu" and report["params"] == params
    moves = {(r["what"], r["theta"]) for r in report["rows"]}
    assert moves == {("Δ to host (pseudo_gradient)", "host memory"), ("θ to device (copy_into)", "pageable host memory")}
    for r in report["rows"]:
        assert r["bytes"] == 4 * params and r["ms"] > 0 and r["gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)


def test_the_cli_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "t.json"
    result = CliRunner().invoke(main.app, ["bench", "transfer", "--device", "cpu", "--d-model", "32", "--layers", "1",
                                           "--repeats", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "| Δ to host (pseudo_gradient) | host memory |" in result.output
    written = json.loads(out.read_text())
    assert written["setup"]["d_model"] == 32 and written["device"] == "cpu" and written["rows"]


def test_the_jobs_device_resolves_here_or_says_what_to_give():
    assert training_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    assert training_device("cpu") == torch.device("cpu") and device_name(torch.device("cpu")) == "cpu"
    assert JobConfig(device="cpu").device == "cpu"
    for bad, needle in (("cuda:99", "this "), ("gpu", "is not a device"), ("meta", "trains on cpu or cuda")):
        with pytest.raises(ConfigError, match=f"--device '{bad}'.*{needle}"):
            JobConfig(device=bad)
