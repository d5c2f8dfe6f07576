"""A span's result off the wire: its header checked, its values decoded and admitted (`diloco.comms.robust`).

The same bytes decode to the same values on every member: a mean, or a bundle of the contributors' payloads that
every member combines itself in the same order. Used for the results of a round (`diloco.comms.reduction`), a
carried value (`diloco.comms.decide`) and a lean round's Δ̄ (`Collective.value_spans`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from diloco.compression import Header, PayloadRejected, Reason
from diloco.compression.pipeline import Decoded

from . import messages as msg
from . import robust
from .reduce import canonical_order
from .rounds import weight_ok

if TYPE_CHECKING:
    from .collective import Collective


def parse_result(c: Collective, header: Header, body: memoryview, members: int | None,
                 out: torch.Tensor | None = None) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(contributor indices, marked indices, the span's aggregate) of a result frame; raises
    PayloadRejected for anything that does not fit a view of `members` (None: not known yet). With `out`, the
    aggregate is decoded into it."""
    idx = header.meta.get("contributors")
    if not isinstance(idx, list) or not idx or not all(isinstance(i, int) and i >= 0 for i in idx):
        raise PayloadRejected(Reason.BAD_HEADER, "result needs a non-empty list of contributor indices")
    if members and (max(idx) >= members or len(set(idx)) != len(idx)):
        raise PayloadRejected(Reason.BAD_HEADER, f"contributor indices {idx} do not fit a view of {members}")
    marked = header.meta.get("marked", [])
    if not isinstance(marked, list) or not all(isinstance(i, int) and 0 <= i < 1024 for i in marked) \
            or len(set(marked)) != len(marked) or (members and any(i >= members for i in marked)):
        raise PayloadRejected(Reason.BAD_HEADER, f"result's marked list {marked!r} is not unique view indices")
    check_codec(c, header)
    kind = header.meta.get("result")
    weights = header.meta.get("weights")
    if weights is not None and (not isinstance(weights, list) or len(weights) != len(idx)
                                or not all(weight_ok(w) for w in weights)):
        raise PayloadRejected(Reason.BAD_HEADER, f"result's weights {weights!r} are not one whole number >= 1 "
                              "per contributor")
    tensor = decode_result(c, kind if isinstance(kind, str) else "", body, header.numel, tuple(idx), weights, out)
    return tuple(idx), tuple(marked), tensor


def decode_result(c: Collective, kind: str, body: memoryview, numel: int, idx: tuple[int, ...],
                  weights: list[int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The span's aggregate from a result body (a bundle's payloads weighed by `weights`, in `idx`'s order),
    written into `out` when given (numel values); identical on every peer for identical bytes."""
    if kind == "mean" and not c.pipeline.sparse:
        values = c.mean_pipeline.decode(body, numel).dense(numel) if out is None \
            else c.mean_pipeline.decode_into(body, numel, out)
    elif kind == "bundle" and c.pipeline.sparse:
        items = msg.unpack_bundle(body, max_items=1 << 15)
        if tuple(i for i, _ in items) != idx:
            raise PayloadRejected(Reason.BAD_HEADER, "bundle contributors differ from the frame's list")
        payloads = [p for _, p in items]
        order = canonical_order(payloads)
        parts = [c.pipeline.decode(payloads[i], numel) for i in order]
        norms = [admit(c, part, "a bundled contribution") for part in parts]
        values = robust.combine(parts, numel, c.cfg.robust,
                                [weights[i] for i in order] if weights else None, norms).values
        if out is not None:
            values = out.copy_(values)
    else:
        raise PayloadRejected(Reason.BAD_DTYPE, f"result kind {kind!r} does not fit pipeline {c.pipeline.name}")
    admit(c, Decoded(None, values), "result")
    return values


def admit(c: Collective, part: Decoded, what: str) -> float:
    """`part`'s L2 norm, when it may be combined; raises `PayloadRejected` naming why not."""
    size, why = robust.assess(part, c.cfg.robust)
    if why:
        reason = Reason.NON_FINITE if "NaN" in why else Reason.TOO_LARGE
        raise PayloadRejected(reason, f"{what} {why}")
    return size


def check_codec(c: Collective, header: Header) -> None:
    if header.codec != c.pipeline.name:
        raise PayloadRejected(Reason.BAD_DTYPE, f"codec {header.codec!r}, this swarm uses {c.pipeline.name!r}")
