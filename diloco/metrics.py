"""Machine-readable output: JSON lines appended per event, and an atomically replaced status file.

`--metrics PATH` appends one line per synchronization (`event: "round"`) and one at the end
(`event: "final"`); the fields are listed in README ("Metrics"). The status file is what the demo's
live view polls: the peer's latest step, loss and byte counters, rewritten atomically.

Failure semantics: a write that fails (disk full, the directory gone, no file descriptor left) never
stops a peer: it is counted in `write_failures` (reported in the final line, if that one gets
written), logged once per file and kind of error, and training goes on.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

write_failures: Counter[str] = Counter()
"""Writes that failed in this process, by what was written ("metrics", "status")."""
_logged: set[tuple[str, str, int | None]] = set()


def _failed(kind: str, path: Path, error: OSError) -> None:
    write_failures[kind] += 1
    if (kind, str(path), error.errno) not in _logged and len(_logged) < 100:
        _logged.add((kind, str(path), error.errno))
        log.warning("event=%s_write_failed path=%s reason=%s: training goes on without it; free disk space, "
                    "fix the path, or raise the open-files limit (`ulimit -n`)", kind, path, error)


class MetricsWriter:
    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # the writes will fail too, and be counted
                _failed("metrics", self.path, e)

    def write(self, event: str, **fields: Any) -> None:
        """Append one line (a failure is counted and logged once: see the module's failure semantics)."""
        if self.path is None:
            return
        line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}, sort_keys=True)
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as e:
            _failed("metrics", self.path, e)


def write_status(path: str | os.PathLike[str] | None, **fields: Any) -> None:
    """Replace the status file atomically (write a temp file, then rename over); a failure is counted
    and logged once."""
    if not path:
        return
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps({"time": time.time(), **fields}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        _failed("status", path, e)


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
