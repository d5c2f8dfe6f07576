"""What a worker keeps per fragment of the model between its rounds (torchft's `_StreamingDiLoCoFragment` plays this
part): the error-feedback residual, the Δ of a failed round carried to the next one, the inner step its local copy
trained away from θ, and a lone worker's buffer for Δ. The round engine (`diloco.engine`) decides when each moves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from diloco.compression.ef import ErrorFeedback

from .fragments import Fragment


@dataclass
class Kept:
    """One fragment's keeping: its error-feedback residual (compression with an ef:BETA stage), and, with a whole
    outer step overlapped, the Δ of its last round that failed, delivered with its next one."""

    fragment: Fragment
    ef: ErrorFeedback | None
    carry: torch.Tensor | None = None
    since: int = 0
    """The inner step from which the local copy of this fragment has trained away from θ: the slot of its last
    committed round, or where the worker last took θ whole (joined, downloaded, rolled back). Its next Δ covers
    the steps after it, failed rounds' included: that Δ's weight in a round by time."""
    buffer: torch.Tensor | None = None
    """A lone worker's Δ of this fragment, formed in the same memory every slot (`PerFragment.buffer`)."""


class PerFragment:
    """Every fragment's `Kept`, indexed by fragment."""

    def __init__(self, fragments: Sequence[Fragment], ef: float | None) -> None:
        """`ef`: the error-feedback stage's β (None: no error feedback)."""
        self.kept = [Kept(f, ErrorFeedback(ef, f.numel) if ef is not None else None) for f in fragments]

    def __getitem__(self, frag: Fragment) -> Kept:
        return self.kept[frag.index]

    def __iter__(self) -> Iterator[Kept]:
        return iter(self.kept)

    def residuals(self) -> list[torch.Tensor]:
        """The error-feedback residual of every fragment that has one."""
        return [k.ef.residual for k in self.kept if k.ef is not None]

    def forget_carry(self) -> None:
        """We took another peer's state: a failed round's Δ carried for the next one refers to ours, not to it."""
        for k in self.kept:
            k.carry = None

    def restart(self, steps: int) -> None:
        """We start from θ whole at inner step `steps` (joined, downloaded, rolled back): every fragment's Δ covers
        the steps from here."""
        for k in self.kept:
            k.since = steps

    def covered(self, frag: Fragment, steps: int) -> int:
        """Inner steps the Δ of `frag` formed at inner step `steps` covers (at least one)."""
        return max(1, steps - self[frag].since)

    def buffer(self, frag: Fragment, device: torch.device, pinned: bool) -> torch.Tensor:
        """Where `frag`'s Δ is formed: the same buffer every slot (a fresh one as large costs more in page faults than
        forming Δ), allocated at the first."""
        kept = self[frag]
        if kept.buffer is None:
            kept.buffer = torch.empty(frag.numel, dtype=torch.float32, device=device, pin_memory=pinned)
        return kept.buffer
