"""Value codecs: how a flat fp32 tensor becomes body bytes and back.

A *codec* turns a 1-D, contiguous ``torch.float32`` tensor into bytes for the wire
and decodes such bytes back into a *new* fp32 tensor. Codecs know nothing about
frames, peers or rounds; the frame header records the codec's name and the
element count (``numel``), and the receiver calls::

    codec = get_codec(header.codec)          # local config: ValueError if unknown
    values = codec.decode(body, header.numel)

or, for a name that came off the wire, :func:`decode_body`, which turns an unknown
name into :class:`PayloadRejected` as well.

Three rules every codec obeys:

1. **Sizes are exact and checked first.** ``encoded_size(numel)`` is pure
   arithmetic. ``decode`` compares it to ``len(payload)`` *before* touching the
   data and raises ``PayloadRejected(WRONG_SIZE)`` on any mismatch (including a
   negative ``numel``), so a lying header can never make us allocate.
2. **Decoding copies.** The result never aliases the payload buffer, so the
   caller may reuse or free the receive buffer, and in-place updates of the
   tensor never write into someone else's bytes.
3. **Decoding is deterministic, bit for bit.** Every peer decodes the owner's
   result bytes and must obtain identical tensors, or replicas drift. Byte order
   is explicitly little-endian (``'<f4'``, ``'<f2'``), independent of the host.
   fp32 decoding is a pure byte copy (NaN payloads included). fp16 -> fp32 is
   exact for every non-NaN value; NaNs decode to the single canonical quiet
   NaN ``0x7FC00000`` so that no platform-specific NaN conversion can leak in.

Available codecs (:data:`CODECS`):

* ``fp32`` -- 32 bits per value, lossless.
* ``fp16`` -- 16 bits per value, round-to-nearest-even; relative error at most
  2**-11 for magnitudes in fp16's normal range (about 6.1e-5 .. 65504), absolute
  error at most 2**-25 below it. Finite inputs beyond fp16's range are *clamped*
  to +-65504 so they stay finite (a plain cast would turn them into infinity and
  poison an average). Inputs that already are +-inf or NaN stay +-inf / NaN, so
  downstream non-finite checks still see a diverged peer.
"""

from __future__ import annotations

import abc
import math
import sys
import warnings
from typing import Any, Final

import numpy as np
import torch

from .errors import PayloadRejected, Reason

__all__ = ["Codec", "Fp32Codec", "Fp16Codec", "CODECS", "get_codec", "decode_body"]

FP16_MAX: Final[float] = 65504.0
"""Largest finite float16 value."""

_CANONICAL_NAN: Final[np.float32] = np.frombuffer(b"\x00\x00\xc0\x7f", dtype="<f4")[0]

DEVICE_PATH_ON_CPU: bool = False
"""Treat the CPU as a GPU is treated (tests, where no GPU is): see :func:`whole`."""


def whole(device: torch.device) -> bool:
    """Whether a codec on ``device`` works as on a GPU: an encoder takes the whole tensor in one step and stages its
    codes there, a decoder moves the payload's bytes there and turns them into values there."""
    return device.type != "cpu" or DEVICE_PATH_ON_CPU


class Codec(abc.ABC):
    """A lossless or lossy mapping between fp32 tensors and wire bytes."""

    name: str
    """Wire name, as written into the frame header's ``codec`` field."""
    bits_per_value: float
    """Average wire bits per encoded element."""

    @abc.abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact byte length of the encoding of ``numel`` values (no allocation)."""

    def encode(self, t: torch.Tensor) -> bytes:
        """Encode a 1-D fp32 tensor into a new ``bytes``. Raises ``TypeError``/``ValueError`` on misuse."""
        payload = self.encode_view(t)
        return payload if isinstance(payload, bytes) else payload.tobytes()

    @abc.abstractmethod
    def encode_view(self, t: torch.Tensor) -> bytes | memoryview:
        """:meth:`encode` without copying the payload into a new ``bytes``: a read-only view of the buffer the
        encoder wrote it into (:func:`landed`; from a GPU, the pinned host memory the codes crossed into), kept
        alive by the view alone and never shared with anything else. Copying a payload of 32 MiB or more into a new
        ``bytes`` costs more than encoding it on a GPU: its fresh pages fault in one by one."""

    @abc.abstractmethod
    def decode(self, payload: bytes | bytearray | memoryview, numel: int,
               device: torch.device | None = None) -> torch.Tensor:
        """Decode into a new 1-D fp32 tensor of length ``numel`` on ``device`` (host memory when None: on a GPU
        only the payload's bytes cross to it, and the values are the same bits).

        Raises :class:`PayloadRejected` (``WRONG_SIZE``) if ``payload`` is not
        exactly ``encoded_size(numel)`` bytes long; never raises anything else
        for a well-typed call.
        """

    def __repr__(self) -> str:
        return f"<codec {self.name}: {self.bits_per_value:g} bits/value>"


def payload_buffer(size: int, device: torch.device) -> np.ndarray:
    """A new uint8 host array of ``size`` bytes for an encoder on ``device`` to fill: from a CUDA GPU, pinned memory
    (torch's cache of it), so that the codes cross at the bus's rate into memory that is mapped already, instead of
    through the driver's bounce buffer into fresh pages; plain host memory otherwise."""
    if device.type == "cuda":
        return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
    return np.empty(size, dtype=np.uint8)


DOT_PIECE = 1 << 30
"""Values a dot product takes at a time in `all_finite` (a GPU's `dot` takes at most 2^31 − 1)."""


def all_finite(values: torch.Tensor) -> bool:
    """No NaN or Inf in `values`: one pass, no temporary. The sum of squares is finite when every value is (NaN and
    Inf propagate into it), at the speed of memory: a dot product takes half the time of `aminmax` on a CPU (85M
    values: 49 against 94 ms). Only finite values so large that their squares overflow (above ~1.8e19) make it
    infinite; the extremes then decide."""
    if not values.numel():
        return True
    flat = values.reshape(-1)
    if flat.dtype in (torch.float32, torch.float64) and all(
            math.isfinite(float(torch.dot(piece, piece)))
            for piece in (flat[lo:lo + DOT_PIECE] for lo in range(0, flat.numel(), DOT_PIECE))):
        return True
    low, high = torch.aminmax(flat)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def landed(out: np.ndarray) -> memoryview:
    """A :func:`payload_buffer` an encoder has filled, as its payload: a read-only view, no copy."""
    view: memoryview = memoryview(out.data).toreadonly()
    return view


def host_bytes(t: torch.Tensor) -> bytes | memoryview:
    """The little-endian bytes of the values of a contiguous tensor: in host memory a new ``bytes`` (the tensor may
    be the caller's); from a GPU, one crossing into a :func:`payload_buffer`, :func:`landed`."""
    if t.device.type == "cpu":
        array = t.numpy()
        return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
    out = payload_buffer(t.numel() * t.element_size(), t.device)
    torch.from_numpy(out).copy_(t.reshape(-1).view(torch.uint8))
    return landed(out)


def wire_bytes(view: memoryview, offset: int, count: int, device: torch.device) -> torch.Tensor:
    """``count`` bytes of ``view`` at ``offset`` as a new uint8 tensor on ``device`` (only these bytes cross)."""
    with warnings.catch_warnings():  # the payload is read-only; the tensor is only read, then copied
        warnings.simplefilter("ignore", UserWarning)
        host = torch.frombuffer(view, dtype=torch.uint8, count=count, offset=offset) if count else \
            torch.empty(0, dtype=torch.uint8)
    return host.to(device, copy=True)


def check_vector(t: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless ``t`` is a 1-D float32 tensor (what every stage takes)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"expected a float32 tensor, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"expected a 1-D tensor, got shape {tuple(t.shape)}")


def check_input(t: torch.Tensor) -> torch.Tensor:
    """Validate an encode() argument and return it detached and contiguous, on its device: a codec encodes where
    the tensor is and copies only the encoded bytes to the host."""
    check_vector(t)
    return t.detach().contiguous()


def byte_view(payload: bytes | bytearray | memoryview) -> memoryview:
    """`payload` as a flat memoryview of bytes (no copy)."""
    view = memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def expect_size(codec: Codec, view: memoryview, numel: int) -> None:
    """Reject (`PayloadRejected`, WRONG_SIZE) a payload whose length is not `codec.encoded_size(numel)`."""
    if type(numel) is not int or numel < 0:
        raise PayloadRejected(Reason.WRONG_SIZE, f"{codec.name}: invalid element count {numel!r}")
    expected = codec.encoded_size(numel)
    if view.nbytes != expected:
        raise PayloadRejected(
            Reason.WRONG_SIZE,
            f"{codec.name}: {numel} values need {expected} bytes, got {view.nbytes}",
        )


class FixedWidthCodec(Codec):
    """A codec that spends exactly ``bits_per_value / 8`` bytes per value and no header."""

    def encoded_size(self, numel: int) -> int:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return int(self.bits_per_value) // 8 * numel


class Fp32Codec(FixedWidthCodec):
    """Lossless little-endian IEEE-754 binary32."""

    name = "fp32"
    bits_per_value = 32.0

    def encode_view(self, t: torch.Tensor) -> bytes | memoryview:
        return host_bytes(check_input(t))

    def own_bytes(self, t: torch.Tensor) -> memoryview | None:
        """`encode(t)` as a view of `t`'s own memory (a contiguous 1-D fp32 tensor in host memory, a little-endian
        host; valid only while `t` is unchanged), else None."""
        if sys.byteorder != "little" or t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 1 \
                or not t.is_contiguous():
            return None
        array: Any = t.detach().numpy()  # shares the tensor's storage
        return memoryview(array).cast("B")

    def decode_into(self, payload: bytes | bytearray | memoryview, numel: int, out: torch.Tensor) -> torch.Tensor:
        """`decode(payload, numel)` written into `out` (in host memory: one pass from the payload's bytes)."""
        view = byte_view(payload)
        expect_size(self, view, numel)
        if out.device.type != "cpu" or out.dtype != torch.float32 or not out.is_contiguous():
            return out.copy_(self.decode(view, numel))
        np.copyto(out.numpy(), np.frombuffer(view, dtype="<f4", count=numel))
        return out

    def decode(self, payload: bytes | bytearray | memoryview, numel: int,
               device: torch.device | None = None) -> torch.Tensor:
        view = byte_view(payload)
        expect_size(self, view, numel)
        if device is not None and whole(device):  # the bytes cross and are the values there: no copy on the host
            return wire_bytes(view, 0, 4 * numel, device).view(torch.float32)
        wire = np.frombuffer(view, dtype="<f4", count=numel)
        native = wire.astype(np.float32, copy=True)  # copy: never alias the payload
        return torch.from_numpy(native) if device is None else torch.from_numpy(native).to(device)


class Fp16Codec(FixedWidthCodec):
    """Little-endian IEEE-754 binary16, clamping finite values to +-65504."""

    name = "fp16"
    bits_per_value = 16.0

    def encode_view(self, t: torch.Tensor) -> bytes | memoryview:
        source = check_input(t)
        clamped = source.clamp(-FP16_MAX, FP16_MAX)
        clamped = torch.where(torch.isinf(source), source, clamped)  # keep +-inf visible
        return host_bytes(clamped.to(torch.float16))

    def decode(self, payload: bytes | bytearray | memoryview, numel: int,
               device: torch.device | None = None) -> torch.Tensor:
        view = byte_view(payload)
        expect_size(self, view, numel)
        if device is not None and whole(device):  # the halves cross, and widen there
            wide = wire_bytes(view, 0, 2 * numel, device).view(torch.float16).float()
            return torch.where(torch.isnan(wide), torch.tensor(float(_CANONICAL_NAN), device=device), wide)
        wire = np.frombuffer(view, dtype="<f2", count=numel)
        native = wire.astype(np.float32)  # exact for every non-NaN half; a new array
        nan_mask = np.isnan(native)
        if nan_mask.any():
            native[nan_mask] = _CANONICAL_NAN
        return torch.from_numpy(native)


_REGISTRY: Final[dict[str, Codec]] = {c.name: c for c in (Fp32Codec(), Fp16Codec())}

CODECS: Final[tuple[str, ...]] = tuple(_REGISTRY)
"""Names of all wire codecs, in order of preference for fidelity."""


def get_codec(name: str) -> Codec:
    """Return the codec called ``name`` (for local configuration).

    Raises ``ValueError`` for an unknown name; for a name read from the network
    use :func:`decode_body`, which raises :class:`PayloadRejected` instead.
    """
    codec = _REGISTRY.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ValueError(f"unknown wire codec {name!r}; choose one of: {', '.join(CODECS)}")
    return codec


def decode_body(codec_name: str, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
    """Decode a body whose codec name and size came off the wire.

    Like ``get_codec(codec_name).decode(payload, numel)``, but an unknown codec
    name raises ``PayloadRejected(BAD_DTYPE)`` instead of ``ValueError``.
    """
    codec = _REGISTRY.get(codec_name) if isinstance(codec_name, str) else None
    if codec is None:
        raise PayloadRejected(Reason.BAD_DTYPE, f"unknown wire codec {codec_name!r}")
    return codec.decode(payload, numel)
