"""Unit tests for the byte-level GPT (diloco.job.model) and the stdlib corpus (diloco.job.corpus)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from diloco.job.corpus import BatchSampler, Corpus, CorpusConfig, evaluate, heldout_batches
from diloco.job.model import GPTConfig, build_model

TINY = GPTConfig(context=32, n_layer=2, n_head=2, d_model=32)


# ---------------------------------------------------------------- model


@pytest.mark.unit
def test_forward_shapes_and_initial_loss() -> None:
    model = build_model(TINY, seed=0)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (3, TINY.context), generator=gen)
    targets = torch.randint(0, 256, (3, TINY.context), generator=gen)
    logits, loss = model(idx, targets=targets)
    assert logits.shape == (3, TINY.context, 256)
    assert loss is not None and abs(loss.item() - math.log(256)) < 0.3
    logits2, loss2 = model(idx[:, :5])
    assert logits2.shape == (3, 5, 256) and loss2 is None


@pytest.mark.unit
def test_default_config_size_and_block_names() -> None:
    model = build_model(GPTConfig(), seed=0)
    assert 1_500_000 <= model.num_params() <= 2_500_000
    names = [n for n, _ in model.named_parameters()]
    assert any(n.startswith("blocks.0.") for n in names)
    assert any(n.startswith("blocks.3.") for n in names)
    assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.unit
def test_build_model_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, b, c = build_model(TINY, seed=7), build_model(TINY, seed=7), build_model(TINY, seed=8)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


@pytest.mark.unit
def test_model_is_causal() -> None:
    model = build_model(TINY, seed=0).eval()
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    with torch.no_grad():
        before, _ = model(idx)
        after, _ = model(changed)
    assert torch.allclose(before[:, :10], after[:, :10], atol=1e-6)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.unit
def test_adam_steps_reduce_loss() -> None:
    model = build_model(TINY, seed=0)
    idx = torch.randint(0, 256, (4, TINY.context + 1), generator=torch.Generator().manual_seed(3))
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        _, loss = model(x, targets=y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.unit
def test_gpt_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(d_model=190, n_head=4)
    with pytest.raises(ValueError, match="positive"):
        GPTConfig(n_layer=0)


# ---------------------------------------------------------------- corpus


def _make_tree(root: Path, n: int = 12, size: int = 300) -> None:
    for i in range(n):
        sub = root / ("pkg" if i % 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod_{i:02d}.py").write_bytes(bytes([97 + i]) * size)
    (root / "tests").mkdir()
    (root / "tests" / "test_skipped.py").write_bytes(b"Z" * 1000)
    (root / "notes.txt").write_bytes(b"Y" * 1000)


@pytest.mark.unit
def test_corpus_split_is_deterministic_and_disjoint(tmp_path: Path) -> None:
    _make_tree(tmp_path)
    cfg = CorpusConfig(root=str(tmp_path), heldout_percent=50, context=16)
    a, b = Corpus.load(cfg), Corpus.load(cfg)
    assert a.digest == b.digest and len(a.digest) == 16
    assert torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)
    assert a.train.dtype == torch.uint8
    assert a.train_files and a.heldout_files
    assert not set(a.train_files) & set(a.heldout_files)
    assert len(a.train_files) + len(a.heldout_files) == 12  # tests/ and *.txt skipped
    assert b"Z" not in a.train.numpy().tobytes() + a.heldout.numpy().tobytes()
    # each file's letter lands in exactly one split
    for rel in a.heldout_files:
        letter = 97 + int(rel[-5:-3])
        assert (a.heldout == letter).any() and not (a.train == letter).any()


@pytest.mark.unit
def test_corpus_byte_cap(tmp_path: Path) -> None:
    _make_tree(tmp_path)
    cfg = CorpusConfig(root=str(tmp_path), heldout_percent=50, context=16, max_bytes=2000)
    corpus = Corpus.load(cfg)
    assert corpus.train.numel() + corpus.heldout.numel() <= 2000
    full = Corpus.load(CorpusConfig(root=str(tmp_path), heldout_percent=50, context=16))
    assert full.train.numel() + full.heldout.numel() > 2000


@pytest.mark.unit
def test_corpus_errors_are_helpful(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no \\*.py files found.*CorpusConfig.root"):
        Corpus.load(CorpusConfig(root=str(tmp_path)))
    (tmp_path / "one.py").write_bytes(b"x = 1\n")
    with pytest.raises(ValueError, match="fewer than context"):
        Corpus.load(CorpusConfig(root=str(tmp_path), context=128))
    with pytest.raises(ValueError, match="heldout_percent"):
        CorpusConfig(heldout_percent=0)


@pytest.mark.unit
def test_real_stdlib_corpus_loads() -> None:
    # 1 MiB: the first files in sorted order are large, so 512 KiB may hold no held-out file.
    corpus = Corpus.load(CorpusConfig(max_bytes=1 << 20))
    assert corpus.train.numel() > 0 and corpus.heldout.numel() > 0
    assert corpus.train.numel() + corpus.heldout.numel() <= 1 << 20
    assert not any(
        part in {"test", "tests", "site-packages", "idlelib", "lib2to3"}
        for rel in corpus.train_files + corpus.heldout_files
        for part in rel.split("/")[:-1]
    )


# ---------------------------------------------------------------- batching


@pytest.mark.unit
def test_sampler_streams() -> None:
    data = torch.arange(1000, dtype=torch.int64) % 256
    data = data.to(torch.uint8)

    def draws(seed: int, shard: int) -> list[torch.Tensor]:
        s = BatchSampler(data, batch_size=4, context=8, seed=seed, shard=shard, num_shards=2)
        return [s.next()[0] for _ in range(3)]

    same = zip(draws(0, 0), draws(0, 0))
    assert all(torch.equal(a, b) for a, b in same)
    assert not all(torch.equal(a, b) for a, b in zip(draws(0, 0), draws(0, 1)))
    assert not all(torch.equal(a, b) for a, b in zip(draws(0, 0), draws(1, 0)))
    with pytest.raises(ValueError, match="shard"):
        BatchSampler(data, batch_size=4, context=8, seed=0, shard=2, num_shards=2)


@pytest.mark.unit
def test_sampler_targets_are_shifted_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (500,), dtype=torch.uint8, generator=gen)
    x, y = BatchSampler(data, batch_size=5, context=16, seed=3).next()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (5, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is a real (context + 1)-byte window of the data
    windows = data.unfold(0, 17, 1).long()
    rows = torch.cat([x, y[:, -1:]], dim=1)
    assert (windows[None] == rows[:, None]).all(-1).any(-1).all()


@pytest.mark.unit
def test_heldout_batches_tile_and_evaluate_restores_mode() -> None:
    data = torch.arange(200, dtype=torch.int64).to(torch.uint8)
    batches = heldout_batches(data, batch_size=4, context=10, max_batches=3)
    assert len(batches) == 3 and all(x.shape == (4, 10) for x, _ in batches)
    x0, y0 = batches[0]
    assert x0[0, 0] == 0 and x0[1, 0] == 10 and y0[0, -1] == 10  # stride = context
    assert heldout_batches(data, batch_size=4, context=10, max_batches=3)[2][0].equal(batches[2][0])
    model = build_model(TINY, seed=0).train()
    loss = evaluate(model, batches)
    assert model.training and math.isfinite(loss) and abs(loss - math.log(256)) < 0.3
    model.eval()
    evaluate(model, batches)
    assert not model.training


def test_a_job_starts_from_given_weights_and_continues_the_lr_schedule(tmp_path):
    from diloco.config import ConfigError
    from diloco.job.model import GPTConfig, build_model
    from diloco.job.train import JobConfig, load_weights, run_job, save_weights

    job = JobConfig(rounds=1, inner_steps=1, d_model=32, n_layer=1, context=32, batch_size=2, eval_batches=1,
                    corpus_bytes=1 << 20, warmup=10, lr=1e-3)
    other = build_model(GPTConfig(context=32, d_model=32, n_layer=1), seed=7)
    save_weights(other, tmp_path / "w.safetensors")
    seen = {}

    def first_step(d):
        seen.setdefault("lr", d.optimizer.param_groups[0]["lr"])
        seen.setdefault("params", [p.detach().clone() for p in d.model.parameters()])

    run_job(JobConfig(**{**job.__dict__, "init_from": str(tmp_path / "w.safetensors"), "first_step": 5}), None,
            on_step=first_step)
    assert seen["lr"] == pytest.approx(1e-3 * 6 / 10)  # step 5 of a 10-step warmup
    # one AdamW step at lr 6e-4 moved each value by about that much from seed 7's model, not from the job's seed 0
    seed0 = build_model(GPTConfig(context=32, d_model=32, n_layer=1), seed=0)
    assert max((a - b).abs().max().item() for a, b in zip(seen["params"], other.parameters())) < 2e-3
    assert max((a - b).abs().max().item() for a, b in zip(seen["params"], seed0.parameters())) > 1e-2
    loaded = build_model(GPTConfig(context=32, d_model=32, n_layer=1), seed=0)
    load_weights(loaded, tmp_path / "w.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), other.parameters()))
    wrong = build_model(GPTConfig(context=32, d_model=64, n_layer=1), seed=0)
    with pytest.raises(ConfigError, match="does not hold this model's weights"):
        load_weights(wrong, tmp_path / "w.safetensors")
    with pytest.raises(ConfigError, match="is not a file"):
        JobConfig(init_from=str(tmp_path / "missing.safetensors"))


def test_skipping_batches_is_drawing_them_without_building_them():
    data = torch.arange(10_000, dtype=torch.uint8)
    drawn = BatchSampler(data, batch_size=4, context=16, seed=3, shard=1, num_shards=8)
    skipped = BatchSampler(data, batch_size=4, context=16, seed=3, shard=1, num_shards=8)
    for _ in range(5):
        drawn.next()
    skipped.skip(5)
    assert all(torch.equal(a, b) for a, b in zip(drawn.next(), skipped.next()))
