"""Importing diloco and the hivemind layers it uses does not import the rest of hivemind (its averager and scipy),
and the rest is still there for whoever reads it. A fresh interpreter each: what a process has imported is the
point."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiproc


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_diloco_imports_hivemind_p2p_and_dht_without_its_averager_and_the_package_completes_when_read():
    out = run("import sys, diloco, hivemind.p2p, hivemind.dht, diloco.peers.records\n"
              "print(sorted(m for m in ('scipy', 'hivemind.averaging', 'hivemind.moe', 'hivemind.optim')"
              " if m in sys.modules))\n"
              "import hivemind\n"
              "from hivemind import Optimizer\n"
              "print(hivemind.DHT is hivemind.dht.DHT, Optimizer.__module__, hivemind.__version__ > '1',"
              " 'scipy' in sys.modules)\n")
    assert out.splitlines() == ["[]", "True hivemind.optim.optimizer True True"]


def test_hivemind_imported_before_diloco_is_left_as_it_is():
    out = run("import hivemind, diloco, sys\nprint('__getattr__' in vars(hivemind), 'scipy' in sys.modules)")
    assert out == "False True"
