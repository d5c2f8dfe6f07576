"""A small byte-level GPT: the model every DiLoCo worker trains.

What
    A nanoGPT-style decoder-only transformer over raw bytes (vocabulary 256, so
    no tokenizer and nothing to download). With the defaults it has about
    1.85M parameters: big enough to learn real structure from source code,
    small enough that one inner AdamW step (batch 16 x 128 bytes) takes about a
    third of a second on a single CPU thread.

Why it looks like this
    * Pre-LayerNorm blocks, GELU MLP (4x), final LayerNorm and a weight-tied
      language-model head, as in nanoGPT: a well-trodden recipe that trains
      stably at small scale with AdamW and no warm-up tricks.
    * Attention uses ``F.scaled_dot_product_attention(is_causal=True)``, which
      picks the fastest fused kernel available on the device.
    * The blocks live in ``self.blocks`` (an ``nn.ModuleList``) so parameter
      names read ``blocks.0.…``, ``blocks.1.…``: the outer optimizer and the
      streaming/compression code can group parameters per block by name.
    * :func:`build_model` is deterministic: every worker builds the same initial
      weights from the same seed, without touching the global RNG (so data
      order and dropout elsewhere are unaffected by model construction).

How to run
    >>> import torch
    >>> from diloco.job.model import GPTConfig, build_model
    >>> model = build_model(GPTConfig(), seed=0)
    >>> idx = torch.randint(0, 256, (2, 128))
    >>> logits, loss = model(idx, targets=idx)
    >>> logits.shape
    torch.Size([2, 128, 256])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "build_model"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model. The defaults give 1,853,568 parameters."""

    vocab_size: int = 256
    """Number of distinct tokens; 256 for raw bytes."""
    context: int = 128
    """Longest sequence the model accepts (size of the position embedding)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 192
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches (0 = off)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"GPTConfig.{name} must be a positive int, got {value!r}; "
                    f"pass e.g. {name}={getattr(GPTConfig, name)}"
                )
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head "
                f"({self.n_head}); pick d_model as a multiple of n_head, e.g. "
                f"d_model={self.n_head * max(1, self.d_model // self.n_head)}"
            )
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(
                f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}; use 0.0 to disable"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)  # residual projection
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        out: torch.Tensor = self.resid_drop(self.proj(y))
        return out


class MLP(nn.Module):
    """Position-wise feed-forward: d_model -> 4*d_model -> GELU -> d_model."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)  # residual projection
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.proj(F.gelu(self.fc(x))))
        return out


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Byte-level GPT. ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of shape (B, T, vocab) and mean cross-entropy (None without targets)."""
        b, t = idx.shape
        if t > self.config.context:
            raise ValueError(
                f"sequence length {t} exceeds the model context {self.config.context}; "
                "crop the input or build the model with a larger GPTConfig.context"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self) -> int:
        """Number of distinct parameters (the tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """nanoGPT init from ``generator``: N(0, 0.02) weights, zero biases, unit
        LayerNorm gains, and N(0, 0.02/sqrt(2*n_layer)) for residual projections
        (so the residual stream's variance does not grow with depth)."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.lm_head:
                    continue  # tied to tok_emb, initialised there
                std = resid_std if name.endswith(".proj") else 0.02
                module.weight.normal_(0.0, std, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 0.02, generator=generator)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """Build a :class:`GPT` with deterministic weights.

    Same ``(cfg, seed)`` gives bit-identical parameters on every call and every
    worker. The global RNG state is left exactly as it was: PyTorch's default
    module init runs inside ``fork_rng`` and is then overwritten from a local
    ``torch.Generator``.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
    generator = torch.Generator().manual_seed(seed)
    model.reset_parameters(generator)
    return model
