"""Bytes on the wire: codecs, sparsifiers, index coding, error feedback, pipelines, the frame.

This is the lowest layer of diloco and imports nothing else from the project: no network, no
model, only bytes and tensors.

- `pipeline.Pipeline("topk:64/4096+s2+ef:0.95")` encodes a flat fp32 pseudo-gradient to bytes
  and decodes it back (`Decoded`: values, and indices when sparse); `pipeline.parse` validates a
  spec string with messages that say what is allowed.
- Stages: value codecs (`codecs.py`: the interface, fp32, fp16; `quant.py`: the quantizer specs,
  made by `floatquant.py`: bf16, fp8, e3m0, and `intquant.py`: q8/q4/q2, s4/s2, on `blockscale.py`'s
  block scaling), sparsifiers (`sparse.py`: chunked top-k, seeded random-k), index codes (`indexcode.py`:
  12-bit packed, Rice-coded gaps), zstd, and error feedback (`ef.py`, state kept by the caller).
- `frame.pack` / `frame.unpack`: the versioned, checksummed msgpack frame every message travels
  in, checked before anything sized from the wire is allocated.

Anything malformed, oversized, corrupted or addressed to another run, kind or schema raises
`PayloadRejected` carrying a `Reason`, and never any other exception. No pickle anywhere.
"""

from __future__ import annotations

from .codecs import CODECS, Codec, decode_body, get_codec
from .ef import ErrorFeedback
from .errors import PayloadRejected, Reason
from .frame import PROTOCOL_VERSION, Header, pack, unpack
from .pipeline import Decoded, Pipeline, parse

__all__ = [
    "CODECS", "Codec", "Decoded", "ErrorFeedback", "Header", "PROTOCOL_VERSION", "PayloadRejected", "Pipeline",
    "Reason", "decode_body", "get_codec", "pack", "parse", "unpack",
]
