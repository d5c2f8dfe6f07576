"""A Hugging Face Trainer as a DiLoCo worker: one added line, `callbacks=[DiLoCoCallback(...)]`.

A tiny GPT-2 or Llama built from a config (nothing is downloaded) learns a synthetic language (each
sequence counts up from a random start, modulo the vocabulary). Runs unchanged:

    python examples/hf_trainer.py                                  # alone: no network
    diloco start --wait-for 2 -- python examples/hf_trainer.py     # the first site of a swarm
    diloco join ADDR -- python examples/hf_trainer.py --arch llama # another site (same --arch everywhere)

Needs the hf extra: pip install "diloco[hf]".
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from diloco.hf import DiLoCoCallback

VOCAB, LENGTH = 64, 32


class Counting(torch.utils.data.Dataset):
    """Sequences start, start+1, … (mod VOCAB): the next token is always predictable."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (size, 1), generator=g)
        self.ids = (starts + torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":  # its input embedding and output head are one tied tensor
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2))
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=LENGTH))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps (Trainer's max_steps)")
    ap.add_argument("--inner-steps", type=int, default=10, help="H")
    ap.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--seed", type=int, default=0, help="data seed")
    args = ap.parse_args()

    callback = DiLoCoCallback(inner_steps=args.inner_steps)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model=build(args.arch),
            args=TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=8,
                                   gradient_accumulation_steps=args.accumulate, learning_rate=3e-3,
                                   lr_scheduler_type="cosine", warmup_steps=5, logging_steps=10, save_strategy="no",
                                   report_to=[], use_cpu=True, seed=args.seed, disable_tqdm=True),
            train_dataset=Counting(4096, args.seed),
            callbacks=[callback],                                          # the one added line
        )
        result = trainer.train()
    d = callback.diloco
    assert d is not None
    print(f"done: round {d.round}, steps {d.steps}, train loss {result.training_loss:.4f}, digest {d.digest}",
          flush=True)


if __name__ == "__main__":
    main()
