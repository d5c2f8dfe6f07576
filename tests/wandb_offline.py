"""Reading back what W&B wrote offline, for tests: the history rows of a run's `.wandb` file.

W&B ships no Python reader for it any more (its Go core writes it). The file is W&B's 7-byte header
(":W&B", a 2-byte magic, a version byte) followed by LevelDB's log format: 32 KiB blocks of records,
each with a 7-byte header (CRC32C, length u16 little-endian, type: 1 full, 2 first, 3 middle, 4 last),
each record a `wandb_internal_pb2.Record` protobuf."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if length == 0 and kind == 0:  # zero padding at the end of a block or the file
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(run_dir: Path) -> list[dict[str, Any]]:
    """The rows a run logged (`run.log`), each as {key: value}."""
    (path,) = run_dir.glob("run-*.wandb")
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def run_info(run_dir: Path) -> Any:
    """The run record (name, group, project, config) of an offline run."""
    (path,) = run_dir.glob("run-*.wandb")
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")
