"""Plots (diloco/bench/plot.py, drawn by matplotlib) and `diloco plot` (diloco/bench/curves.py): the PNG shows every
series, Greek letters render, a run's metrics lines become curves against tokens, bytes and time, and
a missing matplotlib is named with its install line."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.bench.curves import Run, check, series, token_axis
from diloco.bench.plot import PlotError, Series, drawable, line_plot
from fresh import fresh_python

pytestmark = pytest.mark.unit

C0, C1 = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's first two line colours


def pixels(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    img = imread(path)
    return (np.asarray(img[..., :3]) * 255).round().astype(int)


def has_colour(img: np.ndarray, rgb: tuple[int, int, int]) -> bool:
    return bool((np.abs(img - np.array(rgb)).sum(axis=-1) <= 6).sum() > 20)


def test_a_plot_is_a_png_showing_every_series_with_greek_labels(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a glyph missing from the font is a warning: fail on it
        path = line_plot(tmp_path / "sub" / "p.png",
                         [Series("Streaming P=2, τ=1, α=0.5", [1, 2, 3], [3.0, 2.0, 1.0]),
                          Series("DiLoCo H=50", [1, 3], [1.0, 3.0])],
                         x_label="tokens seen", y_label="held-out loss", x_unit="", title="loss vs tokens")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = pixels(path)
    assert img.shape == (600, 960, 3)
    assert has_colour(img, C0) and has_colour(img, C1)


def test_log_axis_drops_points_it_cannot_show_and_nothing_left_is_an_error(tmp_path: Path) -> None:
    kept = drawable([Series("a", [0, 10, 100], [1.0, float("nan"), 2.0]), Series("b", [0], [1.0])], log_x=True)
    assert kept == [Series("a", [100], [2.0])]
    with pytest.raises(PlotError, match="nothing to plot"):
        line_plot(tmp_path / "p.png", [Series("a", [], [])])
    assert not (tmp_path / "p.png").exists()


def round_line(peer: str, t: float, step: int, loss: float | None, sent: int, recv: int, **kw) -> dict:
    return {"event": "round", "peer": peer, "time": t, "step": step, "loss": loss, "bytes_sent": sent,
            "bytes_received": recv, **kw}


def test_a_runs_lines_become_curves_against_tokens_bytes_and_time() -> None:
    run = Run("demo", [
        round_line("A", 100.0, 10, 5.0, 100, 50, tokens=1280),
        round_line("B", 101.0, 10, 5.5, 10, 10, tokens=1280),
        {"event": "final", "peer": "A", "time": 99.0},           # not a round line, but the run's first time
        round_line("A", 104.0, 20, None, 100, 50, tokens=2560),   # no loss: its bytes still count
        round_line("A", 108.0, 30, 4.0, 100, 50, tokens=3840),
    ])
    assert token_axis([run]) == "tokens"
    assert series([run], "loss", "tokens") == [Series("demo A", [1280, 3840], [5.0, 4.0]),
                                               Series("demo B", [1280], [5.5])]
    assert series([run], "loss", "bytes")[0] == Series("demo A", [150, 450], [5.0, 4.0])
    assert series([run], "loss", "time")[0] == Series("demo A", [1.0, 9.0], [5.0, 4.0])
    own_script = Run("mine", [round_line("A", 1.0, 5, 3.0, 1, 1)])  # a launched worker: no tokens
    assert token_axis([run, own_script]) == "step"
    assert series([own_script], "loss", "step") == [Series("mine", [5], [3.0])]  # one peer: the run's name


def test_a_run_without_the_metric_is_named() -> None:
    with pytest.raises(PlotError, match="'eval_loss' in b:"):
        check([Run("a", [round_line("A", 1.0, 5, 3.0, 1, 1, eval_loss=2.0)]),
               Run("b", [round_line("A", 1.0, 5, 3.0, 1, 1), {"event": "final", "eval_loss": 2.0}])], "eval_loss")


def test_diloco_plot_writes_three_pngs_and_names_bad_input(tmp_path: Path) -> None:
    run = tmp_path / "run.jsonl"
    run.write_text("".join(json.dumps(round_line("A", 100.0 + i, 10 * i, 5.0 - i / 10, 1000 * i, 900 * i,
                                                 tokens=1280 * i)) + "\n" for i in range(1, 6))
                   + '{"event": "round", "lo')  # a last line cut short, as a live run's may be
    out = CliRunner().invoke(app, ["plot", str(run), "--out", str(tmp_path / "plots")])
    assert out.exit_code == 0, out.output
    names = ["loss-vs-tokens.png", "loss-vs-bytes.png", "loss-vs-time.png"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(names)
    assert all(has_colour(pixels(tmp_path / "plots" / n), C0) for n in names)
    missing = CliRunner().invoke(app, ["plot", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2 and "no such metrics file" in missing.stderr
    wrong = CliRunner().invoke(app, ["plot", str(run), "--metric", "eval_loss", "--out", str(tmp_path / "x")])
    assert wrong.exit_code == 2 and "--eval-every" in wrong.stderr


def test_without_matplotlib_the_install_line_is_named(tmp_path: Path) -> None:
    run = tmp_path / "run.jsonl"
    run.write_text(json.dumps(round_line("A", 1.0, 5, 3.0, 1, 1)) + "\n")
    out = fresh_python("from diloco.cli.main import main\n"
                       f"main(['plot', {str(run)!r}, '--out', {str(tmp_path / 'p')!r}])", without=["matplotlib"])
    assert out.returncode == 2, out.stderr
    assert 'matplotlib, which is not installed: pip install "diloco[plot]"' in out.stderr
    assert not (tmp_path / "p").exists()


def test_b1_plots_are_redrawn_from_a_saved_result(tmp_path: Path) -> None:
    saved = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "convergence-2026-11-23.json"
    out = CliRunner().invoke(app, ["bench", "convergence", "--plots", str(tmp_path), "--replot", str(saved)])
    assert out.exit_code == 0, out.output
    for name in ("b1-loss-vs-tokens.png", "b1-loss-vs-bytes.png"):
        img = pixels(tmp_path / name)
        assert has_colour(img, C0) and has_colour(img, C1)
    assert CliRunner().invoke(app, ["bench", "convergence", "--replot", str(saved)]).exit_code == 2
