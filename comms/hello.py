"""The join handshake: before a peer takes part, it and the peer it dials compare what must match.

A `diloco.hello` call carries the caller's protocol version, run id and schema digest (SHA-256 over
parameter names, shapes, dtypes and the codec and fragment layout; empty before the model is known)
and its wall clock. The callee answers with its own and whether they match; a mismatch names the
first differing field, so `diloco join` can exit at once saying what to fix instead of training
into rejected frames. The caller also compares clocks (`clock_offset`): the swarm's directory
records expire by wall clock, so a peer whose clock is off by about `heartbeat_ttl` would be
invisible to the others (and they to it) without any error. A joiner takes the median of these offsets
as the swarm's time (`comms.clock`), which its directory reads from then on; a clock more than
`MAX_CLOCK_SKEW` off is refused at once.
The call is authenticated with the swarm key (the secret, not the run), so a peer with the right
secret and the wrong run id learns that the run id differs; a peer without the secret learns
nothing (`auth.py`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgpack

from diloco.compression import PROTOCOL_VERSION
from diloco.compression.errors import DiLoCoError

MAX_HELLO = 1024  # bytes: a hello is four short fields
FIELDS = ("protocol", "run_id", "schema")
FIX = {
    "protocol": "run the same diloco version on every peer",
    "run_id": "pass the --run-id the swarm was started with",
    "schema": "use the same model, compression, --fragments and --fragment-pattern as the swarm",
    "secret": "the swarm secret differs: use the secret file `diloco start` wrote (--secret-file) or its "
              "DILOCO_SECRET",
    "allowlist": "this peer is not on the swarm's allowlist: ask its operator to add this peer id",
    "clock": "synchronize the clocks of both machines (NTP: `timedatectl set-ntp true`, or chrony)",
}
REASON = {"protocol": "bad_version", "run_id": "wrong_run", "schema": "wrong_schema"}
"""The rejection reason a refused handshake is counted under (the frame checks use the same ones)."""


class HandshakeError(DiLoCoError, RuntimeError):
    """The peer we dialed belongs to another swarm configuration; `field` says which setting differs."""

    def __init__(self, field: str, ours: Any, theirs: Any, peer: str) -> None:
        self.field = field
        if field in ("secret", "allowlist"):  # never echo a credential
            super().__init__(f"handshake with {peer} failed: {FIX[field]}")
            return
        super().__init__(f"handshake with {peer} failed: {field} differs (this peer: {ours!r}, the swarm: "
                         f"{theirs!r}); {FIX.get(field, '')}".rstrip("; "))


class ClockSkew(HandshakeError):
    """The peer we dialed reads a wall clock too far from ours for the swarm's directory to work."""

    def __init__(self, offset: float, bound: float, limit: float, peer: str) -> None:
        self.field = "clock"
        RuntimeError.__init__(self, (
            f"handshake with {peer} failed: its clock is {abs(offset):.1f} s {'ahead of' if offset > 0 else 'behind'} "
            f"this machine's (±{bound:.2f} s); a joining peer's clock must be within {limit:.0f} s of the swarm's "
            f"(the directory's records expire by wall clock); {FIX['clock']}"))


def hello(run_id: str, schema: str, now: float | None = None) -> dict[str, Any]:
    return {"protocol": PROTOCOL_VERSION, "run_id": run_id, "schema": schema,
            "time": time.time() if now is None else now}


def clock_offset(sent: float, received: float, theirs: float) -> tuple[float, float]:
    """(their clock − ours, how far off that estimate can be) from one call: they read their clock
    after we `sent` and before we `received` (our clock), so it read (sent + received) / 2 ± half the
    round trip on ours."""
    return theirs - (sent + received) / 2, max(0.0, received - sent) / 2


MAX_CLOCK_SKEW = 300.0
"""Seconds a joining peer's clock may be off the swarm's: within it, the joiner reads the swarm's time from then on
(`comms.clock.SwarmClock.adopt`); beyond it, the machine's clock is wrong, and the join is refused (the DHT's signed
requests allow 300 s)."""


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
    when = value.get("time")
    if when is not None and (isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when)):
        raise ValueError("hello's time must be a finite number of seconds")
    return value


def mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first field that differs; a schema only counts when both sides know theirs."""
    for f in FIELDS:
        if f == "schema" and not (ours[f] and theirs[f]):
            continue
        if ours[f] != theirs[f]:
            return f
    return None
