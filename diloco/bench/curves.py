"""`diloco plot RUN.jsonl...`: any run's curves from its metrics lines (`--metrics` of start, join, demo
or a launched worker): a metric (the inner loss by default) against tokens, bytes on the wire and
wall-clock time, one curve per peer of each run.

What each axis is, from the round lines (docs/CLI.md, "Metrics"):

- tokens: `tokens` (the bundled job's round lines carry the tokens the peer trained on); lines of
  your own script do not, and the axis is then the peer's inner steps (`step`);
- bytes: the peer's bytes on the wire so far, sent and received, summed over its round lines (each
  line counts its own round's);
- time: seconds since the run's first line (`time`), so that the peers of one run share a clock.

Everything here is pure but `plot_runs`, which draws through `diloco.bench.plot` (matplotlib).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .plot import PlotError, Series, line_plot


@dataclass(frozen=True)
class Run:
    """One metrics file: its name in legends, and its lines."""

    name: str
    lines: list[dict[str, Any]]


@dataclass(frozen=True)
class Axis:
    key: str
    label: str
    log: bool = False
    unit: str | None = None


AXES = {
    "tokens": Axis("tokens", "tokens seen by the peer", unit=""),
    "step": Axis("step", "inner steps of the peer", unit=""),
    "bytes": Axis("bytes", "bytes on the wire by the peer (sent + received)", log=True, unit="B"),
    "time": Axis("time", "wall-clock time since the run's first line", unit="s"),
}


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _short(peer: str) -> str:
    """A peer id as legends show it: its tail (every libp2p peer id starts with the same "12D3KooW")."""
    return peer if len(peer) <= 8 else "…" + peer[-6:]


def _peers(run: Run) -> dict[str, list[dict[str, Any]]]:
    """The run's round lines by peer, in the order they were written."""
    out: dict[str, list[dict[str, Any]]] = {}
    for line in run.lines:
        if isinstance(line, dict) and line.get("event") == "round":
            out.setdefault(str(line.get("peer") or ""), []).append(line)
    return out


def _xs(lines: list[dict[str, Any]], key: str, t0: float) -> list[float | None]:
    """Each line's position on axis `key` (None where a line does not say)."""
    if key == "bytes":
        total, out = 0.0, []
        for line in lines:
            total += sum(_number(line.get(k)) or 0.0 for k in ("bytes_sent", "bytes_received"))
            out.append(total)
        return [*out]
    if key == "time":
        return [None if (t := _number(line.get("time"))) is None else t - t0 for line in lines]
    return [_number(line.get(key)) for line in lines]


def token_axis(runs: Sequence[Run]) -> str:
    """"tokens" when every round line carries them, else "step"."""
    lines = [line for run in runs for peer in _peers(run).values() for line in peer]
    return "tokens" if lines and all(_number(line.get("tokens")) is not None for line in lines) else "step"


def series(runs: Sequence[Run], metric: str, axis: str) -> list[Series]:
    """One series per (run, peer): `metric` against `axis` ("tokens", "step", "bytes" or "time")."""
    out = []
    for run in runs:
        peers = _peers(run)
        times = [t for line in run.lines if isinstance(line, dict) and (t := _number(line.get("time"))) is not None]
        t0 = min(times, default=0.0)
        for peer, lines in peers.items():
            label = run.name if len(peers) == 1 else f"{run.name} {_short(peer)}"
            xs, ys = [], []
            for x, line in zip(_xs(lines, axis, t0), lines):
                y = _number(line.get(metric))
                if x is not None and y is not None:
                    xs.append(x)
                    ys.append(y)
            out.append(Series(label, xs, ys))
    return out


def check(runs: Sequence[Run], metric: str) -> None:
    """Raise `PlotError` naming every run without a round line that carries `metric`."""
    empty = [run.name for run in runs
             if not any(_number(line.get(metric)) is not None for lines in _peers(run).values() for line in lines)]
    if empty:
        raise PlotError(f"no round line with a numeric {metric!r} in {', '.join(empty)}: plot files written by "
                        "`--metrics PATH` of diloco start/join/demo or a launched worker (and for --metric "
                        "eval_loss, a run with --eval-every N)")


def plot_runs(runs: Sequence[Run], out_dir: str | Path, metric: str = "loss") -> list[Path]:
    """Write `<metric>-vs-tokens.png` (or `-vs-step`), `-vs-bytes.png` and `-vs-time.png` to `out_dir`."""
    check(runs, metric)
    written = []
    for key in (token_axis(runs), "bytes", "time"):
        axis = AXES[key]
        written.append(line_plot(Path(out_dir) / f"{metric}-vs-{key}.png", series(runs, metric, key), log_x=axis.log,
                                 x_label=axis.label, y_label=metric.replace("_", " "), x_unit=axis.unit,
                                 title=f"{metric.replace('_', ' ')} vs {key}"))
    return written
