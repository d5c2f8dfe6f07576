"""Machine-readable output: JSON lines appended per event, and an atomically replaced status file.

`--metrics PATH` appends one line per synchronization (`event: "round"`) and one at the end
(`event: "final"`); the fields are listed in docs/CLI.md ("Metrics"). The status file is what the demo's
live view polls: the peer's latest step, loss and byte counters, rewritten atomically.

The same events can also go to TensorBoard and W&B (`--tensorboard DIR`, `--wandb PROJECT`:
`diloco.sinks`), next to the JSON lines.

A field may be a value still being computed beside training (the digest of the state a round made, hashed
on a thread of its own: `diloco.holding.Later`): its line waits, and the lines after it wait behind it, until
it is there (`then`), so lines keep their order and the training thread never waits for a hash to log a round;
`close()` writes what still waits.

Failure semantics: a write that fails (disk full, the directory gone, no file descriptor left, a
TensorBoard or W&B call that raises) never stops a peer: it is counted in `write_failures` by
what was written (reported in the final line, if that one gets written), logged once per file and
kind of error, and training goes on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from .comms.clock import SWARM_CLOCK

if TYPE_CHECKING:
    from .sinks import Sink, SinkConfig

log = logging.getLogger(__name__)

write_failures: Counter[str] = Counter()
"""Writes that failed in this process, by what was written ("metrics", "status")."""
_logged: set[tuple[str, str, int | None]] = set()


def _failed(kind: str, path: Path | str, error: Exception) -> None:
    write_failures[kind] += 1
    code = getattr(error, "errno", None) if isinstance(error, OSError) else hash(type(error).__name__)
    if (kind, str(path), code) not in _logged and len(_logged) < 100:
        _logged.add((kind, str(path), code))
        log.warning("event=%s_write_failed path=%s reason=%s: training goes on without it; free disk space, "
                    "fix the path, or raise the open-files limit (`ulimit -n`)", kind, path, error)


@runtime_checkable
class Pending(Protocol):
    """A field's value still being computed (`diloco.holding.Later`)."""

    def ready(self) -> bool: ...

    def get(self) -> Any: ...

    def then(self, fn: Callable[[], None]) -> None: ...


class MetricsWriter:
    """JSON lines to `path` (None: none), and the same events to `sinks` (TensorBoard, W&B)."""

    def __init__(self, path: str | os.PathLike[str] | None, sinks: Sequence[Sink] = ()) -> None:
        self.path = Path(path) if path else None
        self.sinks = list(sinks)
        self._waiting: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # the writes will fail too, and be counted
                _failed("metrics", self.path, e)

    def write(self, event: str, **fields: Any) -> None:
        """Append one line and hand the event to each sink (a failure is counted and logged once: see the
        module's failure semantics); a line with a field still being computed is written once it is there."""
        stamped = {"event": event, "time": round(SWARM_CLOCK.now(), 3), **fields}  # one timeline for all peers
        with self._lock:
            self._waiting.append(stamped)
            self._drain(wait=False)
        for value in stamped.values():
            if isinstance(value, Pending):
                value.then(lambda: self.flush(wait=False))

    def flush(self, wait: bool = True) -> None:
        """Write the lines that wait for a value: all of them (`wait`: waiting for their values), or those whose
        values are there."""
        with self._lock:
            self._drain(wait)

    def _drain(self, wait: bool) -> None:
        while self._waiting:
            head = self._waiting[0]
            if not wait and any(isinstance(v, Pending) and not v.ready() for v in head.values()):
                return
            self._waiting.popleft()
            self._append({k: v.get() if isinstance(v, Pending) else v for k, v in head.items()})

    def _append(self, stamped: dict[str, Any]) -> None:
        if self.path is not None:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(stamped, sort_keys=True) + "\n")
            except OSError as e:
                _failed("metrics", self.path, e)
        for sink in self.sinks:
            try:
                sink.log(stamped["event"], stamped)
            except Exception as e:  # noqa: BLE001 - a sink's failure must never stop the peer
                _failed(sink.name, getattr(sink, "log_dir", sink.name), e)

    def close(self) -> None:
        """Write the lines still waiting for a value, and close the sinks (W&B finishes its run)."""
        from .sinks import close_all

        self.flush()
        close_all(self.sinks)
        self.sinks = []


_launched: dict[tuple[str | None, SinkConfig, str], MetricsWriter] = {}


def launched_writer(path: str | None, sinks: SinkConfig, peer: str, run_id: str,
                    config: Mapping[str, Any]) -> MetricsWriter:
    """The one writer of a launched worker's peer (its sinks are opened once, on first use, and stay
    open until `close_launched`). A sink that cannot start is logged and counted, never raised: the
    worker is training already."""
    from .sinks import SinkError

    key = (path, sinks, peer)
    if key not in _launched:
        opened: list[Sink] = []
        try:
            opened = sinks.open(peer, run_id, config) if sinks else []
        except SinkError as e:
            _failed("sinks", sinks.tensorboard or sinks.wandb or "", e)
        _launched[key] = MetricsWriter(path, opened)
    return _launched[key]


def close_launched() -> None:
    """Close every launched writer's sinks (the worker is leaving)."""
    while _launched:
        _launched.popitem()[1].close()


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
