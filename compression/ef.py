"""Error feedback with decay (SparseLoCo, arXiv 2508.15706; DeMo's "momentum subtraction").

A peer never sends its pseudo-gradient Δ directly. It keeps a residual e of everything it has not
yet delivered and, each round:

    acc = β·e + Δ          (accumulate)
    send C(acc)            (compress: the round protocol encodes acc span by span)
    e   = acc − sent       (commit: `sent` is what the round actually *included*)

"Included" is exact at span granularity: the result of every span names the peers it averaged.
A span whose owner died or that missed the deadline counts as not sent, so its whole
contribution stays in e: nothing is lost, nothing is counted twice. If a round commits for
nobody, the caller does not commit (its local progress carries Δ into the next round anyway).
With β = 1 the invariant Σ sent + e = Σ Δ holds exactly (up to float rounding).
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    def __init__(self, beta: float, numel: int) -> None:
        if not 0 < beta <= 1:
            raise ValueError(f"error-feedback decay must be in (0, 1], got {beta}")
        self.beta = beta
        self.residual = torch.zeros(numel, dtype=torch.float32)

    def accumulate(self, delta: torch.Tensor) -> torch.Tensor:
        """acc = β·e + Δ (a new tensor; the residual is unchanged until `commit`)."""
        if delta.numel() != self.residual.numel():
            raise ValueError(f"pseudo-gradient has {delta.numel()} values, the residual {self.residual.numel()}")
        self.residual = self.residual.to(delta.device)  # the residual lives where Δ does
        return self.residual * self.beta + delta

    def commit(self, acc: torch.Tensor, sent: torch.Tensor) -> None:
        """The round is over: keep what was not delivered."""
        self.residual = acc - sent.to(acc.device)

    def reset(self) -> None:
        self.residual.zero_()
