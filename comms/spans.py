"""Pure helpers of the round protocol: span partition, view identity, round keys.

The flat pseudo-gradient is cut into spans, and every member of a round's view owns some: span s
belongs to member s mod N of the sorted view. There is one span per member unless a member's share
would exceed `SPAN_VALUES`; then each member owns k spans (`spans_for`), so that no frame grows with
the model (`max_payload` stays a bound against hostile input, not a model-size cap) and a round is a
pipeline: an owner returns a span's result while the next span's contributions arrive. All peers that
hold the same view compute the same partition, and the view id (a hash of round key and members)
travels in every frame so that a peer with a different view can never mix its data into ours.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Sequence

from .transport import PeerId


@dataclass(frozen=True, order=True)
class RoundKey:
    """Which exchange this is: `round` is the global state's version (committed rounds so far),
    `attempt` counts exchanges that failed for everyone at that version (e.g. a span owner died)."""

    round: int
    attempt: int = 0

    def __str__(self) -> str:
        return f"{self.round}" if self.attempt == 0 else f"{self.round}.{self.attempt}"


def span_bounds(numel: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Split [0, numel) into `parts` contiguous spans as equal as possible, every boundary a
    multiple of `align` (so a sparsifier's chunks never straddle two spans); sizes differ by at
    most `align`, and a span may be empty when there are more parts than aligned blocks."""
    if parts < 1 or align < 1:
        raise ValueError(f"parts and align must be >= 1, got {parts} and {align}")
    blocks = -(-numel // align)
    base, extra = divmod(blocks, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = min(numel, start + (base + (1 if i < extra else 0)) * align)
        bounds.append((start, end))
        start = end
    return bounds


SPAN_VALUES = 16 << 20
"""Values in a span at most (64 MiB of fp32): a larger share is cut into more spans per member, and an owner
reduces and returns one span while the next one's contributions are still on their way. Spans of 1M values
made 2-peer rounds of a 100 MB model 1.5× faster but raised a 300M-parameter peer's peak memory by half
(docs/BENCHMARKS.md, B3), so spans stay large."""
MAX_SPANS = 1 << 16
"""Spans a round may have at all (frames naming a higher span are refused)."""


def spans_for(numel: int, members: int) -> int:
    """How many spans a round of `members` cuts a Δ of `numel` values into: a multiple of `members`, one
    each unless a member's share exceeds `SPAN_VALUES`. Every member computes the same number."""
    if members < 1:
        raise ValueError(f"a round needs at least one member, got {members}")
    share = -(-numel // members)
    return members * max(1, -(-share // SPAN_VALUES))


def make_view(members: Sequence[PeerId]) -> tuple[PeerId, ...]:
    """The canonical (sorted, de-duplicated) form of a round's membership."""
    return tuple(sorted(set(members)))


def member_token(peer: PeerId, incarnation: int = 0) -> str:
    """A view's member as its view id names it: the peer id and the incarnation that was ready (the number the
    member's process drew at start, `Collective.incarnation`; 0 where unknown). A peer restarted under the same id
    is another member: it holds nothing the one before it received."""
    return peer if not incarnation else f"{peer}#{incarnation:x}"


def parse_member(token: str) -> tuple[PeerId, int]:
    """`member_token` reversed; ValueError when `token` is not one."""
    peer, sep, inc = token.partition("#")
    if not peer or (sep and not (inc and len(inc) <= 16 and all(c in "0123456789abcdef" for c in inc))):
        raise ValueError(f"not a view member: {token[:80]!r}")
    return PeerId(peer), int(inc, 16) if sep else 0


def view_id(key: RoundKey, view: Sequence[PeerId], fragment: int = 0, carried: str = "",
            incarnations: Mapping[PeerId, int] | None = None) -> str:
    """A short SHA-256 digest naming (round key, model fragment, members with their incarnations, and the value an
    earlier attempt accepted that this one carries, if any); equal only for identical views that agree on what
    they carry."""
    incs = incarnations or {}
    members = ",".join(member_token(p, incs.get(p, 0)) for p in view)
    text = f"{key.round}.{key.attempt}|" + ("" if fragment == 0 else f"f{fragment}|") + members
    if carried:
        text += f"|carry:{carried}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
