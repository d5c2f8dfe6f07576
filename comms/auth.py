"""Swarm credentials: every call between peers is authenticated, bound to both peer ids, and fresh.

Peers of a swarm share a secret (`diloco start` creates it; docs/SECURITY.md). Keys are derived
from it, never the secret itself: one per run for the round protocol and the state download, one
for the join handshake (so a peer with the right secret but another run id can be told which
field differs), one per run for the DHT (`HmacAuthorizer`).

Every request and every reply travels in an envelope around the frame:

    head  = "DLA1" | kind u8 | reason u8 | 2 zero bytes | sender session u64 | receiver session u64
            | counter u64 | body length u64                                              (40 bytes)
    tag   = HMAC-SHA256(key, context | head)[:16]      context = direction, handler name, both peer ids
    body  = the frame (any bytes)
    mac   = HMAC-SHA256(key, tag | body)                                                 (32 bytes)

A receiver reads the 56 bytes of head and tag first and checks the tag before it reads or decodes
anything else, so a caller without the key (no key, wrong key, wrong run, a forged sender id: libp2p
authenticates the caller's peer id and the tag binds it) is refused after 56 bytes. Then the body is
read and its mac checked, then freshness:

- *Sessions* (against replays across a receiver restart): each peer picks a random session id at
  start. A request names the receiver's session; a request for another session (sent before the
  receiver restarted, or a first contact) gets a signed reply with the current one, and the caller
  retries once. Frames recorded before a restart can never be replayed after it.
- *Counters* (against replays and duplicates within a session): each request carries a counter
  that grows per sender session; the receiver keeps a window of the last `WINDOW` counters seen per
  sender session and refuses any counter seen before or older than the window.

A reply's tag binds the request's tag, so a reply answers exactly one request. Refusals are counted
per reason (`Guard.refused`) and logged once per caller and reason; the secret and the keys are never
logged. Above this layer the frame's own checks (run id, round, attempt, view, fragment, sizes) still
apply: a well-authenticated frame of a past or far-future round is still refused (`wrong_round`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from diloco.compression.errors import ConfigError, DiLoCoError

from .streamgate import StreamGate
from .tarpit import Tarpit
from .transport import PeerId, TransportError

log = logging.getLogger(__name__)

MAGIC = b"DLA1"
_HEAD = struct.Struct("<4sBB2xQQQQ")
TAG_SIZE, MAC_SIZE = 16, 32
HEAD_SIZE = _HEAD.size + TAG_SIZE  # what a receiver reads before deciding anything
OVERHEAD = HEAD_SIZE + MAC_SIZE
WINDOW = 4096  # counters per sender session a receiver remembers
SESSIONS_PER_CALLER = 4  # sender sessions (restarts) per caller a receiver keeps windows for
MIN_SECRET_BYTES = 16
HELLO = "diloco.hello"  # the one handler keyed by the swarm (not the run): the handshake names a wrong run id

REQUEST, REPLY, SESSION, REFUSED = 1, 2, 3, 4
"""Envelope kinds: a call, its answer, "use this session" (signed), and a refusal (unsigned)."""
REASONS = {1: "unauthorized", 2: "not_allowed", 3: "replay", 4: "malformed"}
"""Why a request was refused; `Guard.refused` counts these, `stale_session`, and the streams its gate
cut before their head arrived (`slow_head`, `too_many_streams`: `streamgate.py`)."""


class AuthRefused(TransportError):
    """The peer refused our call: we lack its swarm's credential (or are not on its allowlist)."""

    def __init__(self, reason: str, peer: PeerId) -> None:
        self.reason = reason
        super().__init__(f"peer {peer} refused the call: {reason}" + (
            " (the swarm secret or run id differs: use the secret `diloco start` wrote for this swarm)"
            if reason == "unauthorized" else ""))


class Refusal(DiLoCoError):
    """A request that must not reach its handler; `reply` is what to send back."""

    def __init__(self, reason: str, reply: bytes, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.reply, self.detail = reason, reply, detail


def derive(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for one purpose ("run/<id>", "swarm", "dht/<id>"), so no two uses share a key."""
    return hmac.new(secret, b"diloco/" + purpose.encode(), hashlib.sha256).digest()


def new_secret() -> str:
    """A fresh swarm secret: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def check_secret(secret: str) -> bytes:
    """The secret's bytes; raises ValueError naming the fix when it is too short to be a key."""
    raw = secret.strip().encode()
    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(f"the swarm secret has {len(raw)} characters, at least {MIN_SECRET_BYTES} are needed; "
                         "let `diloco start` create one (it writes it to a file) or use a long random string")
    return raw


def _context(direction: bytes, name: str, sender: str, receiver: str, bound: bytes = b"") -> bytes:
    parts = [direction, name.encode(), sender.encode(), receiver.encode(), bound]
    return b"".join(struct.pack("<H", len(p)) + p for p in parts)


@dataclass
class _Window:
    """Counters seen from one sender session: the highest, and which of the last WINDOW below it."""

    highest: int = -1
    seen: set[int] = field(default_factory=set)

    def fresh(self, counter: int) -> bool:
        """True (and remember it) when `counter` was not seen and is not older than the window."""
        if counter <= self.highest - WINDOW or counter in self.seen:
            return False
        self.seen.add(counter)
        if counter > self.highest:
            self.highest = counter
            if len(self.seen) > 2 * WINDOW:
                self.seen = {c for c in self.seen if c > self.highest - WINDOW}
        return True


@dataclass(frozen=True)
class Sealed:
    """A request as sent: its bytes, and what its reply must be bound to."""

    data: bytes
    tag: bytes
    name: str
    peer: PeerId


class Guard:
    """One peer's credentials: seals its requests and replies, and opens (or refuses) everyone else's.

    `allow`: if given, only these peer ids may call us (and we call nobody else)."""

    def __init__(self, secret: str, run_id: str, me: PeerId, allow: frozenset[str] | None = None) -> None:
        raw = check_secret(secret)
        self._run_key, self._swarm_key = derive(raw, f"run/{run_id}"), derive(raw, "swarm")
        self.data_key = derive(raw, f"data/{run_id}")
        """The run's key for data connections (`dataplane.py`): it salts their key derivation, never travels."""
        self.me = me
        self.allow = allow
        self.session = secrets.randbits(63) | 1
        self._counter = 0
        self._peer_sessions: dict[PeerId, int] = {}  # the receiver session each peer told us
        self._windows: dict[PeerId, OrderedDict[int, _Window]] = {}
        self.refused: Counter[str] = Counter()
        """Requests refused before their handler ran, by reason."""
        self._logged: set[tuple[str, str]] = set()
        self.tarpit = Tarpit()
        """Holds the refusals of callers that keep failing `check_head` (a transport that streams applies it)."""
        self.gate = StreamGate(refused=self.refused)
        """Bounds the streams waiting for their heads, and for how long (a transport that streams applies
        it); what it cuts is counted in `refused` too (`slow_head`, `too_many_streams`)."""

    def __repr__(self) -> str:  # never show keys
        return f"Guard(me={self.me!r}, session={self.session:x}, allow={len(self.allow) if self.allow else None})"

    def _key(self, name: str) -> bytes:
        return self._swarm_key if name == HELLO else self._run_key

    @staticmethod
    def _tag(key: bytes, context: bytes, head: bytes) -> bytes:
        return hmac.new(key, context + head, hashlib.sha256).digest()[:TAG_SIZE]

    @staticmethod
    def _mac(key: bytes, tag: bytes, body: bytes | memoryview) -> bytes:
        m = hmac.new(key, tag, hashlib.sha256)
        m.update(body)
        return m.digest()

    def _seal(self, kind: int, key: bytes, context: bytes, body: bytes, *, sender_session: int,
              receiver_session: int, counter: int) -> tuple[bytes, bytes]:
        head = _HEAD.pack(MAGIC, kind, 0, sender_session, receiver_session, counter, len(body))
        tag = self._tag(key, context, head)
        return b"".join((head, tag, body, self._mac(key, tag, body))), tag

    # ------------------------------------------------------------------ calling

    def seal_request(self, name: str, peer: PeerId, body: bytes) -> Sealed:
        if self.allow is not None and peer not in self.allow:
            raise TransportError(f"peer {peer} is not on this peer's allowlist; not calling it")
        self._counter += 1
        data, tag = self._seal(REQUEST, self._key(name), _context(b"req", name, self.me, peer), body,
                               sender_session=self.session, receiver_session=self._peer_sessions.get(peer, 0),
                               counter=self._counter)
        return Sealed(data, tag, name, peer)

    def open_reply(self, sent: Sealed, data: bytes) -> bytes | None:
        """The reply's body; None when the peer told us its current session (seal again and retry once).
        Raises AuthRefused when it refused us, TransportError when the reply is not authentic."""
        if len(data) < HEAD_SIZE:
            raise TransportError(f"reply from {sent.peer} is too short to be authentic ({len(data)} bytes)")
        magic, kind, reason, their_session, _, _, length = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise TransportError(f"reply from {sent.peer} is not a diloco envelope")
        if kind == REFUSED:
            raise AuthRefused(REASONS.get(reason, f"reason {reason}"), sent.peer)
        key = self._key(sent.name)
        head, tag = data[:_HEAD.size], data[_HEAD.size:HEAD_SIZE]
        context = _context(b"rep", sent.name, sent.peer, self.me, sent.tag)
        if kind not in (REPLY, SESSION) or len(data) != OVERHEAD + length \
                or not hmac.compare_digest(tag, self._tag(key, context, head)) \
                or not hmac.compare_digest(data[-MAC_SIZE:], self._mac(key, tag, memoryview(data)[HEAD_SIZE:-MAC_SIZE])):
            raise TransportError(f"reply from {sent.peer} failed authentication")
        if kind == SESSION:
            self._peer_sessions[sent.peer] = their_session
            return None
        return data[HEAD_SIZE:-MAC_SIZE]

    # ------------------------------------------------------------------ serving

    def check_head(self, name: str, caller: PeerId, head: bytes) -> int:
        """The body length a request declares, once its head and tag are authentic (56 bytes read);
        raises `Refusal` otherwise. Nothing else about the request is read before this passes."""
        if self.allow is not None and caller not in self.allow:
            raise self.refuse("not_allowed", caller, f"{caller} is not on the allowlist")
        if len(head) < HEAD_SIZE:
            raise self.refuse("malformed", caller, f"request of {len(head)} bytes, shorter than a head")
        magic, kind, _, _, _, _, length = _HEAD.unpack_from(head)
        context = _context(b"req", name, caller, self.me)
        if magic != MAGIC or kind != REQUEST or not hmac.compare_digest(
                head[_HEAD.size:HEAD_SIZE], self._tag(self._key(name), context, head[:_HEAD.size])):
            raise self.refuse("unauthorized", caller, "head tag does not verify (no key, wrong key, wrong run "
                                                       "or forged sender)")
        return int(length)

    def open_request(self, name: str, caller: PeerId, head: bytes,
                     rest: bytes | memoryview) -> tuple[memoryview, Callable[[bytes], bytes]]:
        """The body of a request (`head`: its first HEAD_SIZE bytes, `rest`: body and mac) and a function
        that seals the reply to it; raises `Refusal` (reply included) when it is not authentic, not
        fresh, or addressed to an earlier session of ours."""
        return self.open_body(name, caller, head, rest, self.check_head(name, caller, head))

    def open_body(self, name: str, caller: PeerId, head: bytes, rest: bytes | memoryview,
                  length: int) -> tuple[memoryview, Callable[[bytes], bytes]]:
        """`open_request` for a head that `check_head` passed already (it returned `length`)."""
        key = self._key(name)
        tag = head[_HEAD.size:HEAD_SIZE]
        rest = memoryview(rest)
        body = rest[:-MAC_SIZE] if rest.nbytes >= MAC_SIZE else memoryview(b"")
        if rest.nbytes != length + MAC_SIZE or not hmac.compare_digest(bytes(rest[-MAC_SIZE:]), self._mac(key, tag, body)):
            raise self.refuse("unauthorized", caller, "body mac does not verify")
        _, _, _, their_session, my_session, counter, _ = _HEAD.unpack_from(head)
        context = _context(b"rep", name, self.me, caller, bytes(tag))

        def reply(kind: int, payload: bytes = b"") -> bytes:
            return self._seal(kind, key, context, payload, sender_session=self.session,
                              receiver_session=their_session, counter=counter)[0]

        if my_session != self.session:
            self.refused["stale_session"] += 1  # a first contact or a restart of ours: tell it our session
            raise Refusal("stale_session", reply(SESSION), f"request for session {my_session:x}, ours is {self.session:x}")
        windows = self._windows.setdefault(caller, OrderedDict())
        if their_session not in windows:
            windows[their_session] = _Window()
            while len(windows) > SESSIONS_PER_CALLER:
                windows.popitem(last=False)
        if not windows[their_session].fresh(counter):
            raise self.refuse("replay", caller, f"counter {counter} of session {their_session:x} seen before or too old")
        return body, lambda payload: reply(REPLY, payload)

    def refuse(self, reason: str, caller: PeerId, detail: str) -> Refusal:
        self.refused[reason] += 1
        code = next(c for c, r in REASONS.items() if r == reason)
        if (caller, reason) not in self._logged and len(self._logged) < 10_000:
            self._logged.add((caller, reason))  # a flood logs one line per caller, not one per attempt
            log.warning("event=call_refused reason=%s peer=%s detail=%s", reason, caller, detail)
        return Refusal(reason, _HEAD.pack(MAGIC, REFUSED, code, 0, 0, 0, 0) + bytes(TAG_SIZE), detail)

    # ------------------------------------------------------------------ whole messages (in-process transport)

    async def call(self, name: str, peer: PeerId, body: bytes,
                   send: Callable[[bytes], Awaitable[bytes]]) -> bytes:
        """Seal, send, open the reply; on a session reply seal again and retry once."""
        for _ in range(2):
            sent = self.seal_request(name, peer, body)
            got = self.open_reply(sent, await send(sent.data))
            if got is not None:
                return got
        raise TransportError(f"peer {peer} keeps changing its session (restarting?)")

    async def serve(self, name: str, caller: PeerId, data: bytes,
                    handler: Callable[[PeerId, bytes], Awaitable[bytes]]) -> bytes:
        try:
            body, seal = self.open_request(name, caller, data[:HEAD_SIZE], memoryview(data)[HEAD_SIZE:])
        except Refusal as r:
            return r.reply
        return seal(await handler(caller, bytes(body)))


class HmacAuthorizer:
    """hivemind DHT requests and responses signed with a run's DHT key (an `AuthorizerBase`): a DHT node
    without the swarm secret gets no answers, and its requests are ignored. Requests carry a time and a
    random nonce; a request older than `max_age` seconds or seen before is refused."""

    def __init__(self, secret: str, run_id: str, max_age: float = 300.0) -> None:
        from hivemind.utils.timed_storage import TimedStorage

        self._key = derive(check_secret(secret), f"dht/{run_id}")
        self.max_age = max_age
        self._nonces: Any = TimedStorage()
        self.refused: Counter[str] = Counter()

    def __repr__(self) -> str:
        return "HmacAuthorizer()"

    def _sign(self, message: Any) -> bytes:
        return hmac.new(self._key, message.SerializeToString(deterministic=True), hashlib.sha256).digest()

    def _verify(self, message: Any) -> bool:
        signature = message.auth.signature
        message.auth.signature = b""
        ok = hmac.compare_digest(signature, self._sign(message))
        message.auth.signature = signature
        return ok

    async def sign_request(self, request: Any, service_public_key: Any) -> None:
        from hivemind.utils.timed_storage import get_dht_time

        request.auth.time = get_dht_time()
        request.auth.nonce = secrets.token_bytes(16)
        request.auth.signature = b""
        request.auth.signature = self._sign(request)

    async def validate_request(self, request: Any) -> bool:
        from hivemind.utils.timed_storage import get_dht_time

        now = get_dht_time()
        if not self._verify(request):
            self.refused["unauthorized"] += 1
            return False
        if abs(request.auth.time - now) > self.max_age or request.auth.nonce in self._nonces:
            self.refused["replay"] += 1
            return False
        self._nonces.store(request.auth.nonce, None, now + 3 * self.max_age)
        return True

    async def sign_response(self, response: Any, request: Any) -> None:
        response.auth.nonce = request.auth.nonce
        response.auth.signature = b""
        response.auth.signature = self._sign(response)

    async def validate_response(self, response: Any, request: Any) -> bool:
        return response.auth.nonce == request.auth.nonce and self._verify(response)
