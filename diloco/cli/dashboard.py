"""The demo's live view and summary, as rich renderables built from plain data (no I/O here).

The live table fits the terminal: `fit_columns` keeps the most telling columns and drops the others
(the bytes received first, then the time blocked, the inner step, ...) until the table fits the width it is drawn at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class PeerView:
    index: int
    alive: bool
    exit_code: int | None
    round: int
    step: int
    loss: float | None
    bytes_sent: int
    bytes_received: int
    done: bool = False
    utilization: float | None = None  # inner-step compute time / wall time so far
    blocked_seconds: float | None = None  # time the loop waited for an exchange
    mean_bps: float | None = None  # bytes/s sent + received, over the whole run
    peak_bps: float | None = None  # bytes/s of the fastest round


HEADERS = ("peer", "state", "round", "step", "loss", "sent", "recv", "util", "blocked", "Mbit/s avg/max")
"""The live table's columns, in the order shown. `util`: compute utilization; `blocked`: time the
training loop waited for the network; Mbit/s: sent + received, mean over the run / fastest round."""
KEEP = ("peer", "state", "round", "loss", "util", "Mbit/s avg/max", "sent", "step", "blocked", "recv")
"""The columns by how much they tell: narrow terminals drop them from the end of this list."""


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _state(p: PeerView) -> Text:
    if p.alive:
        return Text("training", style="green")
    if p.done or p.exit_code == 0:
        return Text("done", style="cyan")
    return Text(f"exited {p.exit_code}", style="red")


def peer_row(p: PeerView, target_rounds: int) -> tuple[str | Text, ...]:
    bw = "-" if p.mean_bps is None or p.peak_bps is None else f"{p.mean_bps * 8 / 1e6:.2f}/{p.peak_bps * 8 / 1e6:.1f}"
    return (f"peer {p.index}", _state(p), f"{p.round}/{target_rounds}", str(p.step),
            "-" if p.loss is None else f"{p.loss:.3f}", _mb(p.bytes_sent), _mb(p.bytes_received),
            "-" if p.utilization is None else f"{100 * p.utilization:.1f}%",
            "-" if p.blocked_seconds is None else f"{p.blocked_seconds:.1f} s", bw)


def table_width(widths: Iterable[int]) -> int:
    """Width of a rich Table with these column widths: a padding of 1 on each side and a border
    between columns and at both edges."""
    ws = list(widths)
    return sum(w + 2 for w in ws) + len(ws) + 1


def fit_columns(headers: Sequence[str], rows: Sequence[Sequence[str | Text]], width: int,
                keep: Sequence[str] = KEEP) -> list[int]:
    """Indices of the columns to show, in the order of `headers`: all of them if they fit in `width`,
    else without the least telling ones (the end of `keep`), so that no header or cell is cut."""
    natural = [max([len(h), *(len(str(r[i])) for r in rows)]) for i, h in enumerate(headers)]
    shown = list(range(len(headers)))
    for name in reversed(keep):
        if table_width(natural[i] for i in shown) <= width or len(shown) <= 2:
            break
        shown.remove(headers.index(name))
    return shown


class PeerTable:
    """The live table of every peer's progress, fitted to the width it is drawn at."""

    def __init__(self, peers: list[PeerView], elapsed: float, target_rounds: int) -> None:
        self.peers, self.elapsed, self.target_rounds = peers, elapsed, target_rounds

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        rows = [peer_row(p, self.target_rounds) for p in self.peers]
        shown = fit_columns(HEADERS, rows, options.max_width)
        alive = sum(p.alive for p in self.peers)
        table = Table(title=f"diloco demo — {alive}/{len(self.peers)} peers alive — {self.elapsed:.0f}s", expand=False)
        for i in shown:
            table.add_column(HEADERS[i], justify="left" if HEADERS[i] in ("peer", "state") else "right",
                             no_wrap=True)
        for row in rows:
            table.add_row(*(row[i] for i in shown))
        yield table


def render(peers: list[PeerView], elapsed: float, target_rounds: int) -> PeerTable:
    return PeerTable(peers, elapsed, target_rounds)


def demo_progress(peers: Sequence[PeerView], target_rounds: int, inner_steps: int) -> float:
    """Rounds done, as the mean over peers of their inner steps over the run's (a finished peer counts
    whole): what the demo's progress bar shows, in rounds."""
    if not peers:
        return 0.0
    total = target_rounds * inner_steps
    return target_rounds * sum(1.0 if p.done else min(1.0, p.step / total) for p in peers) / len(peers)


def demo_status(peers: Sequence[PeerView], target_rounds: int) -> str:
    """'round 3/8 (slowest peer), 4 training' (', 1 done', ', 1 failed' when some ended)."""
    training = sum(p.alive for p in peers)
    done = sum(not p.alive and (p.done or p.exit_code == 0) for p in peers)
    failed = len(peers) - training - done
    return (f"round {min((p.round for p in peers), default=0)}/{target_rounds} (slowest peer), {training} training"
            + (f", {done} done" if done else "") + (f", {failed} failed" if failed else ""))


def summary_table(s: dict[str, Any]) -> Table:
    table = Table(title="diloco demo — summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    if not s.get("peers_finished"):
        table.add_row("result", Text(f"failed: {s.get('reason')}", style="red"))
        return table
    table.add_row("peers finished", str(s["peers_finished"]))
    table.add_row("rounds committed", str(s["rounds"]))
    table.add_row("held-out loss (global model)", f"{s['heldout_loss']:.4f}  (untrained: {s['initial_loss_reference']})")
    table.add_row("global state identical on all peers", "yes" if s["digests_agree"] else Text("NO", style="red"))
    table.add_row("parameters", f"{s['params']:,}")
    table.add_row("inner steps (all peers)", f"{s['inner_steps_total']:,}")
    spec = s.get("compression_spec") or s.get("compression")  # as the user wrote it, e.g. e3m0 (not e3m0:0)
    table.add_row("compression", f"{spec}: {s.get('bits_per_param_sync', 0):.3f} bits/param/sync")
    table.add_row("bytes sent (all peers)", _mb(s["bytes_sent_total"]))
    table.add_row("per-step data-parallel would send", _mb(s["data_parallel_bytes"]))
    if s.get("reduction_vs_data_parallel"):
        table.add_row("reduction vs data-parallel", f"{s['reduction_vs_data_parallel']}×")
    streaming = s.get("streaming") or {}
    if (streaming.get("fragments") or 1) > 1 or streaming.get("overlap") or streaming.get("outer_overlap") not in (None, "none"):
        table.add_row("streaming", f"{streaming.get('fragments')} fragments, tau={streaming.get('overlap')}, "
                                   f"alpha={streaming.get('alpha')}, outer overlap {streaming.get('outer_overlap')}")
    utils = [u for u in s.get("utilization_per_peer") or [] if u is not None]
    if utils:
        blocked = [b for b in s.get("blocked_seconds_per_peer") or [] if b is not None]
        table.add_row("compute utilization (mean of peers)", f"{100 * sum(utils) / len(utils):.1f}%  "
                      f"(blocked on the network: {sum(blocked) / max(1, len(blocked)):.1f} s per peer)")
    table.add_row("wall time", f"{s['wall_seconds']:.0f} s")
    return table
