"""Typed rejection of bad wire input.

Everything that arrives from another peer is untrusted: it may be truncated by a
dropped connection, corrupted in flight, sent by an older build, meant for another
run, or crafted to make us allocate gigabytes. The decoding layers of this package
(:mod:`diloco.compression.frame` and :mod:`diloco.compression.codecs`) therefore
promise one thing to their callers: *bad bytes raise* :class:`PayloadRejected`
*and nothing else*. No ``KeyError``, no ``struct.error``, no ``MemoryError``, no
crash from a msgpack corner case.

Each rejection carries a :class:`Reason` -- a small closed set of machine-readable
codes a caller can count, log, or branch on (for example: drop a frame with
``WRONG_ROUND`` quietly, but ban a peer that keeps sending ``BAD_CHECKSUM``) -- and
a free-text ``detail`` for humans. Reasons are ``str`` enums whose values are
lower_snake strings, so they serialise into logs and metrics as themselves::

    >>> err = PayloadRejected(Reason.BAD_CHECKSUM, "crc32 mismatch")
    >>> str(err)
    'payload rejected (bad_checksum): crc32 mismatch'
    >>> err.reason == "bad_checksum"
    True

Some reasons (``WRONG_ROUND``, ``WRONG_VIEW``, ``WRONG_SPAN``, ``NOT_MEMBER``,
``DUPLICATE``, ``NON_FINITE``, ``TOO_LARGE``, ``BANNED``) are never raised by this package itself; they are
defined here so the higher layers that check those properties share one
vocabulary and one exception type with the wire layer.

Local programming errors (calling ``pack`` with a negative round, encoding a
float64 tensor) are *not* network input and raise ``ValueError``/``TypeError``
as usual.
"""

from __future__ import annotations

import enum

__all__ = ["ConfigError", "DiLoCoError", "PayloadRejected", "Reason", "SpecError", "UsageError"]


class Reason(str, enum.Enum):
    """Why a payload from the network was rejected."""

    BAD_MAGIC = "bad_magic"
    """The frame does not start with the protocol magic: not our protocol."""
    BAD_VERSION = "bad_version"
    """Our magic, but a protocol version this build does not speak."""
    TRUNCATED = "truncated"
    """Fewer bytes than the frame itself declares."""
    OVERSIZED = "oversized"
    """A declared size exceeds the receiver's limit (checked before allocating)."""
    BAD_HEADER = "bad_header"
    """The header is not valid msgpack, or a field is missing, mistyped or out of range."""
    WRONG_RUN = "wrong_run"
    """A well-formed frame that belongs to another training run."""
    WRONG_KIND = "wrong_kind"
    """A well-formed frame of a message kind the receiver did not ask for."""
    WRONG_SCHEMA = "wrong_schema"
    """A well-formed frame for another model schema or codec spec (peers are configured differently)."""
    WRONG_ROUND = "wrong_round"
    """A well-formed frame for another outer round."""
    WRONG_VIEW = "wrong_view"
    """A well-formed frame computed under another membership view."""
    WRONG_SPAN = "wrong_span"
    """A well-formed frame for another span (shard) of the parameters."""
    WRONG_SIZE = "wrong_size"
    """Byte count does not match what the declared element count implies."""
    BAD_DTYPE = "bad_dtype"
    """Unknown or mismatched value encoding (wire codec)."""
    BAD_CHECKSUM = "bad_checksum"
    """The body does not match its crc32: corrupted in flight."""
    NOT_MEMBER = "not_member"
    """The sender is not a member of the current view."""
    DUPLICATE = "duplicate"
    """A second contribution for something already received."""
    NON_FINITE = "non_finite"
    """Decoded values contain NaN or infinity."""
    TOO_LARGE = "too_large"
    """Decoded values exceed the receiver's admission bound (root-mean-square above max_rms)."""
    BANNED = "banned"
    """The sender was banned for this run after repeated bad contributions."""

    def __str__(self) -> str:
        return self.value


class DiLoCoError(Exception):
    """The root of every exception diloco raises on purpose: `except diloco.DiLoCoError` catches a wrong setting,
    a refused handshake, a swarm that could not be joined, a damaged checkpoint, a payload refused, …

    It lives on the lowest floor (this package imports nothing of ours) so that every floor above can derive
    from it. Most classes beneath it also keep the standard base they always had (`ConfigError` is still a
    `ValueError`, `SwarmError` a `RuntimeError`), so code that caught those goes on catching them."""


class ConfigError(DiLoCoError, ValueError):
    """A setting is invalid; the message names the field, the constraint and the fix."""


class UsageError(DiLoCoError, RuntimeError):
    """A call the object's current setup does not allow (`DiLoCo.sync()` with a whole outer step overlapped, a
    callback used outside its Trainer); the message says what to call instead."""


class SpecError(ConfigError):
    """A compression spec string that cannot be used (an unknown codec, a bad argument): the message names the
    part and a spec that works."""


class PayloadRejected(DiLoCoError):
    """Bytes from the network failed validation.

    Attributes:
        reason: the machine-readable :class:`Reason`.
        detail: a short human-readable explanation (never contains the payload).
    """

    reason: Reason
    detail: str

    def __init__(self, reason: Reason, detail: str = "") -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        if self.detail:
            return f"payload rejected ({self.reason.value}): {self.detail}"
        return f"payload rejected ({self.reason.value})"

    def __repr__(self) -> str:
        return f"PayloadRejected({self.reason.value!r}, {self.detail!r})"

