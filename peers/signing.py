"""Directory records in the DHT are signed by their writers, and no DHT node keeps or believes others.

The swarm secret lets a peer use the swarm's DHT (`comms/auth.py`), which alone would let any holder
write any record: one under another peer's id (a fake round, digest or ban list in its name), or an
old record of a peer re-stored with a later expiration, which the DHT would keep over that peer's
own newer ones. So each record is signed with its writer's libp2p key (`comms/identity.py`; the
peer id embeds the public key) over the DHT key, the subkey (the writer's peer id), the expiration
and the value. hivemind calls `validate` on every record a node is asked to store and on every record
in an answer to our lookups: an honest node stores no forged record, and a reader drops one that a
dishonest node returns. (One such record makes hivemind drop that node's whole answer; honest nodes
never hold one.)

What a holder of the secret can still do: write records for identities it makes up (it could join
the swarm with them just as well), which the allowlist bounds (`DHTDirectory` reads only listed
peers' records); and, from a node of its own, leave records out of its answers, since signatures
stop forgery, not withholding.
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
REASONS = ("not_a_peer_record", "unsigned_record", "bad_signature")
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


def check(record: DHTRecord) -> str:
    """Why `record` (value as stored: signed) is not the authentic record of the peer its subkey names,
    or "" if it is."""
    peer = peer_of(record.subkey)
    if peer is None:
        return "not_a_peer_record"
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
    check, and hand the application the value without it. `rejected` counts refusals by reason (each
    time a record is offered: a store, or an answer holding it)."""

    def __init__(self, identity: Identity | None) -> None:
        self.identity = identity
        self.rejected: Counter[str] = Counter()
        self._told: set[tuple[str, str]] = set()

    def validate(self, record: DHTRecord) -> bool:
        why = check(record)
        if why:
            self.refuse(peer_of(record.subkey) or "?", why)
        return not why

    def refuse(self, writer: str, why: str) -> None:
        """Count a refused record; log it once per (writer, reason), for a bounded number of them (a
        forger can make up any number of peer ids)."""
        self.rejected[why] += 1
        if (writer, why) not in self._told and len(self._told) < 256:
            self._told.add((writer, why))
            log.warning("event=record_refused writer=%s reason=%s", writer[:128], why)

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.identity is None:
            raise RuntimeError("this directory was opened without our identity: it can read records, not write ours")
        return sign(self.identity, record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return bytes(record.value[: -SIG - len(MAGIC)])
