"""`diloco bench codecs` runs end to end on small inputs and writes sane JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_util import invoke, refuse_to_start

from diloco.bench.codecs import CodecResult, bench_codecs, make_inputs

pytestmark = pytest.mark.unit


def test_bench_measures_size_and_error_of_each_pipeline():
    inputs = make_inputs([8192], ["gaussian"])
    results = {r.spec: r for r in bench_codecs(["fp32", "fp16", "topk:64/4096+s2"], inputs, repeats=1)}
    assert results["fp32"].bits_per_param == 32 and results["fp32"].rel_l2_error == 0
    assert results["fp16"].bits_per_param == 16 and 0 < results["fp16"].rel_l2_error < 1e-3
    sparse = results["topk:64/4096+s2+rice"]
    assert 0.1 < sparse.bits_per_param < 0.25 and 0.5 < sparse.rel_l2_error < 1
    assert all(isinstance(r, CodecResult) and r.clone_s > 0 and r.encode_s > 0 for r in results.values())
    assert all(r.device == "cpu" and r.encode_gbps == pytest.approx(4 * 8192 / r.encode_s / 1e9) and "encode_gbps" in r.row()
               for r in results.values())


@pytest.mark.multiproc
def test_bench_cli_writes_json(tmp_path):
    out, profile = tmp_path / "codecs.json", tmp_path / "profile.txt"
    proc = subprocess.run([sys.executable, "-m", "diloco", "bench", "codecs", "--spec", "q8+zstd", "--spec", "e3m0",
                           "--size", "65536", "--input", "gaussian", "--repeats", "1", "--json", str(out),
                           "--profile", str(profile)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["spec"] for r in rows] == ["q8:256+zstd:3", "e3m0:0"]
    assert rows[0]["bits_per_param"] < 8.2 and rows[1]["bits_per_param"] == pytest.approx(4, abs=0.01)
    # one encode and one decode of each pipeline: torch's operators and the host's Python functions
    text = profile.read_text()
    for heading in ("q8:256+zstd:3 on gaussian-65536: encode", "q8:256+zstd:3 on gaussian-65536: decode",
                    "e3m0:0 on gaussian-65536: encode", "e3m0:0 on gaussian-65536: decode"):
        assert f"# {heading}\n" in text
    assert text.count("Self CPU time total") == 4 and text.count("tottime") == 4 and "aten::" in text


def test_bench_cli_names_an_unknown_stage(monkeypatch):
    refuse_to_start(monkeypatch, "diloco.cli.main._device")  # past its checks: the device, torch's threads, the inputs
    bad = invoke(["bench", "codecs", "--spec", "q3"])
    assert bad.exit_code == 2 and "unknown stage 'q3'" in bad.stderr, (bad.output, bad.exception)

