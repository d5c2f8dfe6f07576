"""Machine-readable output: JSON lines appended per event, and an atomically replaced status file.

`--metrics PATH` appends one line per synchronization (`event: "round"`) and one at the end
(`event: "final"`); the fields are listed in README ("Metrics"). The status file is what the demo's
live view polls: the peer's latest step, loss and byte counters, rewritten atomically.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}, sort_keys=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def write_status(path: str | os.PathLike[str] | None, **fields: Any) -> None:
    """Replace the status file atomically (write a temp file, then rename over)."""
    if not path:
        return
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"time": time.time(), **fields}), encoding="utf-8")
    os.replace(tmp, path)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete lines of a metrics file (a partially written last line is skipped)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    except FileNotFoundError:
        pass
    return out


def read_status(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        status: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
        return status
    except (FileNotFoundError, json.JSONDecodeError):
        return None
