"""The demo's live view and summary, as rich renderables built from plain data (no I/O here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Group
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


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def render(peers: list[PeerView], elapsed: float, target_rounds: int) -> Group:
    alive = sum(p.alive for p in peers)
    table = Table(title=f"diloco demo — {alive}/{len(peers)} peers alive — {elapsed:.0f}s", expand=False)
    for col in ("peer", "state", "round", "step", "inner loss", "sent", "received", "compute util", "blocked", "Mbit/s mean/peak"):
        table.add_column(col, justify="right" if col not in ("peer", "state") else "left")
    for p in peers:
        if p.alive:
            state = Text("training", style="green")
        elif p.done or p.exit_code == 0:
            state = Text("done", style="cyan")
        else:
            state = Text(f"exited {p.exit_code}", style="red")
        loss = "-" if p.loss is None else f"{p.loss:.3f}"
        util = "-" if p.utilization is None else f"{100 * p.utilization:.1f}%"
        blocked = "-" if p.blocked_seconds is None else f"{p.blocked_seconds:.1f} s"
        bw = "-" if p.mean_bps is None or p.peak_bps is None else \
            f"{p.mean_bps * 8 / 1e6:.2f}/{p.peak_bps * 8 / 1e6:.1f}"
        table.add_row(f"peer {p.index}", state, f"{p.round}/{target_rounds}", str(p.step), loss,
                      _mb(p.bytes_sent), _mb(p.bytes_received), util, blocked, bw)
    return Group(table)


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
    table.add_row("compression", f"{s.get('compression')}: {s.get('bits_per_param_sync', 0):.3f} bits/param/sync")
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
