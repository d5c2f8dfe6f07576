"""Line plots as PNG files, drawn by matplotlib (`pip install "diloco[plot]"`): the benchmarks' curves
and `diloco plot`.

    line_plot("b1.png", [Series("data-parallel", xs, ys), ...], log_x=True, x_label="bytes sent",
              y_label="held-out loss", x_unit="B")

One line with point markers per series, a legend, a grid, engineering-notation ticks (1.5 MB, 200 k),
text in DejaVu Sans (Greek letters included: "τ=1, α=0.5" reads as written). matplotlib draws off
screen (its Agg canvas, no display, no global pyplot state), so plotting works on a headless box
and from threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..compression.errors import DiLoCoError

INSTALL_HINT = 'pip install "diloco[plot]"'


class PlotError(DiLoCoError, RuntimeError):
    """A plot cannot be drawn; the message says why and what to do."""


@dataclass(frozen=True)
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]


def require_matplotlib() -> None:
    """Raise `PlotError` naming the install line when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(f"plots are drawn with matplotlib, which is not installed: {INSTALL_HINT}") from None


def drawable(series: Sequence[Series], log_x: bool) -> list[Series]:
    """Pure: the series with only the points a plot can show (finite, x > 0 on a log axis); series left
    empty are dropped. Raises `PlotError` when nothing is left."""
    out = []
    for s in series:
        pts = [(x, y) for x, y in zip(s.xs, s.ys)
               if math.isfinite(x) and math.isfinite(y) and (x > 0 or not log_x)]
        if pts:
            out.append(Series(s.label, [x for x, _ in pts], [y for _, y in pts]))
    if not out:
        raise PlotError("nothing to plot: every series is empty (or has no finite point"
                        + (" with x > 0 for the log axis)" if log_x else ")"))
    return out


def line_plot(path: str | Path, series: Sequence[Series], *, log_x: bool = False, x_label: str = "",
              y_label: str = "", title: str = "", x_unit: str | None = None) -> Path:
    """Draw `series` as lines against shared axes and write a PNG to `path` (its directory is created).
    `x_unit`: label the x ticks in engineering notation with this unit ("B", "s"; "" for none)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    shown = drawable(series, log_x)
    fig = Figure(figsize=(8, 5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s in shown:
        ax.plot(s.xs, s.ys, marker="o", markersize=3, linewidth=1.6, label=s.label)
    if log_x:
        ax.set_xscale("log")
    if x_unit is not None:
        ax.xaxis.set_major_formatter(EngFormatter(unit=x_unit))
    ax.set_xlabel(x_label, fontsize=11)
    ax.set_ylabel(y_label, fontsize=11)
    if title:
        ax.set_title(title, fontsize=12)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=9, loc="best")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
