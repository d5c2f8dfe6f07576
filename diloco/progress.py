"""Progress of long work: a live display on a terminal, plain lines elsewhere, nothing with --quiet.

Every long-running command makes one `Reporter` (`Reporter.for_command(quiet=...)`) and opens a task
for each piece of work::

    with Reporter.for_command(quiet=quiet) as rep, rep.task("simulate", total=8000, unit="steps") as t:
        t.update(1200, status="round 3/10, 16/16 workers")

What the user sees depends on the mode (`choose_mode`, decided once per command):

- ``live`` (stderr is a terminal): one line per open task, redrawn 4 times a second and fitted to the
  terminal's width (`task_line`): what runs, a bar, its status, how far, the rate and the time left.
  A finished task leaves one line behind.
- ``lines`` (stderr is not a terminal: logs, CI): a line when a task's status changes (a round ended,
  a variant started), one at most every `LINE_EVERY` seconds in between while the work advances, and
  one when it ends (`plain_line`); each line is flushed at once.
- ``quiet`` (``--quiet``): nothing. Results and errors still print; they are not progress.

Progress goes to stderr, so stdout keeps only a command's results.

Library code that moves many bytes (a checkpoint write, a joiner's state download) reports through
`transfer`, which goes to the reporter of the command running it, if any; it is a no-op otherwise
(a library user's own program) and for transfers smaller than `LARGE_BYTES`::

    with progress.transfer("downloading state", total_bytes) as t:
        for chunk in chunks:
            ...
            t.update(done_bytes)

The decisions (mode, what a line says, how it fits a width) are small pure functions; `Reporter`
only keeps the state and does the writing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Callable, Iterator, Literal

if TYPE_CHECKING:  # rich is imported only when a live display starts
    from rich.console import Console, RenderableType
    from rich.live import Live

Mode = Literal["live", "lines", "quiet"]

LINE_EVERY = 30.0
"""Plain-lines mode: seconds after which advancing work earns a line even if its status did not change."""
LARGE_BYTES = 64 << 20
"""`transfer`s smaller than this are not shown (they take well under a second)."""
BAR_WIDTH = 16


# ---------------------------------------------------------------------- decisions (pure)


def choose_mode(*, quiet: bool, isatty: bool, term: str | None, live: bool = True) -> Mode:
    """quiet wins; a live display needs a terminal that can redraw (and `live`, e.g. not --no-live)."""
    if quiet:
        return "quiet"
    if live and isatty and term != "dumb":
        return "live"
    return "lines"


def eta_seconds(done: float, total: float | None, elapsed: float) -> float | None:
    """Time left at the average rate so far; None before there is a rate or without a total."""
    if not total or done <= 0 or elapsed <= 0:
        return None
    return max(0.0, elapsed * (total - done) / done)


def duration(seconds: float) -> str:
    """42 s, 3m05s, 1h02m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _count(n: float) -> str:
    return f"{n:,.0f}" if n == int(n) or n >= 100 else f"{n:.1f}"


def amount(done: float, total: float | None, unit: str) -> str:
    """'1,200/8,000 steps', '3.5/10 rounds', '12.0 MB/1.2 GB'."""
    if unit == "bytes":
        return _bytes(done) + (f"/{_bytes(total)}" if total else "")
    return _count(done) + (f"/{_count(total)}" if total else "") + f" {unit}"


def rate(done: float, elapsed: float, unit: str) -> str | None:
    """'12.3 MB/s', '4.2 steps/s', or '2.5 s/round' when slower than one a second; none for a task counted in
    seconds (a clock runs at one second a second, whatever came before it started)."""
    if done <= 0 or elapsed <= 0 or unit == "s":
        return None
    r = done / elapsed
    if unit == "bytes":
        return f"{_bytes(r)}/s"
    if r >= 1:
        return f"{r:.1f} {unit}/s"
    return f"{1 / r:.1f} s/{unit[:-1] if unit.endswith('s') else unit}"


@dataclass(frozen=True)
class TaskView:
    """A task at one instant: everything a line about it may say."""

    what: str
    done: float
    total: float | None
    unit: str
    status: str
    elapsed: float
    since_update: float = 0.0
    """Seconds since `done` last changed: rate and time left are as of then, less the time since."""

    @property
    def rate_elapsed(self) -> float:
        return max(0.0, self.elapsed - self.since_update)

    @property
    def left(self) -> float | None:
        if self.unit == "s" and self.total:  # counted in seconds: what is left of them
            return max(0.0, self.total - self.done - self.since_update)
        eta = eta_seconds(self.done, self.total, self.rate_elapsed)
        return None if eta is None else max(0.0, eta - self.since_update)


def plain_line(v: TaskView) -> str:
    """One line for logs: 'simulate: round 3/10 - 1,200/8,000 steps (15%), 4.2 steps/s, 27m10s left'."""
    head = f"{v.what}: {v.status}" if v.status else v.what
    facts = [amount(v.done, v.total, v.unit) + (f" ({v.done / v.total:.0%})" if v.total else "")]
    r = rate(v.done, v.rate_elapsed, v.unit)
    if r:
        facts.append(r)
    left = v.left
    if left is not None:
        facts.append(f"{duration(left)} left")
    return f"{head} - {', '.join(facts)}"


def finished_line(v: TaskView, outcome: str = "done") -> str:
    """The line a task leaves when it ends: 'simulate: done in 3m05s (round 10/10)'."""
    return f"{v.what}: {outcome} in {duration(v.elapsed)}" + (f" ({v.status})" if v.status else "")


def bar(done: float, total: float | None, width: int = BAR_WIDTH) -> str:
    if not total:
        return ""
    filled = min(width, max(0, round(width * done / total)))
    return "█" * filled + "░" * (width - filled) + f" {min(1.0, done / total):4.0%}"


def task_line(v: TaskView, width: int) -> str:
    """The live display's line for a task, at most `width` characters. Parts in the order shown:
    what, bar, status, amount, rate, time left. When they do not fit, the rate goes first, then the
    amount, then the status's trailing comma-separated details one by one (its first one stays),
    then the bar and the time left; what is left is cut at `width`."""
    left = v.left
    segments = v.status.split(", ") if v.status else []
    parts: dict[str, str | None] = {
        "what": v.what, "bar": bar(v.done, v.total) or None, "status": v.status or None,
        "amount": amount(v.done, v.total, v.unit), "rate": rate(v.done, v.rate_elapsed, v.unit),
        "eta": f"{duration(left)} left" if left is not None else f"{duration(v.elapsed)} elapsed",
    }
    shown = [k for k, text in parts.items() if text]
    drops = ["rate", "amount", *(["status-tail"] * max(0, len(segments) - 1)), "bar", "eta"]
    for drop in drops:
        if len(_join(parts, shown)) <= width:
            break
        if drop == "status-tail":
            segments.pop()
            parts["status"] = ", ".join(segments)
        elif drop in shown:
            shown.remove(drop)
    return _join(parts, shown)[:width]


def _join(parts: dict[str, str | None], keys: list[str]) -> str:
    return "  ".join(str(parts[k]) for k in keys)


# ---------------------------------------------------------------------- state and output


class Task:
    """A piece of work the reporter shows. `update` may be called from any thread, as often as
    wanted (every inner step): the reporter decides what to write."""

    def __init__(self, reporter: Reporter, what: str, total: float | None, unit: str, shown: bool = True) -> None:
        self.reporter, self.what, self.total, self.unit, self.shown = reporter, what, total, unit, shown
        self.done, self.status = 0.0, ""
        self.started = self.updated = reporter.clock()
        self.closed = False

    def view(self, now: float | None = None) -> TaskView:
        now = self.reporter.clock() if now is None else now
        return TaskView(self.what, self.done, self.total, self.unit, self.status, now - self.started,
                        now - self.updated)

    def update(self, done: float | None = None, total: float | None = None, status: str | None = None) -> None:
        """Set how far the work is (absolute), its total and its status; None leaves one as it is."""
        self.reporter._update(self, done, total, status)

    def advance(self, n: float = 1.0, status: str | None = None) -> None:
        self.update(self.done + n, status=status)

    def close(self, outcome: str = "done") -> None:
        self.reporter._close(self, outcome)

    def __enter__(self) -> Task:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close("done" if exc_type is None else "stopped")


class Reporter:
    """Shows the tasks of one command in one mode (see the module docstring). Use it as a context
    manager: entering starts the live display (in live mode) and makes it the reporter `transfer`
    reports to; leaving stops both."""

    def __init__(self, mode: Mode, *, stream: IO[str] | None = None, console: Console | None = None,
                 clock: Callable[[], float] = time.monotonic, min_transfer_bytes: int = LARGE_BYTES) -> None:
        self.mode, self.clock, self.min_transfer_bytes = mode, clock, min_transfer_bytes
        self._stream, self._console = stream, console
        self._tasks: list[Task] = []
        self._views: list[Callable[[], RenderableType]] = []
        self._last_line: dict[int, tuple[float, str, float]] = {}  # task id -> (when, status, done) of its last line
        self._lock = threading.RLock()
        self._live: Live | None = None

    @classmethod
    def for_command(cls, *, quiet: bool = False, live: bool = True) -> Reporter:
        """The reporter for a CLI command: live on a terminal, lines elsewhere, quiet with --quiet."""
        err = sys.stderr
        return cls(choose_mode(quiet=quiet, isatty=err.isatty(), term=os.environ.get("TERM"), live=live))

    # -- the API commands use

    def task(self, what: str, total: float | None = None, unit: str = "steps") -> Task:
        t = Task(self, what, total, unit)
        with self._lock:
            self._tasks.append(t)
            self._last_line[id(t)] = (t.started, "", 0.0)
        return t

    def say(self, text: str) -> None:
        """A message that belongs with the progress (a variant's result, a fault that fired): above the
        live display, or a plain line; nothing when quiet."""
        if self.mode == "live":
            self.console.print(text, markup=False, highlight=False)
        elif self.mode == "lines":
            self._write(text)

    @contextmanager
    def show(self, render: Callable[[], RenderableType]) -> Iterator[None]:
        """Live mode: also show this renderable (e.g. the demo's table), above the tasks, while inside."""
        with self._lock:
            self._views.append(render)
        try:
            yield
        finally:
            with self._lock:
                self._views.remove(render)

    def transfer(self, what: str, total_bytes: int) -> Task:
        """A task counting bytes; shown only when at least `min_transfer_bytes` (a silent Task otherwise)."""
        if total_bytes < self.min_transfer_bytes or self.mode == "quiet":
            return Task(self, what, total_bytes, "bytes", shown=False)
        return self.task(what, total_bytes, unit="bytes")

    # -- context

    def __enter__(self) -> Reporter:
        _active.append(self)
        if self.mode == "live":
            from rich.live import Live

            # stdout writes go above the display only when stdout is that terminal too (not `> file`)
            self._live = Live(console=self.console, refresh_per_second=4, transient=True,
                              get_renderable=self._renderable, redirect_stdout=sys.stdout.isatty())
            self._live.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self in _active:
            _active.remove(self)

    # -- internals

    @property
    def console(self) -> Console:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True)
        return self._console

    def _update(self, t: Task, done: float | None, total: float | None, status: str | None) -> None:
        with self._lock:
            if t.closed:
                return
            if total is not None:
                t.total = total
            if done is not None:
                done = min(done, t.total) if t.total else done
                if done != t.done:
                    t.done, t.updated = done, self.clock()
            if status is not None:
                t.status = status
            if self.mode != "lines" or not t.shown:
                return
            now = self.clock()
            when, said, done_then = self._last_line[id(t)]
            if t.status != said or (now - when >= LINE_EVERY and t.done > done_then):
                self._last_line[id(t)] = (now, t.status, t.done)
                self._write(plain_line(t.view(now)))

    def _close(self, t: Task, outcome: str) -> None:
        with self._lock:
            if t.closed:
                return
            t.closed = True
            if t in self._tasks:
                self._tasks.remove(t)
            self._last_line.pop(id(t), None)
        live = self._live
        if live is not None:  # outside our lock: rich's refresh thread takes its lock, then ours
            live.refresh()  # the closed task's line goes before its final line is printed
        if t.shown and self.mode != "quiet":
            self.say(finished_line(t.view(), outcome))

    def _renderable(self) -> RenderableType:
        from rich.console import Group
        from rich.text import Text

        with self._lock:
            now = self.clock()
            width = self.console.width
            lines = [Text(task_line(t.view(now), width)) for t in self._tasks if t.shown]
            return Group(*(render() for render in self._views), *lines)

    def _write(self, text: str) -> None:
        out = self._stream or sys.stderr
        sys.stdout.flush()  # results printed so far come before this line in a shared log
        out.write(text + "\n")
        out.flush()


_active: list[Reporter] = []
_QUIET = Reporter("quiet")


def current() -> Reporter:
    """The reporter of the command running now (the innermost entered one), or a quiet one."""
    return _active[-1] if _active else _QUIET


def transfer(what: str, total_bytes: int) -> Task:
    """A byte-counting task on the current command's reporter; see `Reporter.transfer`."""
    return current().transfer(what, total_bytes)

