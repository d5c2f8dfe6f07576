"""Files of lines, replaced atomically: the addresses a launched peer publishes and keeps for a restart."""

from __future__ import annotations

import os
from pathlib import Path


def write_lines(path: str | os.PathLike[str], lines: list[str]) -> None:
    """Replace `path` with `lines` atomically (a reader never sees half a file)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def read_lines(path: str | os.PathLike[str]) -> list[str]:
    """The non-blank lines of `path`; none when it cannot be read (not written yet)."""
    try:
        return [line for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError:
        return []
