"""The bundled job as a torchrun site: the same model, data, inner AdamW and outer step as `diloco start/join`
without a command, trained by K ranks (DDP) that are one worker of the swarm, under the launcher:

    diloco join ADDR --max-restarts 3 -- torchrun --standalone --nproc-per-node 2 -m diloco.job.site --d-model 64 -H 10

The model flags (`--d-model`, `--layers`, `--context`, `--seed`) must be those of the swarm's other workers: every
worker builds the same model from the same seed. `diloco bench chaos --site-ranks K` runs one such site among its
lone workers. Each rank reads its own stream of the site's data shard (the launcher's `--shard`); the launcher
gives the site its swarm, checkpoints and metrics (docs/USAGE.md, "Your own training script").
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..environment import SHARDS
from ..wrapper import DiLoCo
from .corpus import BatchSampler
from .model import GPTConfig, build_model
from .train import ADAMW_BETAS, CLIP_NORM, WEIGHT_DECAY, JobConfig, inner_lr, load_corpus


FLAGS = ("--d-model", "--layers", "--context", "--batch-size", "-H", "--inner-steps", "--rounds", "--lr", "--warmup",
         "--seed")
"""The bundled job's flags this script takes (each with a value); the launcher takes the swarm's."""


def split_flags(flags: Sequence[str]) -> tuple[list[str], list[str]]:
    """The bundled job's command-line `flags` cut in two: this script's (`FLAGS`, each with its value) and the rest
    (the swarm's: timeouts, compression), which go to the launcher before `--`."""
    mine: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(flags):
        flag, name = flags[i], flags[i].split("=", 1)[0]
        into = mine if name in FLAGS else rest
        into.append(flag)
        i += 1
        # a value follows: always for ours; for the rest, unless the next word is a flag (a switch such as --verbose)
        if "=" not in flag and i < len(flags) and (name in FLAGS or not flags[i].startswith("-")):
            into.append(flags[i])
            i += 1
    return mine, rest


def parse(argv: list[str] | None = None) -> JobConfig:
    """The job's settings from the bundled job's flags of the same names (its defaults where left out)."""
    base = JobConfig()
    ap = argparse.ArgumentParser(prog="python -m diloco.job.site", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=base.d_model)
    ap.add_argument("--layers", type=int, default=base.n_layer)
    ap.add_argument("--context", type=int, default=base.context)
    ap.add_argument("--batch-size", type=int, default=base.batch_size, help="each rank's batch")
    ap.add_argument("-H", "--inner-steps", type=int, default=base.inner_steps)
    ap.add_argument("--rounds", type=int, default=base.rounds, help="train until the global round reaches this")
    ap.add_argument("--lr", type=float, default=base.lr)
    ap.add_argument("--warmup", type=int, default=base.warmup)
    ap.add_argument("--seed", type=int, default=base.seed, help="the model's seed (the swarm's) and the data's")
    a = ap.parse_args(argv)
    return JobConfig(d_model=a.d_model, n_layer=a.layers, context=a.context, batch_size=a.batch_size,
                     inner_steps=a.inner_steps, rounds=a.rounds, lr=a.lr, warmup=a.warmup, seed=a.seed)


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    torch.set_num_threads(cfg.threads)
    torch.set_flush_denormal(True)
    distributed = "RANK" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    corpus = load_corpus(cfg)
    model = build_model(GPTConfig(context=cfg.context, d_model=cfg.d_model, n_layer=cfg.n_layer), seed=cfg.seed)
    net = DistributedDataParallel(model) if distributed else model
    inner = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=ADAMW_BETAS, weight_decay=WEIGHT_DECAY)
    total = cfg.total_steps
    with DiLoCo(net, inner, inner_steps=cfg.inner_steps) as d:  # the swarm, checkpoints, metrics: the launcher's
        # the site's shard, a stream per rank (a restarted site replays the same batches)
        sampler = BatchSampler(corpus.train, batch_size=cfg.batch_size, context=cfg.context,
                               seed=cfg.seed * ranks + rank, shard=d.data_shard % SHARDS, num_shards=SHARDS)
        while d.round < cfg.rounds and not d.ended:  # the whole swarm's run may end first (`diloco.ending`)
            for group in inner.param_groups:
                group["lr"] = inner_lr(d.swarm_step, lr=cfg.lr, warmup=cfg.warmup, total=total)
            x, y = sampler.next()
            _, loss = net(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            d.report_loss(loss.item())
            inner.step()  # the wrapper synchronizes every inner_steps-th call (the site's ranks together)
            inner.zero_grad(set_to_none=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
