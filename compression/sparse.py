"""Chunked sparsification: which entries of a pseudo-gradient get sent.

SparseLoCo (arXiv 2508.15706) does not send the whole pseudo-gradient. The flat
fp32 vector of ``numel`` values is cut into consecutive *chunks* of ``C``
elements (the last chunk may be shorter), and in every chunk only ``k`` entries
are kept -- the ``k`` largest by magnitude (:func:`topk_select`), or ``k``
uniformly random ones chosen from a seed both sides know
(:func:`randk_select`). A :class:`ChunkSpec` names the pair ``(k, C)``::

    chunk 0               chunk 1               ...   last chunk (maybe short)
    [0 ....... C-1]       [C ...... 2C-1]              [(n-1)C ... numel-1]
     keeps k               keeps k                      keeps min(k, its length)

Selections are returned as *global* indices (positions in the flat vector),
``int64``, strictly ascending, with exactly ``spec.counts(numel)[c]`` of them
falling in chunk ``c``. That fixed shape is what makes the index codecs of
:mod:`.indexcode` cheap and safe: the receiver knows from ``(numel, spec)``
alone how many indices each chunk holds, so nothing sized from the wire is
ever allocated, and each index can be coded *locally* to its chunk
(``index - c*C`` needs only ``log2 C`` bits: 12 for ``C = 4096``).

Determinism. Every peer must reproduce a selection bit for bit, so ties are
never left to ``torch.topk`` (whose choice among equal values is unspecified):

* :func:`topk_select` ranks entries by ``|value|`` using the IEEE-754 bit
  pattern with the sign bit cleared, read as an ``int32``. For finite values
  and infinities that is exactly the order of ``|value|``; ``-0.0`` ties with
  ``0.0``; a NaN (any payload) ranks *above* infinity, so a diverged entry is
  always sent rather than silently dropped. Among equal keys the **lower
  index wins**.
* :func:`randk_select` gives every element an independent random 31-bit key
  drawn from a ``torch.Generator`` seeded with ``seed`` (torch's CPU Mersenne
  Twister: the same seed yields the same stream on every machine and thread
  count for a given torch release), then keeps the ``k`` largest keys per
  chunk with the same lower-index-wins rule. Sender and receiver call it with
  the same seed, so these indices never travel. A tie at a chunk's cut-off
  has probability about ``C / 2**31`` (5e-6 for 4096 elements), so the rule's
  bias is negligible and the choice is uniform for all practical purposes.

Everything is vectorised: full chunks are a zero-copy ``(n_chunks, C)`` view,
the short last chunk is handled as a one-row view, and the per-chunk cut-off
is found with one ``topk`` over integer keys, a comparison and a ``nonzero``
(whose row-major order *is* ascending global order, so no sort is needed).
On 16M elements with ``C = 4096, k = 64`` :func:`topk_select` takes about
0.1-0.2 s on two CPU cores (about 0.25 s when every chunk is one big tie, e.g.
an all-zero tensor) and :func:`randk_select` about 0.25 s, most of it drawing
the 16M random keys.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import torch

from .codecs import check_vector
from .errors import PayloadRejected, Reason

__all__ = ["ChunkSpec", "MAX_CHUNK", "topk_select", "randk_select", "gather", "scatter_dense"]

MAX_CHUNK: Final[int] = 65536
"""Largest supported chunk length (local indices fit in 16 bits)."""

_KEY_MAX: Final[int] = 2**31 - 1
"""randk keys are drawn uniformly from ``[0, _KEY_MAX)``."""


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """Keep ``k`` entries in every chunk of ``chunk`` consecutive elements.

    Requires ``1 <= k <= chunk <= 65536`` (``ValueError`` otherwise; ``bool`` is
    not accepted as an ``int``). A spec is local configuration; for a spec read
    off the wire use :meth:`from_wire`, which raises :class:`PayloadRejected`.
    """

    k: int = 64
    chunk: int = 4096

    def __post_init__(self) -> None:
        for name in ("k", "chunk"):
            value = getattr(self, name)
            if type(value) is not int:
                raise TypeError(f"ChunkSpec.{name} must be an int, got {type(value).__name__}")
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise ValueError(f"ChunkSpec.chunk must be in 1..{MAX_CHUNK}, got {self.chunk}; "
                             f"pick a chunk length such as 4096")
        if not 1 <= self.k <= self.chunk:
            raise ValueError(f"ChunkSpec.k must be in 1..chunk={self.chunk}, got {self.k}; "
                             f"keep at least one and at most all entries of a chunk")

    @classmethod
    def from_wire(cls, k: object, chunk: object) -> ChunkSpec:
        """Build a spec from untrusted header fields: ``PayloadRejected(BAD_HEADER)`` if invalid."""
        if type(k) is not int or type(chunk) is not int:
            raise PayloadRejected(Reason.BAD_HEADER, "chunk spec fields must be integers")
        try:
            return cls(k=k, chunk=chunk)
        except ValueError as err:
            raise PayloadRejected(Reason.BAD_HEADER, str(err)) from None

    def n_chunks(self, numel: int) -> int:
        """Number of chunks covering ``numel`` elements (the last may be short)."""
        _check_numel(numel)
        return -(-numel // self.chunk)

    def kept(self, numel: int) -> int:
        """Total number of kept entries for ``numel`` elements (pure arithmetic)."""
        _check_numel(numel)
        full, rem = divmod(numel, self.chunk)
        return full * self.k + min(self.k, rem)

    def counts(self, numel: int) -> torch.Tensor:
        """Kept entries per chunk, an ``int64`` tensor of length :meth:`n_chunks`."""
        n = self.n_chunks(numel)
        out = torch.full((n,), self.k, dtype=torch.int64)
        rem = numel % self.chunk
        if rem:
            out[-1] = min(self.k, rem)
        return out


def _check_numel(numel: int) -> None:
    if type(numel) is not int:
        raise TypeError(f"numel must be an int, got {type(numel).__name__}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")


def _check_spec(spec: ChunkSpec) -> None:
    if not isinstance(spec, ChunkSpec):
        raise TypeError(f"expected a ChunkSpec, got {type(spec).__name__}")


def _row_top_indices(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Flat row-major positions of the ``k`` largest keys of every row of the 2-D
    integer ``keys`` (so ascending), ties at the cut-off won by lower columns."""
    rows, width = keys.shape
    if k >= width:
        return torch.arange(rows * width, device=keys.device)
    # The k-th largest key of each row; the multiset of top-k values is unique, so
    # this threshold is deterministic whatever order topk returns them in.
    threshold = keys.topk(k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    mask = keys >= threshold
    picked = mask.view(-1).nonzero().squeeze(1)
    if picked.numel() == rows * k:  # every row has >= k, so none has more: no ties
        return picked
    # Rows holding more than k keys >= threshold tie at the cut-off; picked is sorted,
    # so per-row counts come from a binary search of the row boundaries.
    bounds = torch.searchsorted(picked, torch.arange(rows + 1, device=keys.device) * width)
    tied = (bounds.diff() > k).nonzero().squeeze(1)
    sub, cut = keys[tied], threshold[tied]
    above = sub > cut
    equal = sub == cut
    small = torch.int16 if width < 2**15 else torch.int32  # ranks within a row fit
    need = (k - above.sum(dim=1, keepdim=True)).to(small)  # how many equal keys still fit
    mask[tied] = above | (equal & (equal.cumsum(dim=1, dtype=small) <= need))
    return mask.view(-1).nonzero().squeeze(1)


def _select_by_key(keys: torch.Tensor, spec: ChunkSpec) -> torch.Tensor:
    """Per-chunk top-k of a 1-D integer key tensor, as ascending global int64 indices."""
    numel = keys.numel()
    n_full, rem = divmod(numel, spec.chunk)
    parts = []
    if n_full:
        parts.append(_row_top_indices(keys[: n_full * spec.chunk].view(n_full, spec.chunk), spec.k))
    if rem:
        tail = _row_top_indices(keys[n_full * spec.chunk :].view(1, rem), min(spec.k, rem))
        parts.append(tail + n_full * spec.chunk)
    if not parts:
        return torch.empty(0, dtype=torch.int64, device=keys.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def topk_select(t: torch.Tensor, spec: ChunkSpec) -> torch.Tensor:
    """Global indices of the ``spec.k`` largest-``|value|`` entries of every chunk.

    ``t`` must be a 1-D ``float32`` tensor (any device; non-contiguous is fine).
    Returns ``spec.kept(t.numel())`` strictly ascending ``int64`` indices on
    ``t``'s device. Ties go to the lower index; NaN ranks above infinity.
    """
    check_vector(t)
    _check_spec(spec)
    keys = t.detach().contiguous().view(torch.int32) & 0x7FFFFFFF  # |value| as an ordered int
    return _select_by_key(keys, spec)


def randk_select(numel: int, spec: ChunkSpec, seed: int) -> torch.Tensor:
    """``spec.k`` distinct uniformly random indices per chunk, reproducible from ``seed``.

    Draws one key per element from ``torch.Generator().manual_seed(seed)`` and
    keeps each chunk's largest keys. Returns ``spec.kept(numel)`` strictly
    ascending ``int64`` CPU indices; equal ``(numel, spec, seed)`` give equal
    results on every machine running the same torch release.
    """
    _check_numel(numel)
    _check_spec(spec)
    if type(seed) is not int:
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    keys = torch.randint(0, _KEY_MAX, (numel,), generator=generator, dtype=torch.int32)
    return _select_by_key(keys, spec)


def gather(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The values of the 1-D ``t`` at ``indices`` (a new tensor)."""
    if t.dim() != 1 or indices.dim() != 1:
        raise ValueError("gather expects 1-D tensors")
    if indices.dtype != torch.int64:
        raise TypeError(f"indices must be int64, got {indices.dtype}")
    return t.index_select(0, indices.to(t.device))


def scatter_dense(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """A new dense tensor of length ``numel``: zeros except ``values`` at ``indices``.

    ``indices`` must be distinct (as every selection and decoded index set is);
    with duplicates the surviving value would be unspecified.
    """
    _check_numel(numel)
    if values.dim() != 1 or indices.dim() != 1 or values.numel() != indices.numel():
        raise ValueError(f"values and indices must be 1-D of equal length, got shapes "
                         f"{tuple(values.shape)} and {tuple(indices.shape)}")
    if indices.dtype != torch.int64:
        raise TypeError(f"indices must be int64, got {indices.dtype}")
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    if indices.numel():
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= numel:
            raise ValueError(f"indices must lie in [0, {numel}), got range [{low}, {high}]")
        out[indices.to(values.device)] = values
    return out
