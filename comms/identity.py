"""A peer's libp2p identity, made here and handed to its daemon, so that the peer can sign with it.

A libp2p peer id of an Ed25519 key *is* the key (an identity multihash of the protobuf-encoded
public key: the `12D3KooW…` ids), so anyone can check a signature against a peer id alone, with
no key exchange: `verify(peer_id, data, signature)`. The daemon proves the same key on every
connection (libp2p's handshake), so a signature checked here speaks for the peer that other peers
talk to under that id.

The swarm signs its directory records with it (`peers/records.py`): holding the swarm secret lets
a peer write to the DHT, but no longer under another peer's id. The Ed25519 primitives come from
`cryptography`, which hivemind itself requires (its RSA keys and DHT validators).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import tempfile
from contextlib import contextmanager
from typing import IO, Iterator

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from diloco.compression.errors import DiLoCoError

from .transport import PeerId

log = logging.getLogger(__name__)

# libp2p's protobuf KeyType enum: Ed25519 = 1. PrivateKey/PublicKey are {1: type (varint), 2: data}.
_ED25519_PUBLIC = b"\x08\x01\x12\x20"  # type Ed25519, data of 32 bytes
_ED25519_PRIVATE = b"\x08\x01\x12\x40"  # type Ed25519, data of 64 bytes (seed, then public key)
_IDENTITY_MULTIHASH = b"\x00\x24"  # multihash "identity" (the data itself), 36 bytes
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


class IdentityError(DiLoCoError, ValueError):
    """An identity file that cannot be used; the message names the file and the fix."""


class Identity:
    """An Ed25519 key pair and its libp2p peer id. The private key leaves this object only into the
    daemon's key file (`key_file`, which exists only while the daemon starts) or the file a peer keeps
    its identity in across restarts (`load`)."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
        self.public_key = public
        self.peer_id = PeerId(_b58encode(_IDENTITY_MULTIHASH + _ED25519_PUBLIC + public))
        self._lock: IO[bytes] | None = None

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str) -> Identity:
        """The identity kept in `path` (libp2p's key file format), created (mode 600) if missing, so a
        peer keeps its peer id across restarts. The file is locked while this process runs: two peers
        under one id would take each other's connections (a lock cannot see other machines: copy a
        key file to one machine only)."""
        if not os.path.exists(path):
            _write_key_file(path, cls.generate())
        try:
            f = open(path, "rb")  # read-only: a key file hardened to mode 400 is fine
        except OSError as e:
            raise IdentityError(f"cannot open the identity file {path}: {e.strerror}") from None
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise IdentityError(f"the identity file {path} is in use by another process on this machine; "
                                    "give each peer its own file") from None
            identity = cls(_parse_private_key(f.read(), path))
            if os.fstat(f.fileno()).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                log.warning("event=identity_file_readable path=%s fix=chmod 600 %s", path, path)
        except BaseException:
            f.close()
            raise
        identity._lock = f
        return identity

    def release(self) -> None:
        """Unlock the identity file (`load`); the process exiting does the same."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _libp2p_private_key(self) -> bytes:
        seed = self._key.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw, ser.NoEncryption())
        return _ED25519_PRIVATE + seed + self.public_key

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"

    @contextmanager
    def key_file(self) -> Iterator[str]:
        """The private key in libp2p's file format, in a private directory, removed on exit (the daemon
        reads it once, at start)."""
        with tempfile.TemporaryDirectory(prefix="diloco-id-") as d:  # mode 700
            path = os.path.join(d, "identity.key")
            _write_key_file(path, self)
            yield path


def _write_key_file(path: str, identity: Identity) -> None:
    """Write `identity`'s key to `path` (mode 600) unless a file is there: written whole to a private
    temporary file first, then linked into place, so nobody ever reads a half-written key."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".diloco-id-", dir=directory)  # mode 600
    except OSError as e:
        raise IdentityError(f"cannot create the identity file {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(identity._libp2p_private_key())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use that one
        except OSError as e:
            raise IdentityError(f"cannot create the identity file {path}: {e.strerror}") from None
    finally:
        os.unlink(tmp)


def _parse_private_key(data: bytes, path: str) -> Ed25519PrivateKey:
    """The key in a libp2p Ed25519 PrivateKey file (the seed, then the public key it must derive)."""
    if not data:
        raise IdentityError(f"{path} is empty: delete it and a new one is created")
    if len(data) != len(_ED25519_PRIVATE) + 64 or not data.startswith(_ED25519_PRIVATE):
        raise IdentityError(f"{path} is not a libp2p Ed25519 key file ({len(data)} bytes; RSA keys, e.g. "
                            "hivemind's, cannot sign diloco's records): move it away and a new one is created")
    body = data[len(_ED25519_PRIVATE):]
    key = Ed25519PrivateKey.from_private_bytes(body[:32])
    if key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw) != body[32:]:
        raise IdentityError(f"{path} is damaged (its public key does not match its private key): move it away "
                            "and a new one is created")
    return key


def public_key_of(peer_id: str) -> bytes | None:
    """The Ed25519 public key a peer id embeds; None for any other kind of id (RSA, malformed)."""
    raw = _b58decode(peer_id)
    head = _IDENTITY_MULTIHASH + _ED25519_PUBLIC
    if raw is None or len(raw) != len(head) + 32 or not raw.startswith(head):
        return None
    return raw[len(head):]


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """Did the holder of `peer_id`'s key sign `data`? False for a bad signature or a peer id that does
    not embed an Ed25519 key."""
    public = public_key_of(peer_id)
    if public is None or not isinstance(signature, bytes) or len(signature) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def _b58encode(data: bytes) -> str:
    n, out = int.from_bytes(data, "big"), ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def _b58decode(text: str) -> bytes | None:
    if not isinstance(text, str) or not 0 < len(text) <= 128:
        return None
    n = 0
    for ch in text:
        i = _B58.find(ch)
        if i < 0:
            return None
        n = n * 58 + i
    zeros = len(text) - len(text.lstrip("1"))
    return b"\0" * zeros + (n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b"")
