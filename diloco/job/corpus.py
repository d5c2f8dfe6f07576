"""The bundled training corpus: the Python standard library's own source code.

What
    Every ``*.py`` file under this interpreter's stdlib directory (excluding
    ``site-packages``, ``test``/``tests``, ``idlelib``, ``lib2to3`` and the
    machine-specific ``_sysconfigdata*.py``), read as
    raw bytes in sorted relative-path order, capped at ``max_bytes`` (8 MiB by
    default), and split by file into a train and a held-out set. Plus the two
    ways of reading it: :class:`BatchSampler` (random windows, one independent
    stream per worker) and :func:`heldout_batches` / :func:`evaluate` (a fixed
    tiling of the held-out split for comparable eval losses).

Why
    DiLoCo needs a real, non-trivial text to show that infrequent
    synchronisation still learns, but this toolkit must run offline. The stdlib
    is on every machine that runs Python, is megabytes of varied, structured
    text, and is byte-identical across machines with the same Python version
    (``Corpus.digest`` lets peers check they agree before training together).
    Splitting by file (hash of the relative path) keeps held-out files unseen,
    and is stable when the cap or the directory contents change.

How to run
    >>> from diloco.job.corpus import Corpus, CorpusConfig, BatchSampler, heldout_batches, evaluate
    >>> corpus = Corpus.load(CorpusConfig(max_bytes=1 << 20))
    >>> sampler = BatchSampler(corpus.train, batch_size=16, context=128,
    ...                        seed=0, shard=0, num_shards=4)
    >>> x, y = sampler.next()            # int64, shape (16, 128); y is x shifted by one
    >>> batches = heldout_batches(corpus.heldout, batch_size=16, context=128, max_batches=8)
    >>> evaluate(model, batches)         # mean held-out cross-entropy (nats/byte)
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

__all__ = ["CorpusConfig", "Corpus", "BatchSampler", "heldout_batches", "evaluate"]

EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3"})
"""Directory names skipped anywhere in the tree: installed packages and bulky test suites."""
SEPARATOR = b"\n\n"
"""Bytes placed between consecutive files of a split."""


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """Which bytes make up the corpus and how they are split."""

    max_bytes: int = 8 * 1024 * 1024
    """Cap on train+held-out bytes (separators included), taken in sorted file order."""
    heldout_percent: int = 5
    """Percent of files (by hash of relative path) that go to the held-out split."""
    root: str | None = None
    """Directory to read instead of the stdlib (tests point this at a temp dir)."""
    context: int = 128
    """Model context; each split must hold at least ``context + 1`` bytes."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            raise ValueError(
                f"CorpusConfig.max_bytes must be a positive int, got {self.max_bytes!r}; "
                "e.g. max_bytes=8 * 1024 * 1024"
            )
        if not isinstance(self.heldout_percent, int) or not 1 <= self.heldout_percent <= 99:
            raise ValueError(
                f"CorpusConfig.heldout_percent must be an int in [1, 99], got "
                f"{self.heldout_percent!r}; the default 5 keeps ~5% of files for evaluation"
            )
        if not isinstance(self.context, int) or self.context <= 0:
            raise ValueError(
                f"CorpusConfig.context must be a positive int, got {self.context!r}; "
                "pass the model's GPTConfig.context"
            )


def _is_heldout(rel_path: str, heldout_percent: int) -> bool:
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest, 16) % 100 < heldout_percent


def _list_files(root: Path) -> list[tuple[str, Path]]:
    """``(relative posix path, path)`` of every kept ``*.py`` file, sorted by relative path.

    Excluded directories are pruned during the walk (site-packages alone can hold
    hundreds of MB). ``_sysconfigdata*.py`` is skipped: it is generated per build
    and embeds machine-specific paths, which would make digests differ between
    machines running the same Python version."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            path = Path(dirpath) / name
            if path.is_file():
                files.append((path.relative_to(root).as_posix(), path))
    files.sort(key=lambda item: item[0])
    return files


class Corpus:
    """Train and held-out byte tensors (``torch.uint8``), built by :meth:`load`."""

    def __init__(
        self,
        train: torch.Tensor,
        heldout: torch.Tensor,
        *,
        train_files: tuple[str, ...] = (),
        heldout_files: tuple[str, ...] = (),
    ) -> None:
        self.train = train
        self.heldout = heldout
        self.train_files = train_files
        """Relative paths of the files in ``train``, in order."""
        self.heldout_files = heldout_files
        """Relative paths of the files in ``heldout``, in order."""
        h = hashlib.sha256()
        for split in (train, heldout):
            raw = split.numpy().tobytes()
            h.update(len(raw).to_bytes(8, "little"))
            h.update(raw)
        self.digest = h.hexdigest()[:16]
        """Short sha256 of both splits: equal digests mean identical data."""

    @classmethod
    def load(cls, cfg: CorpusConfig | None = None) -> Corpus:
        """Read, cap and split the corpus described by ``cfg`` (defaults: the stdlib)."""
        cfg = cfg or CorpusConfig()
        root = Path(cfg.root if cfg.root is not None else sysconfig.get_paths()["stdlib"])
        files = _list_files(root) if root.is_dir() else []
        if not files:
            raise ValueError(
                f"no *.py files found under {str(root)!r} (directories named "
                f"{sorted(EXCLUDED_DIRS)} are skipped); point CorpusConfig.root at a "
                "directory containing Python source files"
            )
        parts: dict[bool, list[bytes]] = {False: [], True: []}
        names: dict[bool, list[str]] = {False: [], True: []}
        budget = cfg.max_bytes
        for rel, path in files:
            # Charge each file its separator too, so len(train) + len(heldout) <= max_bytes.
            data = path.read_bytes()[: max(0, budget - len(SEPARATOR))]
            if not data:
                if budget <= len(SEPARATOR):
                    break
                continue  # empty file (e.g. an __init__.py): nothing to add
            heldout = _is_heldout(rel, cfg.heldout_percent)
            parts[heldout].append(data)
            names[heldout].append(rel)
            budget -= len(data) + len(SEPARATOR)
        splits = {}
        for heldout, label in ((False, "train"), (True, "held-out")):
            blob = SEPARATOR.join(parts[heldout])
            if len(blob) < cfg.context + 1:
                raise ValueError(
                    f"the {label} split has {len(blob)} bytes from {len(names[heldout])} files "
                    f"under {str(root)!r}, fewer than context + 1 = {cfg.context + 1}; raise "
                    "CorpusConfig.max_bytes, adjust heldout_percent, or add more files"
                )
            splits[heldout] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return cls(
            splits[False],
            splits[True],
            train_files=tuple(names[False]),
            heldout_files=tuple(names[True]),
        )

    def __repr__(self) -> str:
        return (
            f"Corpus(train={self.train.numel()} bytes/{len(self.train_files)} files, "
            f"heldout={self.heldout.numel()} bytes/{len(self.heldout_files)} files, "
            f"digest={self.digest})"
        )


def _check_windows(data: torch.Tensor, batch_size: int, context: int) -> None:
    if batch_size <= 0 or context <= 0:
        raise ValueError(
            f"batch_size and context must be positive, got {batch_size} and {context}"
        )
    if data.dim() != 1 or data.numel() < context + 1:
        raise ValueError(
            f"data must be a 1-D tensor of at least context + 1 = {context + 1} tokens, "
            f"got shape {tuple(data.shape)}; use a shorter context or a larger split"
        )


def _stream_seed(seed: int, shard: int) -> int:
    """A 63-bit generator seed unique to ``(seed, shard)`` (hashed, so no arithmetic collisions)."""
    digest = hashlib.sha256(f"diloco-batches:{seed}:{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class BatchSampler:
    """Random ``(x, y)`` training windows, one deterministic stream per worker.

    Worker ``shard`` of ``num_shards`` draws offsets from a generator seeded by
    ``(seed, shard)``: every worker samples the whole split (the i.i.d. DiLoCo
    setting), two workers never share a stream, and a restarted worker with the
    same ``(seed, shard)`` replays the same batches.
    """

    def __init__(
        self,
        data: torch.Tensor,
        *,
        batch_size: int,
        context: int,
        seed: int,
        shard: int = 0,
        num_shards: int = 1,
    ) -> None:
        _check_windows(data, batch_size, context)
        if num_shards <= 0 or not 0 <= shard < num_shards:
            raise ValueError(
                f"shard must satisfy 0 <= shard < num_shards, got shard={shard}, "
                f"num_shards={num_shards}; give each worker a distinct index below num_shards"
            )
        self.data = data
        self.batch_size = batch_size
        self.context = context
        self.shard = shard
        self.num_shards = num_shards
        self.generator = torch.Generator().manual_seed(_stream_seed(seed, shard))
        self._span = torch.arange(context + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: ``x`` and ``y = x shifted by one``, int64 of shape (batch_size, context)."""
        high = self.data.numel() - self.context  # exclusive: the window needs context + 1 bytes
        offsets = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        window = self.data[offsets[:, None] + self._span].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def skip(self, batches: int) -> None:
        """Move past `batches` batches without building them: `next` then returns what it would after as many
        calls of its own (the same draws from the generator)."""
        high = self.data.numel() - self.context
        for _ in range(batches):
            torch.randint(0, high, (self.batch_size,), generator=self.generator)

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Generator state, to resume the exact stream after a checkpoint."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


def heldout_batches(
    data: torch.Tensor, *, batch_size: int, context: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Tile ``data`` from the start into non-overlapping windows (stride ``context``),
    grouped into at most ``max_batches`` batches; the last batch may be smaller.
    Always the same batches for the same inputs, so eval losses are comparable."""
    _check_windows(data, batch_size, context)
    if max_batches <= 0:
        raise ValueError(f"max_batches must be positive, got {max_batches}")
    n_windows = min((data.numel() - 1) // context, batch_size * max_batches)
    starts = torch.arange(n_windows) * context
    window = data[starts[:, None] + torch.arange(context + 1)].long()
    x, y = window[:, :-1], window[:, 1:]
    return [
        (x[i : i + batch_size].contiguous(), y[i : i + batch_size].contiguous())
        for i in range(0, n_windows, batch_size)
    ]


def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Token-weighted mean loss of ``model`` over ``batches``, without gradients.
    The model is put in eval mode and then returned to the mode it was in."""
    if not batches:
        raise ValueError("evaluate() needs at least one batch; check heldout_batches' arguments")
    was_training = model.training
    device = next(model.parameters()).device
    total, count = 0.0, 0
    model.eval()
    try:
        with torch.no_grad():
            for x, y in batches:
                _, loss = model(x.to(device), targets=y.to(device))
                total += float(loss) * y.numel()
                count += y.numel()
    finally:
        model.train(was_training)
    return total / count
