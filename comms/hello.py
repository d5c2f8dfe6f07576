"""The join handshake: before a peer takes part, it and the peer it dials compare what must match.

A `diloco.hello` call carries the caller's protocol version, run id and schema digest (SHA-256 over
parameter names, shapes, dtypes and the codec and fragment layout; empty before the model is known).
The callee answers with its own and whether they match; a mismatch names the first differing
field, so `diloco join` can exit at once saying what to fix instead of training into rejected frames.
The call is authenticated with the swarm key (the secret, not the run), so a peer with the right
secret and the wrong run id learns that the run id differs; a peer without the secret learns
nothing (`auth.py`).
"""

from __future__ import annotations

from typing import Any

import msgpack

from diloco.compression import PROTOCOL_VERSION

MAX_HELLO = 1024  # bytes: a hello is three short fields
FIELDS = ("protocol", "run_id", "schema")
FIX = {
    "protocol": "run the same diloco version on every peer",
    "run_id": "pass the --run-id the swarm was started with",
    "schema": "use the same model, compression, --fragments and --fragment-pattern as the swarm",
    "secret": "the swarm secret differs: use the secret file `diloco start` wrote (--secret-file) or its "
              "DILOCO_SECRET",
    "allowlist": "this peer is not on the swarm's allowlist: ask its operator to add this peer id",
}
REASON = {"protocol": "bad_version", "run_id": "wrong_run", "schema": "wrong_schema"}
"""The rejection reason a refused handshake is counted under (the frame checks use the same ones)."""


class HandshakeError(RuntimeError):
    """The peer we dialed belongs to another swarm configuration; `field` says which setting differs."""

    def __init__(self, field: str, ours: Any, theirs: Any, peer: str) -> None:
        self.field = field
        if field in ("secret", "allowlist"):  # never echo a credential
            super().__init__(f"handshake with {peer} failed: {FIX[field]}")
            return
        super().__init__(f"handshake with {peer} failed: {field} differs (this peer: {ours!r}, the swarm: "
                         f"{theirs!r}); {FIX.get(field, '')}".rstrip("; "))


def hello(run_id: str, schema: str) -> dict[str, Any]:
    return {"protocol": PROTOCOL_VERSION, "run_id": run_id, "schema": schema}


def pack(fields: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(fields, use_bin_type=True)
    return data


def unpack(data: bytes) -> dict[str, Any]:
    """A hello (or its answer) from the network; ValueError when it is not one."""
    if len(data) > MAX_HELLO:
        raise ValueError(f"hello of {len(data)} bytes exceeds {MAX_HELLO}")
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=256, max_map_len=8)
    except Exception as e:  # noqa: BLE001 - any msgpack failure is "not a hello"
        raise ValueError(f"hello is not msgpack: {type(e).__name__}") from None
    if not isinstance(value, dict) or not isinstance(value.get("protocol"), int) \
            or not all(isinstance(value.get(k), str) for k in ("run_id", "schema")):
        raise ValueError("hello needs protocol (int), run_id and schema (str)")
    return value


def mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first field that differs; a schema only counts when both sides know theirs."""
    for f in FIELDS:
        if f == "schema" and not (ours[f] and theirs[f]):
            continue
        if ours[f] != theirs[f]:
            return f
    return None
