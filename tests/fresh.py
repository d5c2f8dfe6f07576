"""Code in a fresh interpreter (this one's, with this checkout installed): what a test needs a process of its own for
(a package made missing, an environment variable read at start, memory it must not share with the test)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Sequence


def fresh_python(code: str, *, without: Sequence[str] = (), timeout: float = 60,
                 **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run `code` with `python -c` and capture its output as text; importing each package in `without` fails there
    as it does when the package is not installed. `kwargs` go to `subprocess.run` (`env=`, `cwd=`, `check=`)."""
    prelude = "".join(f"import sys; sys.modules[{name!r}] = None\n" for name in without)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=timeout,
                          **kwargs)
