"""Importing diloco and the hivemind layers it uses does not import the rest of hivemind (its averager and scipy),
and the rest is still there for whoever reads it. A fresh interpreter each: what a process has imported is the
point."""

from __future__ import annotations


import pytest
from fresh import fresh_python

pytestmark = pytest.mark.multiproc


def run(code: str) -> str:
    done = fresh_python(code, timeout=90)
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


def test_the_swarm_clock_set_in_hivemind_leaves_the_rest_of_hivemind_unloaded_and_is_read_once_it_loads():
    """Every peer sets its swarm clock in hivemind's modules (comms.clock.use_in_hivemind): that must not read the
    package's own names (it ran all of hivemind's __init__ in every peer, ~0.3 s, until 2026-11-28), and the
    package completed later reads the same clock."""
    out = run("import sys, diloco, hivemind.dht\n"
              "from diloco.comms.clock import use_in_hivemind\n"
              "use_in_hivemind(lambda: 42.0)\n"
              "print(sorted(m for m in ('scipy', 'hivemind.averaging') if m in sys.modules))\n"
              "import hivemind, hivemind.dht.node as node\n"
              "hivemind.DHT  # the package's own names: its __init__ runs now, loading the averager\n"
              "from hivemind.averaging import matchmaking\n"
              "print(matchmaking.get_dht_time(), node.get_dht_time(), 'scipy' in sys.modules)\n")
    assert out.splitlines() == ["[]", "42.0 42.0 True"]


def test_hivemind_imported_before_diloco_is_left_as_it_is():
    out = run("import hivemind, diloco, sys\nprint('__getattr__' in vars(hivemind), 'scipy' in sys.modules)")
    assert out == "False True"


def test_a_package_init_that_failed_runs_again_at_the_next_read_and_its_error_is_the_real_one():
    """As a failed import would: the error reaches the reader, and the next read runs the package's __init__ again
    (here it fails once: its first submodule import raises)."""
    out = run("import sys, diloco, builtins\n"
              "real, calls = builtins.__import__, []\n"
              "def flaky(name, *a, **k):\n"
              "    if name == 'hivemind.averaging' and not calls:\n"
              "        calls.append(name)\n"
              "        raise ImportError('averaging is broken once')\n"
              "    return real(name, *a, **k)\n"
              "builtins.__import__ = flaky\n"
              "import hivemind\n"
              "try:\n"
              "    hivemind.DHT\n"
              "except ImportError as e:\n"
              "    print('first:', e)\n"
              "print('second:', hivemind.DHT.__name__)\n")
    assert out.splitlines() == ["first: averaging is broken once", "second: DHT"]
