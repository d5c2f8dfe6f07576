"""Progress output: which mode, what a line says, when plain lines are written, and that live lines
fit the terminal. Time comes from a fake clock, so nothing here depends on the machine's speed."""

from __future__ import annotations

import io
import threading

import pytest
from rich.console import Console

from diloco import progress
from diloco.progress import Reporter, TaskView, choose_mode, duration, eta_seconds, plain_line, task_line

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_mode_is_quiet_when_asked_live_on_a_terminal_and_lines_elsewhere():
    assert choose_mode(quiet=True, isatty=True, term="xterm") == "quiet"
    assert choose_mode(quiet=False, isatty=True, term="xterm") == "live"
    assert choose_mode(quiet=False, isatty=True, term="dumb") == "lines"
    assert choose_mode(quiet=False, isatty=False, term="xterm") == "lines"
    assert choose_mode(quiet=False, isatty=True, term="xterm", live=False) == "lines"  # demo --no-live


def test_time_left_and_durations():
    assert eta_seconds(0, 100, 5.0) is None and eta_seconds(10, None, 5.0) is None
    assert eta_seconds(25, 100, 10.0) == pytest.approx(30.0)
    assert [duration(s) for s in (0.4, 42, 185, 3720)] == ["0 s", "42 s", "3m05s", "1h02m"]


def test_a_plain_line_says_status_how_far_rate_and_time_left():
    v = TaskView("simulate", done=1200, total=8000, unit="steps", status="round 3/10", elapsed=300.0)
    assert plain_line(v) == "simulate: round 3/10 - 1,200/8,000 steps (15%), 4.0 steps/s, 28m20s left"
    slow = TaskView("training", done=2, total=10, unit="rounds", status="", elapsed=50.0)
    assert plain_line(slow) == "training - 2/10 rounds (20%), 25.0 s/round, 3m20s left"
    blob = TaskView("checkpoint", done=300e6, total=1.2e9, unit="bytes", status="", elapsed=2.0)
    assert "300.0 MB/1.2 GB (25%), 150.0 MB/s, 6 s left" in plain_line(blob)


def test_live_lines_fit_80_columns_dropping_rate_then_amount():
    v = TaskView("[2/5] DiLoCo H=50", done=1200, total=8000, unit="steps",
                 status="round 3/10, 16/16 workers", elapsed=300.0)
    wide = task_line(v, 200)
    assert all(part in wide for part in ("steps/s", "1,200/8,000 steps", "15%", "28m20s left", "round 3/10"))
    narrow = task_line(v, 80)
    assert len(narrow) <= 80 and "round 3/10, 16/16 workers" in narrow and "28m20s left" in narrow
    assert "steps/s" not in narrow  # the rate goes first
    tiny = task_line(v, 30)
    assert len(tiny) <= 30 and tiny.startswith("[2/5] DiLoCo H=50")


def test_lines_mode_writes_on_status_changes_and_every_30_s_of_progress_only():
    out, clock = io.StringIO(), Clock()
    with Reporter("lines", stream=out, clock=clock) as rep:
        with rep.task("training", total=20, unit="rounds") as t:
            for step in range(1, 101):  # 10 rounds of 10 steps, one line per round
                clock.now += 0.1
                t.update(step / 10, status=f"round {step // 10}/20" if step % 10 == 0 else None)
            clock.now += 31
            t.update(10)  # nothing advanced: no line
            clock.now += 1
            t.update(10.5)  # no status change, but 30 s passed since the last line and the work advanced
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 + 1 + 1, lines  # per round, one heartbeat, the final line
    assert lines[0].startswith("training: round 1/20 - 1/20 rounds (5%)")
    assert lines[-2].startswith("training: round 10/20 - 10.5/20 rounds")
    assert lines[-1] == "training: done in 42 s (round 10/20)"


def test_quiet_writes_nothing_and_say_is_silent_too():
    out = io.StringIO()
    with Reporter("quiet", stream=out) as rep, rep.task("x", total=3) as t:
        t.update(1, status="a")
        rep.say("a result line")
    assert out.getvalue() == ""


def test_live_display_fits_80_columns():
    console = Console(width=80, record=True, force_terminal=True)
    rep = Reporter("live", console=console, clock=Clock())
    t = rep.task("simulate 16 workers", total=8000)
    t.update(4000, status="round 5/10, 16/16 workers running, loss 2.345")
    console.print(rep._renderable())
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()) and "round 5/10" in text


def test_transfers_report_to_the_running_commands_reporter_when_large():
    out, clock = io.StringIO(), Clock()
    assert progress.current().mode == "quiet"  # no command running: library code stays silent
    with Reporter("lines", stream=out, clock=clock, min_transfer_bytes=1000) as rep:
        assert progress.current() is rep
        with progress.transfer("small", 999) as t:
            t.update(999)
        with progress.transfer("writing checkpoint", 2000) as t:
            clock.now += 2
            t.update(2000, status="ckpt-000000000003")
    assert progress.current().mode == "quiet"
    lines = out.getvalue().splitlines()
    assert not any("small" in ln for ln in lines)
    assert lines == ["writing checkpoint: ckpt-000000000003 - 2.0 kB/2.0 kB (100%), 1.0 kB/s, 0 s left",
                     "writing checkpoint: done in 2 s (ckpt-000000000003)"]


def test_a_checkpoint_write_reports_its_bytes_to_the_end(tmp_path, monkeypatch):
    import numpy as np

    from diloco import checkpoint
    from diloco.checkpoint import load_latest, save

    monkeypatch.setattr(checkpoint, "_PROGRESS_SECONDS", 0.001)  # a 40 MiB write is reported several times
    big = np.ones(40 << 20, dtype=np.uint8)
    seen: list[tuple[int, int]] = []
    save(tmp_path, 7, {"big": big, "small": np.zeros(2, dtype=np.float32)}, {"round": 7},
         progress=lambda done, total: seen.append((done, total)))
    total = big.nbytes + 8
    assert len(seen) >= 2 and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert load_latest(tmp_path) is not None


def test_time_left_counts_down_between_updates():
    v = TaskView("x", done=25, total=100, unit="steps", status="", elapsed=12.0, since_update=2.0)
    assert v.left == pytest.approx(30.0 - 2.0)  # 25 steps in 10 s: 30 s left then, 28 s now
    assert "2.5 steps/s" in plain_line(v)


def test_a_task_counted_in_seconds_has_no_rate_and_the_rest_of_its_seconds_left():
    """A timed phase (`bench chaos`: 90 s of faults) that starts after a setup: 0.0 s done after 20 s elapsed is
    no rate of 0 (nor 'left: forever'), 30 s done of 90 leaves 60 s whatever the setup took."""
    v = TaskView("chaos", done=0.0, total=90.0, unit="s", status="", elapsed=20.0)
    assert plain_line(v) == "chaos - 0/90 s (0%), 1m30s left"
    assert TaskView("chaos", done=30.0, total=90.0, unit="s", status="", elapsed=55.0, since_update=1.0).left == 59.0


def test_a_long_status_loses_its_trailing_details_before_the_bar_and_time_left():
    v = TaskView("training", done=1.5, total=3, unit="rounds", elapsed=10.0,
                 status="round 1/3, loss 4.992, 4 peers, 0.85 Mbit/s, sent 12.3 MB, recv 12.1 MB")
    line = task_line(v, 80)
    assert len(line) <= 80 and "50%" in line and "left" in line and "round 1/3, loss 4.992" in line
    assert "recv" not in line


def test_live_mode_leaves_one_line_per_finished_task_and_the_messages():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=80)
    with Reporter("live", console=console) as rep:
        for k in range(20):  # open, update and close from two threads while the display refreshes
            with rep.task(f"task {k}", total=10) as t:
                worker = threading.Thread(target=lambda: [t.update(i) for i in range(11)])
                worker.start()
                worker.join()
        rep.say("a variant's result")
    out = buf.getvalue()
    assert all(f"task {k}: done in" in out for k in range(20)) and "a variant's result" in out


def test_every_long_command_takes_quiet():
    from typer.testing import CliRunner

    from diloco.cli.main import app

    for cmd in (["start"], ["join"], ["demo"], ["simulate"], ["bench", "codecs"], ["bench", "convergence"],
                ["bench", "overlap"], ["bench", "flood"], ["bench", "site"]):
        out = CliRunner().invoke(app, [*cmd, "--help"], terminal_width=200)
        assert out.exit_code == 0 and "--quiet" in out.output, cmd
