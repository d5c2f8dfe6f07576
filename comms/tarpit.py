"""Tarpit: a caller that keeps failing the credential check waits for its refusals.

A refused call costs a peer little in Python (56 bytes read, one HMAC), but the libp2p daemon below
us accepts the stream, decrypts what the caller pushed of its body and hands it over a fresh
unix-socket connection: a caller that retries as fast as it is refused can take a good share of a
core (docs/BENCHMARKS.md, "Flood of unauthorized callers"). So:

- a caller's *first* refusal, and the first after `memory` seconds of quiet, is answered at once,
  so a misconfigured peer (wrong secret, wrong run) learns why within seconds;
- every further refusal is held for `hold` seconds before it is answered, its stream left unread,
  so a caller that waits for answers makes at most (its calls in flight) / `hold` calls per second;
- holds are bounded (`per_caller` streams per caller, `max_held` in all): past them a refusal is
  answered at once, so a flood cannot pin our file descriptors or memory.

A caller with the credential is never held: the head is checked on every call, so a peer that
fixes its secret gets through on its next call. What this does not stop: a caller that abandons
its calls early and opens new ones, or one that takes a fresh peer id per call (each then costs us
a libp2p handshake instead). Against those, filter at the network (docs/SECURITY.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class TarpitConfig:
    hold: float = 10.0
    """Seconds a repeat refusal waits before it is answered."""
    memory: float = 300.0
    """A caller refused this long ago or earlier counts as new again."""
    per_caller: int = 32
    """Streams of one caller held at once; past this its refusals are answered at once."""
    max_held: int = 256
    """Streams held at once in all."""
    max_callers: int = 4096
    """Callers remembered (oldest forgotten first), so a flood of fresh peer ids cannot grow memory."""


def hold_seconds(cfg: TarpitConfig, last_refused: float | None, now: float, held_by_caller: int,
                 held_total: int) -> float:
    """How long to hold this refusal: 0 for a first (or long-forgotten) offence and when holds are full."""
    if last_refused is None or now - last_refused > cfg.memory:
        return 0.0
    if held_by_caller >= cfg.per_caller or held_total >= cfg.max_held:
        return 0.0
    return cfg.hold


class Tarpit:
    def __init__(self, cfg: TarpitConfig = TarpitConfig(), clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self._clock = cfg, clock
        self._last: OrderedDict[str, float] = OrderedDict()
        self._held: Counter[str] = Counter()
        self.held_total = 0
        """Refusals that were held (for the metrics and the flood benchmark)."""

    @property
    def holding(self) -> int:
        """Streams held right now."""
        return sum(self._held.values())

    def _note(self, caller: str, now: float) -> float | None:
        last = self._last.pop(caller, None)
        self._last[caller] = now
        while len(self._last) > self.cfg.max_callers:
            self._last.popitem(last=False)
        return last

    async def refused(self, caller: str) -> None:
        """Call when `caller` failed the credential check, before answering it: returns at once or after
        the hold. A hold cancelled because the peer shuts down raises `CancelledError` (the transport
        ends that stream quietly: tests/test_tarpit.py)."""
        now = self._clock()
        seconds = hold_seconds(self.cfg, self._note(caller, now), now, self._held[caller], self.holding)
        if seconds <= 0:
            return
        self._held[caller] += 1
        self.held_total += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self._held[caller] -= 1
            if not self._held[caller]:
                del self._held[caller]
