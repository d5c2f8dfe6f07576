"""Bytes on the wire: value codecs, the versioned frame, and typed rejection.

This is the lowest layer of diloco and imports nothing else from the project: no
network, no model, only bytes and tensors. A sender encodes a flat fp32 tensor
with a :class:`Codec` (``get_codec("fp16").encode(t)``) and wraps the bytes in a
checksummed, versioned frame with :func:`pack`; a receiver calls :func:`unpack`
with its size limits and expectations, then decodes the body with the codec
named in the :class:`Header` (:func:`decode_body` when that name came off the
wire). Anything malformed, oversized, corrupted or addressed to another run or
kind raises :class:`PayloadRejected` carrying a :class:`Reason` -- and never any
other exception -- with sizes checked before anything is allocated. No pickle
is used anywhere: headers are msgpack maps with strictly checked fields, bodies
are raw little-endian values.
"""

from __future__ import annotations

from .codecs import CODECS, Codec, decode_body, get_codec
from .errors import PayloadRejected, Reason
from .frame import PROTOCOL_VERSION, Header, pack, unpack

__all__ = [
    "CODECS",
    "Codec",
    "Header",
    "PROTOCOL_VERSION",
    "PayloadRejected",
    "Reason",
    "decode_body",
    "get_codec",
    "pack",
    "unpack",
]
