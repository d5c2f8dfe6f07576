"""The README's wrapper example runs as documented and actually trains."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plain_loop.py"


def test_plain_loop_example_trains_with_one_line_change():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "200", "--inner-steps", "50"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    m = re.search(r"rounds committed: (\d+)\s+held-out MSE of the global model: ([0-9.]+)", out.stdout)
    assert m, out.stdout
    assert int(m.group(1)) == 4
    # y = sin(x·w) has variance ≈ 0.33 (predicting 0 scores that); the trained global model does far better.
    assert float(m.group(2)) < 0.1
