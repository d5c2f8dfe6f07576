"""diloco/procmem.py: resident memory of a process and of everything below it, from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from diloco.procmem import family_rss_mib, rss_mib

pytestmark = pytest.mark.unit


def test_a_family_counts_its_children_and_a_gone_process_counts_nothing():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"],
                             stdout=subprocess.PIPE)
    try:
        own, alone = rss_mib([os.getpid()]), rss_mib([child.pid])
        deadline = time.monotonic() + 20
        while alone < 64:  # until the child has touched its 64 MiB
            assert time.monotonic() < deadline and child.poll() is None, alone
            time.sleep(0.05)
            alone = rss_mib([child.pid])
        family, just_child = family_rss_mib([os.getpid(), child.pid])
        assert own > 10 and just_child >= 64
        assert family >= own + 64 - 5  # ours (which may have moved a little since) plus the child's
    finally:
        child.kill()
        child.wait()
    assert rss_mib([child.pid]) == 0 and family_rss_mib([child.pid]) == [0.0]
