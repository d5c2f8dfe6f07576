"""Directory records in the DHT are signed by their writers, and no DHT node keeps or believes others.

The swarm secret lets a peer use the swarm's DHT (`comms/auth.py`), which alone would let any holder
write any record: one under another peer's id (a fake round, digest or ban list in its name), or an
old record of a peer re-stored with a later expiration, which the DHT would keep over that peer's
own newer ones. So each record is signed with its writer's libp2p key (`comms/identity.py`; the
peer id embeds the public key) over the DHT key, the subkey (the writer's peer id), the expiration
and the value. hivemind calls `validate` on every record a node is asked to store and on every record
in an answer to our lookups: an honest node stores no forged record, and a reader drops one that a
dishonest node returns. With an allowlist, records of peers off it are refused the same way.

What a holder of the secret can still do is write records for identities it makes up (it could join
the swarm with them just as well): the allowlist is what bounds those.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter

import msgpack
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from diloco.comms.identity import Identity, verify

log = logging.getLogger(__name__)

MAGIC = b"diloco-sig-1"
SIG = 64  # Ed25519
REASONS = ("not_a_peer_record", "not_allowed", "unsigned_record", "bad_signature")
"""Why a record is refused (`check`); counted under `records_dropped` in the final metrics."""


def signed_bytes(key: bytes, subkey: bytes, expiration: float, value: bytes) -> bytes:
    """What a record's signature covers: the DHT key (the run), the subkey (the writer's peer id),
    the expiration (so that an old record cannot be re-stored to outlive newer ones) and the value."""
    return b"".join((MAGIC, struct.pack(">IIId", len(key), len(subkey), len(value), expiration), key, subkey, value))


def peer_of(subkey: bytes) -> str | None:
    """The peer id a record's (serialized) subkey names, or None if it is no peer id."""
    try:
        peer = msgpack.unpackb(subkey, raw=False)
    except Exception:  # noqa: BLE001 - any unpacking failure means "not a peer id"
        return None
    return peer if isinstance(peer, str) and 0 < len(peer) <= 128 else None


def sign(identity: Identity, record: DHTRecord) -> bytes:
    """`record.value` followed by our signature and the magic (a record of another peer gets none)."""
    value = bytes(record.value)
    if peer_of(record.subkey) != identity.peer_id:
        return value
    return value + identity.sign(signed_bytes(record.key, record.subkey, record.expiration_time, value)) + MAGIC


def check(record: DHTRecord, allow: frozenset[str] | None = None) -> str:
    """Why `record` (value as stored: signed) is not the authentic record of the peer its subkey names,
    or "" if it is."""
    peer = peer_of(record.subkey)
    if peer is None:
        return "not_a_peer_record"
    if allow is not None and peer not in allow:
        return "not_allowed"
    value = record.value
    if len(value) < SIG + len(MAGIC) or not value.endswith(MAGIC):
        return "unsigned_record"
    body, sig = value[: -SIG - len(MAGIC)], value[-SIG - len(MAGIC): -len(MAGIC)]
    expiration = record.expiration_time
    if not isinstance(expiration, float) or not verify(peer, signed_bytes(record.key, record.subkey, expiration, body), sig):
        return "bad_signature"
    return ""


class SignedRecords(RecordValidatorBase):  # type: ignore[misc]  # hivemind has no type stubs
    """hivemind's hook: sign our records as we store them, refuse every record whose signature does not
    check (or whose writer is off the allowlist), and hand the application the value without it.
    `rejected` counts refusals by reason; each (writer, reason) is logged once (a bounded number)."""

    def __init__(self, identity: Identity | None, allow: frozenset[str] | None = None) -> None:
        self.identity = identity
        self.allow = None if allow is None else allow | ({identity.peer_id} if identity else frozenset())
        self.rejected: Counter[str] = Counter()
        self._told: set[tuple[str, str]] = set()

    def validate(self, record: DHTRecord) -> bool:
        why = check(record, self.allow)
        if why:
            self.rejected[why] += 1
            writer = peer_of(record.subkey) or "?"
            if (writer, why) not in self._told and len(self._told) < 256:
                self._told.add((writer, why))
                log.warning("event=record_refused writer=%s reason=%s", writer, why)
        return not why

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.identity is None:
            raise RuntimeError("this directory was opened without our identity: it can read records, not write ours")
        return sign(self.identity, record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return bytes(record.value[: -SIG - len(MAGIC)])
