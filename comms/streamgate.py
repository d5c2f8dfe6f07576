"""Stream gate: how many streams may wait for their first bytes, and for how long.

Every stream a peer serves costs a file descriptor in the peer and one in its libp2p daemon until it
is closed. Before a stream's first bytes arrive (the 8-byte length prefix and the 56-byte envelope
head, `auth.py`) nothing is known about the caller but its peer id, which libp2p authenticated and
which costs a stranger nothing to make. A stranger that opened 2,000 streams and sent nothing held
2,000 descriptors in a peer and in its daemon, and under a soft limit of 1,024 open files the peer
died. So, until a stream's head has been read:

- its caller has `head_timeout` seconds to send it; past that the stream is closed (`slow_head`);
- one caller may have at most `per_caller` such streams, and callers that never passed the
  credential check `max_strangers` in all; a stream past either cap is closed at once
  (`too_many_streams`).

A caller whose head passed the credential check once (a member: it holds the swarm key) is
*known*: its streams wait for their heads without a deadline (its own calls time out and close
them) and do not count against `max_strangers`, so strangers cannot crowd members out; the
per-caller cap still applies. Cuts are counted by reason (`refused`, with the credential check's
refusals when a `Guard` owns the gate) and logged once per caller and reason.

What this does not stop: strangers with many peer ids that keep `max_strangers` streams stalled
keep out the first calls of peers that were never known (a newcomer's join), for as long as they
keep it up; members that were known are not affected.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from diloco.compression.errors import DiLoCoError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateConfig:
    head_timeout: float = 5.0
    """Seconds a caller that was never known has to send a stream's length prefix and head."""
    per_caller: int = 32
    """Streams of one caller waiting for their heads at once."""
    max_strangers: int = 128
    """Streams of callers that were never known waiting for their heads at once, in all."""
    max_known: int = 4096
    """Known callers remembered (oldest forgotten first)."""


CUTS = ("slow_head", "too_many_streams")
"""Why the gate closes a stream (counted with the credential check's refusals)."""


class Cut(DiLoCoError):
    """A stream the gate closes: `reason` is `too_many_streams` or `slow_head`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def admission(cfg: GateConfig, by_caller: int, strangers: int, known: bool) -> str | None:
    """None when a new stream may wait for its head, else why it is cut: its caller has `by_caller`
    streams waiting already, and callers never known have `strangers` in all."""
    if by_caller >= cfg.per_caller:
        return "too_many_streams"
    if not known and strangers >= cfg.max_strangers:
        return "too_many_streams"
    return None


def head_deadline(cfg: GateConfig, known: bool) -> float | None:
    """Seconds a stream may wait for its head: None (no deadline of ours) for a known caller."""
    return None if known else cfg.head_timeout


class StreamGate:
    def __init__(self, cfg: GateConfig = GateConfig(), refused: Counter[str] | None = None) -> None:
        self.cfg = cfg
        self.refused: Counter[str] = refused if refused is not None else Counter()
        """Streams cut, by reason (a `Guard` passes its own refusal counter)."""
        self._waiting: Counter[str] = Counter()
        self.strangers = 0
        """Streams of callers never known waiting for their heads now."""
        self.peak = 0
        """The most streams that waited for their heads at once."""
        self._known: OrderedDict[str, None] = OrderedDict()
        self._logged: set[tuple[str, str]] = set()

    @property
    def waiting(self) -> int:
        """Streams waiting for their heads now."""
        return sum(self._waiting.values())

    def known(self, caller: str) -> bool:
        return caller in self._known

    def passed(self, caller: str) -> None:
        """`caller`'s head passed the credential check: it is known from now on."""
        self._known.pop(caller, None)
        self._known[caller] = None
        while len(self._known) > self.cfg.max_known:
            self._known.popitem(last=False)

    @contextmanager
    def opening(self, caller: str) -> Iterator[float | None]:
        """Hold a place for a stream of `caller` while its head is read; yields the seconds it may take
        (None: no deadline). Raises `Cut` (counted, logged) when the stream must be closed at once."""
        known = self.known(caller)
        why = admission(self.cfg, self._waiting[caller], self.strangers, known)
        if why is not None:
            raise self.cut(why, caller, f"{self._waiting[caller]} streams of this caller, {self.strangers} of "
                                        "callers never known, wait for their heads")
        self._waiting[caller] += 1
        self.strangers += not known
        self.peak = max(self.peak, self.waiting)
        try:
            yield head_deadline(self.cfg, known)
        finally:
            self._waiting[caller] -= 1
            if not self._waiting[caller]:
                del self._waiting[caller]
            self.strangers -= not known

    def cut(self, reason: str, caller: str, detail: str) -> Cut:
        """Count (and log once per caller and reason) a stream closed for `reason`; returns the `Cut`."""
        self.refused[reason] += 1
        if (caller, reason) not in self._logged and len(self._logged) < 10_000:
            self._logged.add((caller, reason))
            log.warning("event=call_refused reason=%s peer=%s detail=%s", reason, caller, detail)
        return Cut(reason, detail)
