"""How `diloco status` shows a swarm's rows (`diloco.cli.status.PeerStatus`): a rich table (once, or live with
`--watch` on a terminal), plain lines (`--watch` into a log or a pipe), or JSON. No I/O here."""

from __future__ import annotations

import json
import time
from typing import Sequence

from rich.table import Table

from ..ending import announced
from ..peers.records import PeerRecord
from .status import PeerStatus

COLUMNS = ("peer", "status", "round", "attempt", "step", "steps/s", "steps/round", "ms/step", "loss", "Mbit/s", "sent",
           "recv", "util",
           "data path", "digest", "heartbeat")


def data_path(rec: PeerRecord) -> str:
    """How this peer's calls travel: "direct" (it has a data port: docs/PROTOCOL.md, "The data plane"), with how
    many members it reached through a relay or libp2p instead; "libp2p" without a data port. A peer that cannot be
    dialed shows where it waits ("called via 1 relay"), a relay says so."""
    if not rec.data:
        return "libp2p"
    parts = ["direct"] + [f"{len(peers)} via {how}" for how, peers in (("relay", rec.relayed), ("libp2p", rec.libp2p))
                          if peers]
    if rec.via:
        parts.append(f"called via {len(rec.via)} relay{'s' if len(rec.via) > 1 else ''}")
    if rec.relay:
        parts.append("relay")
    return ", ".join(parts)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def cells(row: PeerStatus) -> tuple[str, ...]:
    """One row's cells, in `COLUMNS` order ("-" where unknown: an older peer publishes no bandwidth)."""
    rec = row.record
    status = f"{rec.status} ({rec.region})" if rec.region else rec.status  # with --region: which one
    return (rec.peer, status, str(rec.round), str(rec.attempt), str(rec.step),
            "-" if row.steps_per_second is None else f"{row.steps_per_second:.2f}",
            "-" if rec.round_steps is None else str(rec.round_steps),
            "-" if rec.step_seconds is None else f"{1000 * rec.step_seconds:.1f}",
            "-" if rec.loss is None else f"{rec.loss:.3f}",
            "-" if row.bytes_per_second is None else f"{row.bytes_per_second * 8 / 1e6:.2f}",
            _mb(rec.bytes_sent), _mb(rec.bytes_received),
            "-" if rec.utilization is None else f"{100 * rec.utilization:.1f}%",
            data_path(rec), rec.digest or "-",
            "-" if row.heartbeat_age is None else f"{row.heartbeat_age:.1f} s ago")


def title(rows: Sequence[PeerStatus], run_id: str) -> str:
    standby = sum(r.record.status == "standby" for r in rows)  # region members between merges
    end = announced([r.record for r in rows])  # the whole run's end, once a peer announced it (`diloco.ending`)
    return f"swarm {run_id!r}: {sum(r.record.status == 'training' for r in rows)} training" + \
        (f", {standby} on standby" if standby else "") + (f", the run ends at round {end}" if end else "")


def table(rows: Sequence[PeerStatus], run_id: str, caption: str = "") -> Table:
    out = Table(title=title(rows, run_id), caption=caption or None)
    for col in COLUMNS:
        out.add_column(col)
    for row in rows:
        out.add_row(*cells(row))
    return out


def lines(rows: Sequence[PeerStatus], run_id: str, now: float) -> list[str]:
    """A refresh of `--watch` as plain text: a stamped title line, then one line per peer."""
    head = f"{time.strftime('%H:%M:%S', time.localtime(now))} {title(rows, run_id)}"
    return [head, *("  " + "  ".join(f"{k} {v}" for k, v in zip(COLUMNS, cells(row))) for row in rows)]


def json_line(rows: Sequence[PeerStatus], now: float) -> str:
    """A refresh of `--watch --json`: one JSON object on one line."""
    return json.dumps({"time": round(now, 3), "peers": [r.to_json() for r in rows]})
