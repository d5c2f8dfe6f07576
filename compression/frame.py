"""The versioned wire frame: one self-describing, checksummed message.

Every message between peers is one frame::

    offset  size  content
    0       4     magic  b"DLC1"
    4       1     protocol version (PROTOCOL_VERSION)
    5       4     header length H, unsigned little-endian
    9       H     header: a msgpack map (see below)
    9+H     ...   body: exactly header["body_len"] bytes

The header map has exactly these keys, all required, with strict types
(``bool`` is not accepted where an ``int`` is expected):

=========  ======  =========================================================
key        type    meaning
=========  ======  =========================================================
kind       str     message kind, e.g. "contrib" or "result"
run        str     training run id; frames of other runs are rejected
schema     str     digest of the model schema and codec spec ("" if none)
round      int>=0  outer round number
fragment   int>=0  model fragment the body belongs to (0 when the model is one fragment)
view       str     membership view id ("" when not applicable)
span       int>=-1 parameter span (shard) index; -1 means "no span"
sender     str     sender's peer id
codec      str     value codec of the body (see :mod:`.codecs`), "" if none
numel      int>=0  number of encoded values in the body
body_len   int>=0  body length in bytes
crc32      int     ``zlib.crc32(body)``
meta       map     str -> int | float | str | bool | list[int]; small extras
=========  ======  =========================================================

:func:`pack` fills ``body_len`` and ``crc32`` itself and writes the keys in the
fixed order above (``meta`` keys sorted), so equal inputs give equal bytes.

:func:`unpack` treats its input as hostile. It checks, in this order and
before allocating anything whose size comes from the wire: the prefix length
(``TRUNCATED``), magic (``BAD_MAGIC``), version (``BAD_VERSION``), header length
against ``max_header`` and the bytes present (``OVERSIZED``/``TRUNCATED``),
msgpack decoding under small container limits (``BAD_HEADER``), every field's
presence, type and range (``BAD_HEADER``), ``body_len`` against ``max_body``
(``OVERSIZED``) and against the bytes present (``TRUNCATED`` if short,
``WRONG_SIZE`` if there are trailing bytes), the crc32 (``BAD_CHECKSUM``), and
finally the caller's expected run, kind and schema (``WRONG_RUN``, ``WRONG_KIND``,
``WRONG_SCHEMA``).
It raises :class:`PayloadRejected` and nothing else. The body is returned as a
zero-copy ``memoryview`` into the input; codecs copy when they decode it.

Changing anything in this layout -- or the header's keys, types or order --
changes bytes on the wire and requires bumping :data:`PROTOCOL_VERSION`.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Mapping
from typing import Any, Final, Union

import msgpack

from .errors import PayloadRejected, Reason

__all__ = ["MAGIC", "PROTOCOL_VERSION", "DEFAULT_MAX_HEADER", "MetaValue", "Header", "pack", "unpack"]

MAGIC: Final[bytes] = b"DLC1"
PROTOCOL_VERSION: Final[int] = 6  # 2: schema and fragment; 3: signed directory records; 4: rounds decide by quorum;
# 5: views name their members' incarnations (a peer restarted mid-round is another member); 6: contributions are
# summed in the order of their CRC-32s (`diloco.comms.reduce`), not of their BLAKE2b digests
DEFAULT_MAX_HEADER: Final[int] = 64 * 1024

_PREFIX: Final[struct.Struct] = struct.Struct("<4sBI")  # magic, version, header length
_U64_MAX: Final[int] = 2**64 - 1
_I64_MIN: Final[int] = -(2**63)
_I64_MAX: Final[int] = 2**63 - 1

# msgpack's own limits while decoding a header: small, so a hostile header cannot
# make the decoder build large containers. Binary and extension types never occur.
_MSGPACK_LIMITS: Final[dict[str, int]] = {
    "max_str_len": 4096,
    "max_bin_len": 0,
    "max_array_len": 16384,
    "max_map_len": 64,
    "max_ext_len": 0,
}

MetaValue = Union[int, float, str, bool, list[int]]
"""Types allowed as values of ``Header.meta``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Header:
    """A decoded, validated frame header (see the module docstring for fields)."""

    kind: str
    run: str
    schema: str
    round: int
    fragment: int
    view: str
    span: int
    sender: str
    codec: str
    numel: int
    body_len: int
    crc32: int
    meta: Mapping[str, MetaValue]


_FIELDS: Final[tuple[str, ...]] = tuple(f.name for f in dataclasses.fields(Header))
_STR_FIELDS: Final[tuple[str, ...]] = ("kind", "run", "schema", "view", "sender", "codec")
_INT_MINIMUM: Final[dict[str, int]] = {"round": 0, "fragment": 0, "span": -1, "numel": 0, "body_len": 0}


def _short(value: object) -> str:
    """repr() for error details, cut short: hostile keys can be kilobytes long."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: object) -> bool:
    return type(value) is int  # rejects bool, which subclasses int


def _meta_problem(meta: object) -> str | None:
    if not isinstance(meta, dict):
        return f"field 'meta' must be a map, got {type(meta).__name__}"
    for key, value in meta.items():
        if type(key) is not str:
            return "field 'meta' has a non-string key"
        if type(value) in (str, bool, float):
            continue
        if _is_int(value):
            if not _I64_MIN <= value <= _U64_MAX:
                return f"meta[{_short(key)}] integer out of range"
            continue
        if type(value) is list:
            if not all(_is_int(v) and _I64_MIN <= v <= _U64_MAX for v in value):
                return f"meta[{_short(key)}] must be a list of 64-bit ints"
            continue
        return f"meta[{_short(key)}] has unsupported type {type(value).__name__}"
    return None


def _header_problem(fields: Mapping[Any, object]) -> str | None:
    """Describe what is wrong with a header map, or return None if it is valid."""
    missing = [name for name in _FIELDS if name not in fields]
    if missing:
        return f"missing field {_short(missing[0])}"
    extra = [key for key in fields if key not in _FIELDS]
    if extra:
        return f"unexpected field {_short(extra[0])}"
    for name in _STR_FIELDS:
        if type(fields[name]) is not str:
            return f"field {name!r} must be str, got {type(fields[name]).__name__}"
    for name in (*_INT_MINIMUM, "crc32"):
        if not _is_int(fields[name]):
            return f"field {name!r} must be int, got {type(fields[name]).__name__}"
    for name, minimum in _INT_MINIMUM.items():
        value = fields[name]
        assert isinstance(value, int)
        if not minimum <= value <= _I64_MAX:
            return f"field {name!r} out of range: {value}"
    crc = fields["crc32"]
    assert isinstance(crc, int)
    if not 0 <= crc <= 0xFFFFFFFF:
        return f"field 'crc32' out of range: {crc}"
    return _meta_problem(fields["meta"])


def pack(
    *,
    kind: str,
    run: str,
    round: int,
    sender: str,
    body: bytes | bytearray | memoryview = b"",
    schema: str = "",
    fragment: int = 0,
    view: str = "",
    span: int = -1,
    codec: str = "",
    numel: int = 0,
    meta: Mapping[str, MetaValue] | None = None,
    max_header: int = DEFAULT_MAX_HEADER,
) -> bytes:
    """Build one frame. ``body_len`` and ``crc32`` are computed from ``body``.

    Raises ``ValueError`` if a field is invalid or the encoded header exceeds
    ``max_header`` bytes (the receiver's default limit), so every frame this
    function returns passes :func:`unpack` with default limits.
    """
    body_view = memoryview(body).cast("B") if not isinstance(body, bytes) else memoryview(body)
    meta_dict = dict(sorted((meta or {}).items()))
    fields: dict[str, object] = {
        "kind": kind,
        "run": run,
        "schema": schema,
        "round": round,
        "fragment": fragment,
        "view": view,
        "span": span,
        "sender": sender,
        "codec": codec,
        "numel": numel,
        "body_len": body_view.nbytes,
        "crc32": zlib.crc32(body_view),
        "meta": meta_dict,
    }
    problem = _header_problem(fields)
    if problem is not None:
        raise ValueError(f"cannot pack frame: {problem}")
    header_bytes = msgpack.packb(fields, use_bin_type=True)
    if len(header_bytes) > max_header:
        raise ValueError(f"cannot pack frame: header is {len(header_bytes)} bytes, limit {max_header}")
    return b"".join((_PREFIX.pack(MAGIC, PROTOCOL_VERSION, len(header_bytes)), header_bytes, body_view))


def unpack(
    data: bytes | bytearray | memoryview,
    *,
    max_body: int,
    max_header: int = DEFAULT_MAX_HEADER,
    expect_run: str | None = None,
    expect_kind: str | None = None,
    expect_schema: str | None = None,
) -> tuple[Header, memoryview]:
    """Validate and split one frame into its :class:`Header` and body.

    The body is a zero-copy view into ``data``. Raises :class:`PayloadRejected`
    for any defect (see the module docstring for the order of checks).
    """
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    total = view.nbytes
    if total < _PREFIX.size:
        raise PayloadRejected(Reason.TRUNCATED, f"{total} bytes, frame prefix needs {_PREFIX.size}")
    magic, version, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise PayloadRejected(Reason.BAD_MAGIC, f"magic {magic!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise PayloadRejected(Reason.BAD_VERSION, f"protocol version {version}, this build speaks {PROTOCOL_VERSION}")
    if header_len > max_header:
        raise PayloadRejected(Reason.OVERSIZED, f"header length {header_len} exceeds limit {max_header}")
    body_start = _PREFIX.size + header_len
    if body_start > total:
        raise PayloadRejected(Reason.TRUNCATED, f"header length {header_len}, only {total - _PREFIX.size} bytes follow")

    try:  # msgpack may raise many exception types on hostile input; map them all.
        fields = msgpack.unpackb(
            view[_PREFIX.size : body_start], raw=False, strict_map_key=True, use_list=True, **_MSGPACK_LIMITS
        )
    except Exception as exc:
        raise PayloadRejected(Reason.BAD_HEADER, f"header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(fields, dict):
        raise PayloadRejected(Reason.BAD_HEADER, f"header must be a map, got {type(fields).__name__}")
    problem = _header_problem(fields)
    if problem is not None:
        raise PayloadRejected(Reason.BAD_HEADER, problem)
    header = Header(**fields)

    if header.body_len > max_body:
        raise PayloadRejected(Reason.OVERSIZED, f"body length {header.body_len} exceeds limit {max_body}")
    present = total - body_start
    if present < header.body_len:
        raise PayloadRejected(Reason.TRUNCATED, f"body length {header.body_len}, only {present} bytes present")
    if present > header.body_len:
        raise PayloadRejected(Reason.WRONG_SIZE, f"{present - header.body_len} trailing bytes after the body")
    body = view[body_start:]
    if zlib.crc32(body) != header.crc32:
        raise PayloadRejected(Reason.BAD_CHECKSUM, "crc32 mismatch")
    if expect_run is not None and header.run != expect_run:
        raise PayloadRejected(Reason.WRONG_RUN, f"frame for run {_short(header.run)}, expected {_short(expect_run)}")
    if expect_kind is not None and header.kind != expect_kind:
        raise PayloadRejected(Reason.WRONG_KIND, f"frame of kind {_short(header.kind)}, expected {_short(expect_kind)}")
    if expect_schema is not None and header.schema != expect_schema:
        raise PayloadRejected(
            Reason.WRONG_SCHEMA, f"frame for schema {_short(header.schema)}, ours is {_short(expect_schema)}"
        )
    return header, body
