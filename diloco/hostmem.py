"""Host memory for a round's large buffers: glibc's malloc asked for transparent huge pages.

A round allocates host buffers of tens to hundreds of MB (Δ's pieces, encoded spans, frames, decoded results).
glibc serves every allocation above its mmap threshold (at most 32 MiB) from fresh pages and gives them back
when it is freed, so every round the kernel faults in and zeroes each 4 KiB page of them again. On the 2-core
machine of docs/BENCHMARKS.md a fresh 100 MB copy took 39 ms against 5 ms into memory already mapped, and the
kernel's share was half of a peer's CPU in a 2-peer round of a 100 MB model ("Host memory" there).

With the tunable `glibc.malloc.hugetlb=1` (glibc 2.35 and later; older ones ignore it) malloc asks the kernel for
transparent huge pages (`madvise`) for such buffers: one fault per 2 MiB instead of 512. It changes no reuse
policy, so peak memory stays where it was (measured at 300M parameters). glibc reads it when a process starts,
so the launcher puts it in the environment of what it starts (`diloco start/join -- CMD`, the demo's peers, and
through them torchrun's ranks). A script started by hand gets it the same way:

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python train.py

It has an effect where the kernel's transparent huge pages are `madvise` or `always`
(/sys/kernel/mm/transparent_hugepage/enabled), none with `never`. A GLIBC_TUNABLES that names the tunable
already (`glibc.malloc.hugetlb=0` to turn it off) is left as it is.
"""

from __future__ import annotations

from typing import Mapping

TUNABLE = "glibc.malloc.hugetlb"
VARIABLE = "GLIBC_TUNABLES"


def with_huge_pages(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with glibc's malloc asking for transparent huge pages (`TUNABLE=1` added to `GLIBC_TUNABLES`),
    unless its `GLIBC_TUNABLES` sets that tunable already."""
    out = dict(env)
    tunables = [t for t in out.get(VARIABLE, "").split(":") if t]
    if not any(t.split("=", 1)[0] == TUNABLE for t in tunables):
        out[VARIABLE] = ":".join([*tunables, f"{TUNABLE}=1"])
    return out
