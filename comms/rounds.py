"""The data of one round: its configuration, its outcome, and what a peer holds while it runs.

`CollectiveConfig` bounds every wait of the round protocol (`collective.py` and its steps); `RoundOutcome` is what
a round produced for this peer; `RoundState` collects the frames received for one round key (they
may arrive before we are ready ourselves); `Exchange` is our side of a round once its view closed;
`Value` is what an attempt computed (every span's result) and `Accepted` the value a peer accepted
in an attempt, which later attempts of the same round carry instead of computing a new one.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, TypeGuard

import torch

from diloco.compression import PayloadRejected, Reason
from diloco.compression.errors import ConfigError
from diloco.compression.pipeline import Decoded, parse

from .robust import RobustConfig
from .spans import RoundKey
from .transport import PeerId


@dataclass(frozen=True, kw_only=True)
class CollectiveConfig:
    gather_timeout: float = 60.0
    """Seconds a ready peer waits for the other expected peers before closing the round without them."""
    reduce_timeout: float = 20.0
    """Seconds after the gather closes that a span owner waits for contributions."""
    result_timeout: float = 30.0
    """Seconds after the gather closes that a peer waits for every span's result; > reduce_timeout."""
    call_timeout: float = 15.0
    """Seconds one message may take before its peer is treated as unreachable; also the deadline of each
    4 MiB chunk of state a catching-up peer downloads (the whole download has none)."""
    min_peers: int = 1
    """Fewest members (self included) a round needs to commit."""
    compression: str = "fp32"
    """Compression pipeline of pseudo-gradients, e.g. fp16, e3m0, topk:64/4096+s2+ef:0.95 (docs/USAGE.md,
    "Compression"); every peer of a swarm must use the same."""
    max_payload: int = 1 << 30
    """Largest frame body accepted from the network, in bytes."""
    robust: RobustConfig = field(default_factory=RobustConfig)
    """Admission bound, clipping, trimmed mean and bans (`comms.robust`)."""

    @property
    def answer_timeout(self) -> float:
        """Seconds a small control call (a ready, a probe) may go unanswered before its peer counts as silent for
        this attempt: a twentieth of the gather timeout (half the stragglers' grace: 3 s by default, ten round trips
        of a 300 ms link), at least 2 s, at most call_timeout. A live peer too busy to answer that soon is not
        waited for in that attempt; its answer still counts if it comes before the view closes."""
        return min(self.call_timeout, max(2.0, self.gather_timeout / 20))

    def __post_init__(self) -> None:
        spec = parse(self.compression)  # raises SpecError (a ConfigError) naming what is wrong and what is allowed
        if self.robust.trim and spec.sparsifier is not None:
            raise ConfigError(f"trim (trimmed mean) needs a dense compression pipeline, not {self.compression!r}: "
                             "sparse contributions hold different coordinates; use clip instead")
        for name in ("gather_timeout", "reduce_timeout", "result_timeout", "call_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.result_timeout <= self.reduce_timeout:
            raise ConfigError(
                f"result_timeout ({self.result_timeout}) must exceed reduce_timeout ({self.reduce_timeout}) "
                "so that owners' results can arrive after they close their reduce"
            )
        if self.min_peers < 1:
            raise ConfigError(f"min_peers must be >= 1, got {self.min_peers}")


@dataclass
class RoundOutcome:
    """What one round produced for this peer."""

    key: RoundKey
    committed: bool
    reason: str
    view: tuple[PeerId, ...] = ()
    aggregate: torch.Tensor | None = None
    contributors: list[tuple[PeerId, ...]] = field(default_factory=list)
    sent: torch.Tensor | None = None
    """What of our Δ the aggregate includes, as decoded (0 where our span contribution was left out);
    computed only when the pipeline has error feedback (the one user of it)."""
    offenders: tuple[PeerId, ...] = ()
    """Members a majority of the view's span owners marked this round (refused or far-outlying
    contributions): every member of the view computes the same tuple from the same results."""
    payload_bytes: int = 0
    """Encoded size of our whole contribution (all spans): the codec's cost, without framing."""
    value_id: str = ""
    """The committed value's id (the view id of the attempt that computed it)."""
    value: Value | None = None
    """A committed round that kept no decoded values (`Handoff.keeps_aggregate` off): Δ̄ as its result frames,
    read one span at a time with `Collective.value_spans`, in place of `aggregate`."""
    in_doubt: bool = False
    """We accepted a value but could not learn whether a quorum did: not applied; the next attempt of
    this round carries it (`Collective` docstring, "Deciding")."""
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each step this attempt reached, in order (`RoundState.phases`)."""
    gathered_at: float | None = None
    """When (`time.monotonic()`) this attempt's view closed: the moment its members left the gather, about the same
    for all of them (rounds by time start their next span there when the exchange overlapped training)."""


@dataclass(frozen=True)
class Contribution:
    """One member's contribution to a span we own, as the reduce needs it."""

    order: bytes
    """`reduce.order_key` of its encoded bytes (their CRC-32 and length): its place in the summation order."""
    decoded: Decoded
    body: bytes | None
    """The encoded bytes, kept only where the result bundles them (sparse pipelines): a dense one would
    hold the span twice for nothing."""
    weight: int = 1
    """How much it counts in the span's mean: the inner steps its sender's Δ covers (1 when all are equal)."""
    norm: float | None = None
    """Its L2 norm as its admission measured it (`robust.assess`); None: not measured yet."""


@dataclass
class RoundState:
    """Everything received for one round key; created by whichever message arrives first."""

    ready: dict[PeerId, str] = field(default_factory=dict)
    incarnations: dict[PeerId, int] = field(default_factory=dict)
    """The incarnation (`Collective.incarnation`) of each ready peer, ours included, from the message that told us it
    is ready: views name them (`view_id`), so a peer restarted under its id is not the member its earlier process
    was."""
    heard: dict[PeerId, float] = field(default_factory=dict)
    """When each peer's own `ready` last reached us (monotonic): news that it is alive."""
    lists: dict[PeerId, frozenset[PeerId]] = field(default_factory=dict)
    """Whom each ready peer told us it expects in this round."""
    waits: dict[PeerId, frozenset[PeerId]] = field(default_factory=dict)
    """Whom of those it waits for (the rest are its stragglers: asked, given a short grace)."""
    expected: tuple[PeerId, ...] | None = None  # whom we expect (from our records), once we run the round
    wait_for: frozenset[PeerId] | None = None  # whom of those we wait for (None: all)
    view: tuple[PeerId, ...] | None = None  # set when this peer closes its gather
    vid: str = ""  # the view's id, set with `view`
    fragment: int = 0  # model fragment of this round (set when we run it)
    weight: int = 1  # what our contribution counts in the means (set when we run it; `Contribution.weight`)
    contribs: dict[tuple[str, int], dict[PeerId, Contribution]] = field(default_factory=dict)
    results: dict[tuple[str, int], tuple[PeerId, torch.Tensor, tuple[int, ...]]] = field(default_factory=dict)
    marked: dict[tuple[str, int], tuple[int, ...]] = field(default_factory=dict)
    """Per (view, span): the view indices its owner marked (refused or far-outlying contributions)."""
    refused: dict[int, set[PeerId]] = field(default_factory=dict)  # per span: whose contributions we refused
    frames: dict[tuple[str, int], bytes] = field(default_factory=dict)
    """Per (view, span): the result frame as its owner sent it (what we serve if we carry its value)."""
    accepted: dict[PeerId, tuple[int, str]] = field(default_factory=dict)
    """What each ready peer told us it accepted in an earlier attempt of this round: (attempt, value id)."""
    carried: tuple[int, str] | None = None  # the value our view carries (set with `view`), if any
    spans: int = 0  # how many spans this round's Δ is cut into (set when our exchange starts)
    bounds: list[tuple[int, int]] = field(default_factory=list)  # their ranges (set with `spans`)
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds our attempt spent in each step it reached: gather (until the view closed), encode (our Δ),
    exchange (contributions out, results back), or fetch (the value our view carries), and decide (the vote)."""
    gathered_at: float | None = None
    """When (`time.monotonic()`) our attempt's view closed."""
    lean: bool = False
    """Keep no decoded values: each result is decoded to be checked, then only its frame is kept (see
    `Handoff.keeps_aggregate`)."""
    aggregate: torch.Tensor | None = None
    """Where our view's span results are written as they arrive (set when our exchange starts): the round's
    averaged Δ without a second copy of it."""
    votes: dict[str, set[PeerId]] = field(default_factory=dict)
    """Per view id: the members that told us they accepted that view's value."""
    changed: Changes = field(default_factory=lambda: Changes())
    """Set by every handler that moved this state on: wakes each `wait_until` on it."""
    recheck: set[PeerId] = field(default_factory=set)
    """Peers whose records say, since our gather began, that they take no part in rounds (standby, left): asked
    again at once rather than a grace later (`Collective.recheck`)."""
    banned: frozenset[PeerId] = frozenset()  # peers this round leaves out whoever names them
    elsewhere: set[PeerId] = field(default_factory=set)
    """Peers that showed us they closed another view of this round key (they refused a frame of ours as of
    the wrong view, or sent us one of theirs): a member of our view among them never sends a result for
    our view, so our view cannot complete."""
    undeliverable: set[PeerId] = field(default_factory=set)
    """Owners our contribution could not be delivered to (the call failed): a probe from one of them hears it, and
    stops waiting for it."""
    owes_nothing: set[PeerId] = field(default_factory=set)
    """Members whose contribution to our spans will not come (they told a probe they could not deliver it):
    reduced without, as if it were refused."""
    gone: dict[PeerId, str] = field(default_factory=dict)
    """Members of our view that will send nothing more for it, and why: unreachable (killed), silent through a
    probe's answer window (frozen), or no longer running this attempt (restarted, gave it up). Their
    contributions are not waited for; a span one of them owns gets no result, so the attempt is given up at
    once rather than at the result deadline (`diloco.comms.watch`)."""

    def named(self, me: PeerId) -> set[PeerId]:
        """Whom this round may include: the peers we expect and, transitively, the peers that a peer so
        named expects. A peer counts as ready only with its list in hand, so the members of a view have
        learned the same names before they close it: views agree even when their records disagree about
        a peer that just joined, and a peer nobody expects is left out by everyone."""
        out: set[PeerId] = set()
        todo = [p for p in self.expected or () if p != me]
        while todo:
            p = todo.pop()
            if p not in out and p not in self.banned:
                out.add(p)
                todo.extend(q for q in self.lists.get(p, ()) if q != me and q not in out)
        return out

    def waited(self, me: PeerId) -> set[PeerId]:
        """Whom we wait for: the expected peers in `wait_for`, and peers we learned of that a named peer
        waits for (one that every peer naming it treats as a straggler gets only the grace)."""
        named, own = self.named(me), set(self.expected or ())
        out = {p for p in named & own if self.wait_for is None or p in self.wait_for}
        return out | {q for p in named for q in self.waits.get(p, ()) if q in named and q not in own}

    def views_buffered(self) -> set[str]:
        return {v for v, _ in self.contribs} | {v for v, _ in self.results} | set(self.votes)

    def check_buffered(self, vid: str) -> None:
        """Frames of view `vid` may wait here until our view closes, unless `MAX_VIEWS_PER_ROUND` other views' frames
        already do (bounded memory); raises PayloadRejected."""
        if vid not in self.views_buffered() and len(self.views_buffered()) >= MAX_VIEWS_PER_ROUND:
            raise PayloadRejected(Reason.WRONG_VIEW, "too many distinct views buffered for this round")

    def mark_elsewhere(self, peer: PeerId) -> None:
        """`peer` showed us it closed another view of this round key (see `elsewhere`)."""
        if peer not in self.elsewhere:
            self.elsewhere.add(peer)
            self.changed.set()


@dataclass
class Exchange:
    """One round after its view closed: the span partition and our encoded contributions."""

    key: RoundKey
    rs: RoundState
    me: PeerId
    bounds: list[tuple[int, int]]
    closed_at: float
    payloads: list[bytes | memoryview] = field(default_factory=list)
    payload_bytes: int = 0
    """Encoded size of our whole contribution (payloads sent to other owners are dropped once sent)."""
    own: dict[int, Decoded] = field(default_factory=dict)
    """Our own contribution to each span we own, decoded."""
    missed: list[int] = field(default_factory=list)
    """The spans whose results had not come when the round's deadline passed."""
    owed: Counter[PeerId] = field(default_factory=Counter)
    """Frames we still owe each member (contributions to its spans, our spans' results): counted when they are
    due, until their call returns (delivered, refused or failed)."""

    @property
    def view(self) -> tuple[PeerId, ...]:
        assert self.rs.view is not None
        return self.rs.view

    @property
    def mine(self) -> int:
        """Our index in the view (we own the spans s with s mod N = mine)."""
        return self.view.index(self.me)

    @property
    def owned(self) -> list[int]:
        return list(range(self.mine, len(self.bounds), len(self.view)))

    def owner(self, span: int) -> PeerId:
        return self.view[span % len(self.view)]

    def numel(self, span: int) -> int:
        lo, hi = self.bounds[span]
        return hi - lo

    def missing(self) -> list[PeerId]:
        """Owners of the spans that have no result yet (each named once)."""
        spans = [s for s in range(len(self.bounds)) if (self.rs.vid, s) not in self.rs.results]
        return list(dict.fromkeys(self.owner(s) for s in spans))

    def complete(self) -> bool:
        return not self.missing()

    def lost(self) -> list[PeerId]:
        """Owners of spans without a result that will never send it (`RoundState.gone`)."""
        return [p for p in self.missing() if p in self.rs.gone]

    def awaited(self) -> set[PeerId]:
        """Members we still wait on: owners of the spans without a result, and contributors to the spans we own
        that we have not reduced yet; once we hold every result, those we still owe a frame."""
        rs = self.rs
        if self.complete():
            return {p for p, n in self.owed.items() if n} - {self.me}
        out = set(self.missing())
        for span in self.owned:
            if (rs.vid, span) not in rs.results:
                got = rs.contribs.get((rs.vid, span), {})
                out |= {p for p in self.view if p not in got and p not in rs.refused.get(span, ())
                        and p not in rs.owes_nothing}
        return out - {self.me}

    def delivered(self) -> bool:
        """Every frame we owe a member that is not gone has been delivered (or failed)."""
        return not any(n and p not in self.rs.gone for p, n in self.owed.items())

    def closed_elsewhere(self) -> list[PeerId]:
        """Members of our view that closed another view of this round (see `RoundState.elsewhere`)."""
        return sorted(self.rs.elsewhere & set(self.view))


class Handoff:
    """A pseudo-gradient handed from the training loop to a round, which lets go of it once it is encoded:
    Δ is the size of the model, and nothing needs it while the round waits on the network (the caller
    keeps its own reference only when it needs Δ later, e.g. for error feedback)."""

    keeps_aggregate = True
    """Whether the round assembles Δ̄ as one decoded tensor (`RoundOutcome.aggregate`). Off, it keeps only the
    result frames (`RoundOutcome.value`), so that the frames and a decoded copy of them never coexist: an
    FSDP2 site's leader hands Δ̄ out span by span (`diloco.shards`), a lone peer decodes it span by span into
    its outer step's gradient while it lets go of the frames (`PiecewiseHandoff`, `diloco.wrapper`)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor: torch.Tensor | None = tensor
        self.numel = tensor.numel()

    def take(self) -> torch.Tensor:
        """The tensor (once: the handoff no longer holds it after this)."""
        if self._tensor is None:
            raise RuntimeError("this pseudo-gradient was already taken by its round")
        tensor, self._tensor = self._tensor, None
        return tensor

    def spans(self, bounds: Sequence[tuple[int, int]]) -> Iterator[torch.Tensor]:
        """Δ[lo:hi] for each of `bounds`, in order (the round encodes each as it comes). A subclass may
        produce them one at a time without ever holding the whole Δ (an FSDP2 site's, `diloco.shards`)."""
        delta = self.take()
        for lo, hi in bounds:
            yield delta[lo:hi]

    def span_parts(self, bounds: Sequence[tuple[int, int]]) -> Iterator[list[torch.Tensor]]:
        """`spans`, each as consecutive parts that together are the span (one part here): an encoder may read them
        without their concatenation (`Pipeline.encode_parts`)."""
        for span in self.spans(bounds):
            yield [span]


class PiecewiseHandoff(Handoff):
    """A lone peer's Δ, held as consecutive pieces, each its own allocation (`diloco.outer.pseudo_gradient_pieces`):
    the round reads its spans in order and each piece is freed once every span that covers it has been read,
    so Δ shrinks while its encoding grows (a span that crosses pieces is copied, one span at a time). The
    round keeps Δ̄ as its result frames, which the peer decodes span by span at its outer step."""

    keeps_aggregate = False

    def __init__(self, pieces: list[torch.Tensor]) -> None:
        self._pieces: deque[torch.Tensor] | None = deque(pieces)
        self._tensor = None
        self.numel = sum(p.numel() for p in pieces)

    def take(self) -> torch.Tensor:
        raise RuntimeError("a pseudo-gradient in pieces is read one span at a time (spans), never whole")

    def spans(self, bounds: Sequence[tuple[int, int]]) -> Iterator[torch.Tensor]:
        for parts in self.span_parts(bounds):
            yield parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.empty(0)

    def span_parts(self, bounds: Sequence[tuple[int, int]]) -> Iterator[list[torch.Tensor]]:
        """Each span as the views of the pieces it covers: a span that crosses pieces is not copied here."""
        if self._pieces is None:
            raise RuntimeError("this pseudo-gradient was already taken by its round")
        pieces, self._pieces = self._pieces, None
        base = 0  # where pieces[0] starts in Δ
        for lo, hi in bounds:
            while pieces and base + pieces[0].numel() <= lo:
                base += pieces.popleft().numel()  # every span that covers it was read
            parts, at = [], base
            for piece in pieces:
                if at >= hi:
                    break
                parts.append(piece[max(lo - at, 0):min(hi - at, piece.numel())])
                at += piece.numel()
            yield parts
            del parts  # the pieces a span read are freed as soon as no later span covers them
        pieces.clear()


@dataclass
class Value:
    """What one attempt of a round computed: every span's result, in span order. Members that accept it
    apply exactly these results, whichever attempt they commit it in."""

    key: RoundKey
    """The attempt whose members contributed to it."""
    vid: str
    """That attempt's view id: names the value."""
    view: tuple[PeerId, ...]
    """That attempt's members: the result indices refer to them, and they are the next round's
    quorum base (the same for every peer that commits the value)."""
    frames: list[bytes]
    """Each span's result frame as its owner sent it, so a peer that missed some can be given them."""
    results: list[tuple[PeerId, torch.Tensor, tuple[int, ...]]]
    marked: list[tuple[int, ...]]
    incarnations: dict[PeerId, int] = field(default_factory=dict)
    """The members' incarnations, as that attempt's view id names them."""

    @property
    def numel(self) -> int:
        return sum(t.numel() for _, t, _ in self.results)


@dataclass
class Accepted:
    """A value this peer accepted in attempt `ballot` of a round: it may have been decided (a quorum
    accepted it), so every later attempt this peer joins reports it, and the highest one reported in a
    view is carried instead of a new exchange."""

    ballot: RoundKey
    vid: str
    """The view id of attempt `ballot` (votes name it)."""
    value: Value


MAX_VIEWS_PER_ROUND = 8
"""Distinct views of one round key whose frames a peer buffers before its own view closes (bounded memory)."""


class Changes:
    """A round state's "something changed", for any number of waiters at once: `set()` wakes every one waiting,
    and each waits on the change that was current when it last checked (`current()`), which nobody clears. One
    shared `asyncio.Event` that each waiter cleared before waiting lost changes: a waiter whose wait had not begun
    when a handler set it, behind another waiter that cleared it first, slept through it (a member that had seen
    another view waited out the 20 s reduce deadline; tests/test_collective.py, 1 run in ~300 on a busy machine)."""

    def __init__(self) -> None:
        self._current = asyncio.Event()

    def set(self) -> None:
        self._current.set()
        self._current = asyncio.Event()

    def current(self) -> asyncio.Event:
        """The change to wait for: set by the next `set()`, and never cleared."""
        return self._current


async def wait_until(rs: RoundState, done: Callable[[], bool], deadline: float) -> bool:
    """Wait until `done()` or the deadline; True if done. Handlers wake us through `rs.changed`."""
    while not done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        change = rs.changed.current()  # taken with no await since `done()`: a change after that check wakes us
        try:
            await asyncio.wait_for(change.wait(), remaining)
        except asyncio.TimeoutError:
            pass
    return True


def lap(rs: RoundState, phase: str, since: float) -> float:
    """Record the seconds since `since` as `phase` of the attempt; returns now."""
    now = time.monotonic()
    rs.phases[phase] = now - since
    return now


def placeholder(numel: int) -> torch.Tensor:
    """A result's stand-in in a lean round: its size, no storage (the frame holds the values)."""
    return torch.zeros(1).expand(numel)


def weight_ok(w: object) -> TypeGuard[int]:
    """A contribution's weight off the wire: a whole number of inner steps in [1, 10¹²]."""
    return type(w) is int and 1 <= w <= 10**12


def short(peers: list[PeerId]) -> str:
    """Peer ids for a message: their last six characters."""
    return ", ".join(p[-6:] for p in peers)
