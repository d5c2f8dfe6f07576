"""The round protocol's messages, each one wire frame (`diloco.compression.frame`).

| kind      | direction            | body                      | meta                          |
|-----------|----------------------|---------------------------|-------------------------------|
| `ready`   | member → member      | empty                     | attempt, digest               |
| `contrib` | member → span owner  | encoded span of Δ         | attempt                       |
| `result`  | owner → every member | encoded mean of the span  | attempt, contributors (index) |
| `ack`     | reply to any call    | empty                     | ok, reason, closed, in_view   |

A frame is checked (magic, version, sizes before allocation, checksum, run id, kind) before any
field is used; the caller's libp2p-authenticated peer id must equal the frame's `sender`.
"""

from __future__ import annotations

from typing import Any

from diloco.compression import Header, PayloadRejected, Reason, pack, unpack

from .spans import RoundKey
from .transport import PeerId

READY, CONTRIB, RESULT, ACK, STATE = "ready", "contrib", "result", "ack", "state"


def encode(
    kind: str,
    *,
    run: str,
    sender: PeerId,
    key: RoundKey | None = None,
    view: str = "",
    span: int = -1,
    codec: str = "",
    numel: int = 0,
    meta: dict[str, Any] | None = None,
    body: bytes = b"",
) -> bytes:
    meta = dict(meta or {})
    if key is not None:
        meta["attempt"] = key.attempt
    return pack(
        kind=kind,
        run=run,
        round=key.round if key is not None else 0,
        view=view,
        span=span,
        sender=sender,
        codec=codec,
        numel=numel,
        meta=meta,
        body=body,
    )


def decode(data: bytes, *, run: str, kind: str, caller: PeerId, max_body: int) -> tuple[Header, memoryview, RoundKey]:
    """Unpack and check a frame; raises `PayloadRejected` with a reason for anything wrong."""
    header, body = unpack(data, max_body=max_body, expect_run=run, expect_kind=kind)
    if header.sender != caller:
        raise PayloadRejected(Reason.NOT_MEMBER, f"frame claims sender {header.sender} but came from {caller}")
    attempt = header.meta.get("attempt", 0)
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise PayloadRejected(Reason.BAD_HEADER, f"meta.attempt must be a non-negative int, got {attempt!r}")
    return header, body, RoundKey(header.round, attempt)


def ack(*, run: str, sender: PeerId, ok: bool = True, reason: str = "", **meta: Any) -> bytes:
    return encode(ACK, run=run, sender=sender, meta={"ok": ok, "reason": reason, **meta})


def read_ack(data: bytes, *, run: str, caller: PeerId) -> dict[str, Any]:
    header, _, _ = decode(data, run=run, kind=ACK, caller=caller, max_body=0)
    return dict(header.meta)
