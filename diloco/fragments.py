"""Streaming DiLoCo's fragments and schedule (Douillard et al., arXiv 2501.18512): pure functions.

The model's parameters are cut into P fragments of whole blocks (transformer layers). A *block* is
found from parameter names: the repeated container with the most members (``blocks.3.attn.…`` →
block 3 of ``blocks``). Parameters before the first block (embeddings) join the first block's
unit, those after the last (final norm, head) join the last block's unit; a model without
repeated blocks has one unit per top-level module. Units form fragments in one of two patterns:

- ``strided``: unit i goes to fragment i mod P (the paper's mild preference: better utilization);
- ``sequential``: consecutive units form a fragment.

Schedule: a synchronization slot comes every H/P inner steps and the fragments take the slots in
turn, so each fragment is synchronized once every H steps, fragment p at steps (p+1)·H/P + k·H
(as torchft does), and only 1/P of the model is on the wire at once. With P = 1 this is plain
DiLoCo (a sync every H steps). The global round r belongs to fragment r mod P; a slot whose round
did not commit is retried by the next slot, so every peer agrees on which fragment a round is.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from .compression.errors import ConfigError

PATTERNS = ("strided", "sequential")
OVERLAP_MODES = ("none", "delayed", "eager")
_BLOCK = re.compile(r"^(?:(.*?)\.)?(\d+)(?:\.|$)")  # "blocks.3.attn.w" -> ("blocks", "3"); "0.weight" -> (None, "0")


class FragmentError(ConfigError):
    """The streaming settings do not fit the model or each other; the message says how to fix them."""


@dataclass(frozen=True)
class Fragment:
    index: int
    params: tuple[int, ...]
    """Indices into the model's parameter list, in model order."""
    names: tuple[str, ...]
    numel: int


@dataclass(frozen=True, kw_only=True)
class StreamingConfig:
    fragments: int | None = None
    """P: synchronize the model in this many fragments of blocks, one after another, each every H inner steps
    (Streaming DiLoCo; default 1, or derived from `blocks_per_fragment`)."""
    blocks_per_fragment: int | None = None
    """Alternative to `fragments`: blocks per fragment (the paper uses 3); P = ceil(blocks / this)."""
    pattern: str = "strided"
    """How blocks are assigned to fragments: strided (block i → fragment i mod P) or sequential."""
    overlap: int = 0
    """τ: inner steps a fragment's exchange may run in the background before its result is applied
    (0: apply at once, blocking; the paper's default is 1). Needs τ < H/P."""
    alpha: float = 0.0
    """α: on arrival θ_local ← α·θ_local + (1−α)·θ_global (0: adopt the global value; paper: 0.5)."""
    outer_overlap: str = "none"
    """Overlap a whole outer step (P = 1): 'none', 'eager' (Kale et al., arXiv 2502.12996) or 'delayed'."""

    def __post_init__(self) -> None:
        if self.fragments is not None and self.blocks_per_fragment is not None:
            raise FragmentError("set fragments or blocks_per_fragment, not both")
        if self.fragments is not None and self.fragments < 1:
            raise FragmentError(f"fragments must be >= 1, got {self.fragments}")
        if self.blocks_per_fragment is not None and self.blocks_per_fragment < 1:
            raise FragmentError(f"blocks_per_fragment must be >= 1, got {self.blocks_per_fragment}")
        if self.pattern not in PATTERNS:
            raise FragmentError(f"fragment pattern {self.pattern!r} is not one of {', '.join(PATTERNS)}")
        if self.overlap < 0:
            raise FragmentError(f"overlap (tau) must be >= 0 inner steps, got {self.overlap}")
        if not 0.0 <= self.alpha <= 1.0:
            raise FragmentError(f"alpha must be in [0, 1] (0 adopts the global value, 1 keeps the local one), "
                                f"got {self.alpha}")
        if self.outer_overlap not in OVERLAP_MODES:
            raise FragmentError(f"outer_overlap {self.outer_overlap!r} is not one of {', '.join(OVERLAP_MODES)}")

    @property
    def streaming(self) -> bool:
        return (self.fragments or 1) > 1 or self.blocks_per_fragment is not None or self.overlap > 0 \
            or self.alpha > 0 or self.outer_overlap != "none"


def block_units(names: Sequence[str]) -> list[list[int]]:
    """Parameter indices grouped into blocks, in model order (see the module docstring)."""
    if not names:
        raise FragmentError("the model has no parameters")
    containers = Counter(m.group(1) or "" for n in names if (m := _BLOCK.match(n)))
    best = max(containers, key=lambda c: (containers[c], c), default=None)
    keys: list[str | None] = []
    for n in names:
        m = _BLOCK.match(n)
        keys.append(f"{best}.{m.group(2)}" if best is not None and m and (m.group(1) or "") == best else None)
    if best is None or all(k is None for k in keys):
        keys = [n.split(".", 1)[0] for n in names]  # no repeated blocks: one unit per top-level module
    # Parameters outside the blocks join the nearest block before them (or the first block).
    first = next(k for k in keys if k is not None)
    resolved, current = [], first
    for k in keys:
        current = k if k is not None else current
        resolved.append(current)
    order: dict[str, list[int]] = {}
    for i, k in enumerate(resolved):
        order.setdefault(k, []).append(i)
    return list(order.values())


def partition(names: Sequence[str], numels: Sequence[int], cfg: StreamingConfig) -> list[Fragment]:
    """The model's fragments; every parameter is in exactly one (checked)."""
    units = block_units(names)
    if cfg.blocks_per_fragment is not None:
        count = -(-len(units) // cfg.blocks_per_fragment)
    else:
        count = cfg.fragments or 1
    if count > len(units):
        raise FragmentError(f"{count} fragments but the model has only {len(units)} blocks; "
                            f"use fragments <= {len(units)}")
    groups: list[list[int]] = [[] for _ in range(count)]
    for u, unit in enumerate(units):
        f = u % count if cfg.pattern == "strided" else u * count // len(units)
        groups[f].extend(unit)
    fragments = [Fragment(i, tuple(sorted(g)), tuple(names[j] for j in sorted(g)), sum(numels[j] for j in g))
                 for i, g in enumerate(groups)]
    seen = sorted(j for f in fragments for j in f.params)
    if seen != list(range(len(names))):  # a bug, never a user error: say so loudly
        raise AssertionError("fragments do not cover every parameter exactly once")
    return fragments


def check_schedule(inner_steps: int, fragments: int, cfg: StreamingConfig) -> None:
    """H divisible by P, τ < H/P, and whole-step overlap only with P = 1; raises FragmentError."""
    if inner_steps % fragments:
        raise FragmentError(f"inner_steps H={inner_steps} must be divisible by the number of fragments "
                            f"P={fragments}: choose H a multiple of {fragments} or another P")
    if cfg.outer_overlap != "none":
        if fragments != 1:
            raise FragmentError(f"outer_overlap={cfg.outer_overlap!r} overlaps a whole outer step and needs "
                                f"one fragment (got {fragments}); for fragments use overlap (tau) instead")
        if cfg.overlap:
            raise FragmentError("outer_overlap already overlaps the whole outer step; leave overlap (tau) at 0")
        return
    period = inner_steps // fragments
    if cfg.overlap >= period:
        raise FragmentError(f"overlap tau={cfg.overlap} must be < H/P = {inner_steps}/{fragments} = {period}, "
                            "or the next fragment's exchange would start before this one's result is applied; "
                            "lower tau or use fewer fragments")


HSchedule = tuple[tuple[int, int], ...]
"""An H schedule: (after this many committed rounds, H from then on) pairs, rounds ascending."""


def check_round_seconds(round_seconds: float | None, fragments: int, cfg: StreamingConfig,
                        h_schedule: HSchedule, adaptive: bool = False) -> None:
    """Rounds by time (`DiLoCo(round_seconds=...)`, `--round-seconds`, or `adaptive=True`, `--adaptive`): a positive
    time, or adaptive, not both; streaming fragments and their overlap τ work with it (each fragment syncs every
    `round_seconds`), a whole outer step overlapped and an H schedule do not (both count in inner steps of every
    worker). Raises FragmentError naming the settings in Python and on the command line."""
    if round_seconds is not None and adaptive:
        raise FragmentError("round_seconds (--round-seconds) and adaptive (--adaptive) are two ways to set a round's "
                            "length: give one (adaptive rounds last inner_steps (-H) steps of the fastest worker)")
    if round_seconds is None and not adaptive:
        return
    what = "adaptive (--adaptive)" if adaptive else "round_seconds (--round-seconds)"
    if round_seconds is not None and not 0 < round_seconds < float("inf"):
        raise FragmentError(f"round_seconds (--round-seconds) must be a positive number of seconds, got {round_seconds}")
    if cfg.outer_overlap != "none" or h_schedule:
        raise FragmentError(f"{what} does not work with outer_overlap (--outer-overlap) or an h_schedule "
                            "(--h-schedule), which count in inner steps of every worker: drop them, or use "
                            "inner_steps (-H) alone")


def check_rounds(inner_steps: int, fragments: int, cfg: StreamingConfig, h_schedule: HSchedule,
                 round_seconds: float | None = None, adaptive: bool = False) -> None:
    """A worker's rounds as a whole: by time (`check_round_seconds`), or H fit for the fragments and overlap
    (`check_schedule`; by time the slots do not count inner steps), and the H schedule (`check_h_schedule`).
    Raises FragmentError."""
    check_round_seconds(round_seconds, fragments, cfg, h_schedule, adaptive)
    if round_seconds is None:
        check_schedule(inner_steps, fragments, cfg)
    check_h_schedule(h_schedule, fragments, cfg)


def inner_steps_at(committed: int, inner_steps: int, schedule: HSchedule = ()) -> int:
    """H of the round that follows `committed` committed global rounds: `inner_steps`, or the H of the
    schedule's last change at or before `committed`. A function of the round alone, so every peer (and one
    that downloaded the state) agrees on where the slots fall."""
    h = inner_steps
    for after, value in schedule:
        if committed >= after:
            h = value
    return h


def parse_h_schedule(text: str) -> HSchedule:
    """'80:10' or '80:10,95:5' (or with '+' between the pairs): after 80 committed rounds H is 10, after 95
    it is 5. Raises ValueError saying what is wrong."""
    pairs = []
    for part in filter(None, (p.strip() for p in re.split(r"[,+]", text))):
        after, sep, h = part.partition(":")
        try:
            if not sep:
                raise ValueError
            pairs.append((int(after), int(h)))
        except ValueError:
            raise FragmentError(f"H schedule {text!r}: write ROUNDS:H pairs, e.g. '80:10' (after 80 rounds, H=10) or "
                             f"'80:10,95:5'; {part!r} is not one") from None
    check_h_schedule(tuple(pairs))
    return tuple(pairs)


def format_h_schedule(schedule: HSchedule) -> str:
    """The text `parse_h_schedule` reads back: '80:10,95:5' ('' for none)."""
    return ",".join(f"{after}:{h}" for after, h in schedule)


def check_h_schedule(schedule: HSchedule, fragments: int = 1, cfg: StreamingConfig | None = None) -> None:
    """Rounds > 0 and ascending, every H >= 1 and fit for the fragments and overlap (`check_schedule`);
    raises FragmentError."""
    rounds = [r for r, _ in schedule]
    if any(r < 1 for r in rounds) or rounds != sorted(set(rounds)):
        raise FragmentError(f"H schedule {schedule}: the rounds must be >= 1 and ascending")
    for _, h in schedule:
        if h < 1:
            raise FragmentError(f"H schedule {schedule}: every H must be >= 1, got {h}")
        check_schedule(h, fragments, cfg or StreamingConfig(fragments=fragments))


def fragment_of_round(rnd: int, fragments: int) -> int:
    return rnd % fragments
