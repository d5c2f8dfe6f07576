"""The round protocol's messages, each one wire frame (`diloco.compression.frame`).

| kind      | direction            | body                      | meta                          |
|-----------|----------------------|---------------------------|-------------------------------|
| `ready`   | member → member      | peer ids it expects       | attempt, digest               |
| `contrib` | member → span owner  | encoded span of Δ         | attempt                       |
| `result`  | owner → every member | mean, or bundle (sparse)  | attempt, contributors, result |
| `vote`    | member → member      | (none)                    | attempt (the view names the value accepted) |
| `value`   | member → member      | (reply) the value's frames | attempt (of the value), members |
| `probe`   | member → member      | (none)                    | attempt, view (is it still running it? `undelivered`: its contribution to the asker could not be sent) |
| `ack`     | reply to any call    | (ready) peer ids expected | ok, reason, closed, in_view, ready, accepted |

`ready` and its `ack` also carry what the sender accepted in an earlier attempt of the round
(`acc_attempt`, `acc_value`); a `vote` is answered with `accepted`, `committed` or `past`.

A frame is checked (magic, version, sizes before allocation, checksum, run id, kind) before any
field is used; the caller's libp2p-authenticated peer id must equal the frame's `sender`.
"""

from __future__ import annotations

import struct
from typing import Any, Collection, Iterable

from diloco.compression import Header, PayloadRejected, Reason, pack, unpack

from .spans import RoundKey
from .transport import PeerId

READY, CONTRIB, RESULT, ACK, STATE = "ready", "contrib", "result", "ack", "state"
VOTE, VALUE, PROBE = "vote", "value", "probe"
MAX_NAMES = 4096  # peer ids one ready message (or reply) may name
MAX_NAMES_BYTES = MAX_NAMES * 129


def encode(
    kind: str,
    *,
    run: str,
    sender: PeerId,
    schema: str = "",
    key: RoundKey | None = None,
    view: str = "",
    span: int = -1,
    codec: str = "",
    numel: int = 0,
    fragment: int = 0,
    meta: dict[str, Any] | None = None,
    body: bytes = b"",
) -> bytes:
    meta = dict(meta or {})
    if key is not None:
        meta["attempt"] = key.attempt
    return pack(
        kind=kind,
        run=run,
        schema=schema,
        round=key.round if key is not None else 0,
        view=view,
        span=span,
        sender=sender,
        codec=codec,
        numel=numel,
        fragment=fragment,
        meta=meta,
        body=body,
    )


def decode(
    data: bytes, *, run: str, kind: str, caller: PeerId, max_body: int, schema: str | None = None
) -> tuple[Header, memoryview, RoundKey]:
    """Unpack and check a frame; raises `PayloadRejected` with a reason for anything wrong."""
    header, body = unpack(data, max_body=max_body, expect_run=run, expect_kind=kind, expect_schema=schema)
    if header.sender != caller:
        raise PayloadRejected(Reason.NOT_MEMBER, f"frame claims sender {header.sender} but came from {caller}")
    attempt = header.meta.get("attempt", 0)
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise PayloadRejected(Reason.BAD_HEADER, f"meta.attempt must be a non-negative int, got {attempt!r}")
    return header, body, RoundKey(header.round, attempt)


def ack(*, run: str, sender: PeerId, ok: bool = True, reason: str = "", names: Iterable[PeerId] = (),
        waited: Collection[PeerId] = (), **meta: Any) -> bytes:
    return encode(ACK, run=run, sender=sender, meta={"ok": ok, "reason": reason, **meta},
                  body=pack_names(names, waited))


def read_ack(data: bytes, *, run: str, caller: PeerId) -> dict[str, Any]:
    """The reply's meta; peer ids in its body, if any, under "expect" and "waits" (see `unpack_names`)."""
    header, body, _ = decode(data, run=run, kind=ACK, caller=caller, max_body=MAX_NAMES_BYTES)
    meta: dict[str, Any] = dict(header.meta)
    if body:
        meta["expect"], meta["waits"] = unpack_names(body)
    return meta


def pack_names(names: Iterable[PeerId], waited: Collection[PeerId]) -> bytes:
    """Peer ids the sender of a ready message (or of its reply) expects in the round, one a line;
    "~" marks one it asks but does not wait for (a straggler)."""
    return "\n".join(p if p in waited else "~" + p for p in sorted(names)).encode()


def unpack_names(body: memoryview) -> tuple[frozenset[PeerId], frozenset[PeerId]]:
    """(every id named, the ids its sender waits for)."""
    if not body:
        return frozenset(), frozenset()
    try:
        lines = bytes(body).decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise PayloadRejected(Reason.BAD_HEADER, "peer list is not UTF-8") from None
    names = [line.removeprefix("~") for line in lines]
    if len(names) > MAX_NAMES or not all(0 < len(p) <= 128 for p in names):
        raise PayloadRejected(Reason.BAD_HEADER, f"peer list needs 1 to {MAX_NAMES} ids of 1 to 128 characters")
    waits = [line for line in lines if not line.startswith("~")]
    return frozenset(PeerId(p) for p in names), frozenset(PeerId(p) for p in waits)


_BUNDLE_HEAD = struct.Struct("<H")
_BUNDLE_ITEM = struct.Struct("<HI")


def pack_bundle(items: list[tuple[int, bytes]]) -> bytes:
    """A sparse span's result: the exact payloads the owner included, each with its contributor's
    index in the view. Every member decodes and averages the same bytes, so all agree bit for bit."""
    head = _BUNDLE_HEAD.pack(len(items)) + b"".join(_BUNDLE_ITEM.pack(i, len(p)) for i, p in items)
    return head + b"".join(p for _, p in items)


def unpack_bundle(body: memoryview, max_items: int) -> list[tuple[int, memoryview]]:
    """Split a bundle; raises PayloadRejected if its table of contents does not fit the body."""
    if body.nbytes < _BUNDLE_HEAD.size:
        raise PayloadRejected(Reason.TRUNCATED, "bundle shorter than its item count")
    (count,) = _BUNDLE_HEAD.unpack_from(body, 0)
    if not 1 <= count <= max_items:
        raise PayloadRejected(Reason.BAD_HEADER, f"bundle of {count} items, expected 1..{max_items}")
    offset = _BUNDLE_HEAD.size + count * _BUNDLE_ITEM.size
    if offset > body.nbytes:
        raise PayloadRejected(Reason.TRUNCATED, "bundle table of contents truncated")
    items = []
    for j in range(count):
        index, length = _BUNDLE_ITEM.unpack_from(body, _BUNDLE_HEAD.size + j * _BUNDLE_ITEM.size)
        if offset + length > body.nbytes:
            raise PayloadRejected(Reason.TRUNCATED, f"bundle item {j} runs past the body")
        items.append((index, body[offset : offset + length]))
        offset += length
    if offset != body.nbytes:
        raise PayloadRejected(Reason.WRONG_SIZE, f"{body.nbytes - offset} trailing bytes after the bundle")
    if len({i for i, _ in items}) != count or [i for i, _ in items] != sorted(i for i, _ in items):
        raise PayloadRejected(Reason.DUPLICATE, "bundle contributor indices must be unique and ascending")
    return items
