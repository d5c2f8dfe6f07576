"""glibc's malloc asked for transparent huge pages in the processes the launcher starts (diloco/hostmem.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fresh import fresh_python
from diloco.hostmem import TUNABLE, VARIABLE, with_huge_pages

pytestmark = pytest.mark.unit

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_the_tunable_is_added_to_what_the_environment_says_and_never_overrides_it():
    assert with_huge_pages({})[VARIABLE] == f"{TUNABLE}=1"
    assert with_huge_pages({"A": "b"}) == {"A": "b", VARIABLE: f"{TUNABLE}=1"}
    kept = {VARIABLE: "glibc.malloc.arena_max=2"}
    assert with_huge_pages(kept)[VARIABLE] == f"glibc.malloc.arena_max=2:{TUNABLE}=1"
    assert kept == {VARIABLE: "glibc.malloc.arena_max=2"}  # the argument is not changed
    for own in (f"{TUNABLE}=0", f"glibc.malloc.arena_max=2:{TUNABLE}=0", f"{TUNABLE}=1"):
        assert with_huge_pages({VARIABLE: own})[VARIABLE] == own


HUGE = """
import re
buf = bytearray(64 << 20)  # above glibc's mmap threshold: fresh pages of their own
for i in range(0, len(buf), 4096):
    buf[i] = 1
rollup = open("/proc/self/smaps_rollup").read()
print(int(re.search(r"AnonHugePages:\\s+(\\d+) kB", rollup).group(1)))
"""


def _huge_kib(env: dict[str, str]) -> int:
    out = fresh_python(HUGE, env=env, check=True)
    return int(out.stdout)


def test_a_process_started_with_it_gets_huge_pages_for_a_large_buffer_and_one_without_does_not():
    # a kernel built without transparent huge pages has no such file: it gives none, as with `never`
    mode = THP.read_text().split("[")[1].split("]")[0] if THP.exists() else "never"
    glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"
    asks = glibc.startswith("glibc ") and tuple(map(int, glibc.split()[1].split(".")[:2])) >= (2, 35)
    plain = {k: v for k, v in os.environ.items() if k != VARIABLE}
    huge = _huge_kib(with_huge_pages(plain))
    if mode == "never" or (mode == "madvise" and not asks):
        assert huge == 0  # the kernel gives none, or an older glibc never asks (it ignores the tunable)
        return
    assert huge >= 32 << 10, f"{huge} KiB of huge pages for a 64 MiB buffer"
    if mode == "madvise":  # only a process that asks gets them: here the tunable is what made the difference
        assert _huge_kib(plain) == 0
    # with `always` every large buffer gets them, asked or not: nothing here tells the tunable's effect apart
