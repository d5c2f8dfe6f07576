"""Your own FSDP2 training script as a DiLoCo worker: the only DiLoCo line is the `with`.

The same file runs, unchanged:

    python examples/fsdp_train.py                                          # alone: no network, no sharding
    torchrun --standalone --nproc-per-node 2 examples/fsdp_train.py       # one 2-rank FSDP2 site, no swarm
    diloco start -- torchrun --standalone --nproc-per-node 2 examples/fsdp_train.py      # first site of a swarm
    diloco join ADDR -- torchrun --standalone --nproc-per-node 3 examples/fsdp_train.py  # a 3-rank site joins

Under torchrun every parameter is sharded by FSDP2 (`fully_shard`) over the ranks, which are one worker
of the swarm: each rank keeps the global parameters and the outer optimizer's state for its own shard
only, and its shard of the pseudo-gradient reaches the swarm through rank 0 one span at a time, so no
rank ever holds the whole model's state (docs/SITES.md). The model and data are examples/ddp_train.py's,
so FSDP2 sites, DDP sites and lone processes of either script train in one swarm. (The model's 64 hidden
rows do not divide evenly among 3 ranks, and its last layer's one row leaves some ranks an empty shard:
both are fine.) With a GPU per rank, each rank trains on `cuda:LOCAL_RANK`, and the site's collectives use
NCCL (`--device cpu` keeps it on the CPU with gloo).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import diloco
from ddp_train import batches, build, pick_device, start_group  # the same model and data as the DDP example (same folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="train until the global round reaches this")
    ap.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per round")
    ap.add_argument("--step-delay", type=float, default=0.0,
                    help="sleep this long in every inner step: play a slower machine")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=None, help="data seed (default: from the site's data shard)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: a GPU per rank if this machine has enough, else the CPU")
    args = ap.parse_args()

    device = pick_device(args.device)
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # on every site, as the DDP example does (docs/USAGE.md): before DiLoCo starts
    distributed = "RANK" in os.environ  # started by torchrun
    model = build().to(device)
    if distributed:
        from torch.distributed.fsdp import fully_shard

        start_group(device)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    rank = dist.get_rank() if distributed else 0
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss = torch.tensor(float("nan"))  # no step at all if the swarm is already past --rounds when we join

    with diloco.DiLoCo(model, opt, inner_steps=args.inner_steps) as d:   # the one DiLoCo line
        data = batches(args.seed if args.seed is not None else d.data_shard * 1000 + rank)  # each site its own data
        while d.round < args.rounds and not d.ended:  # d.ended: the whole swarm's run ended
            x, y = (t.to(device, non_blocking=True) for t in next(data))
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            time.sleep(args.step_delay)
            opt.step()
            opt.zero_grad()
    if rank == 0:
        print(f"done: round {d.round}, loss {loss.item():.4f}, digest {d.digest}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
