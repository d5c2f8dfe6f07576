"""Your own DDP training script as a DiLoCo worker: the only DiLoCo line is the `with`.

The same file runs, unchanged:

    python examples/ddp_train.py                                          # alone: no network
    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py       # one 2-rank site, no swarm
    diloco start -- python examples/ddp_train.py                          # first site of a swarm
    diloco join ADDR -- torchrun --standalone --nproc-per-node 2 examples/ddp_train.py   # a 2-rank site

Under the launcher, `DiLoCo(...)` finds the swarm in the environment (`DILOCO_SWARM`, docs/USAGE.md "Your
own training script"); under torchrun, the ranks are one worker: rank 0 talks to the swarm, every rank
ends each round with the same global parameters. With a GPU per rank, each rank trains on `cuda:LOCAL_RANK`,
and the site's collectives use NCCL (`--device cpu` keeps it on the CPU with gloo).

What a worker takes from the swarm besides its parameters: `d.data_shard` (which data this site reads:
`--shard N` of the launcher, else drawn from its peer id) and `d.swarm_step` (where the swarm's schedule
is: a site that joins late continues the warmup-then-cosine lr from there, not from step 0). `--save PATH`
writes the final global model, the same file on every site.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import diloco


def batches(seed: int, size: int = 32):
    """A toy regression task, y = sin(x·w): each process draws its own batches."""
    g = torch.Generator().manual_seed(seed)
    w = 0.3 * torch.linspace(-1, 1, 16)
    while True:
        x = torch.randn(size, 16, generator=g)
        yield x, torch.sin(x @ w).unsqueeze(1)


def pick_device(choice: str) -> torch.device:
    """auto: this rank's GPU (`cuda:LOCAL_RANK`) when there is one for every rank on this machine, else the CPU
    (every rank decides alike: NCCL for all of them, or gloo)."""
    if choice == "auto":
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        choice = "cuda" if torch.cuda.is_available() and ranks_here <= torch.cuda.device_count() else "cpu"
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if choice == "cuda" else torch.device("cpu")


def start_group(device: torch.device) -> None:
    """This rank's process group: NCCL on its GPU, or gloo on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def lr_at(step: int, lr: float, warmup: int, total: int) -> float:
    """Linear warmup, then cosine to a tenth of `lr` at `total` steps: a function of the swarm's step alone."""
    if step < warmup:
        return lr * (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def build() -> torch.nn.Module:
    torch.manual_seed(0)  # every site starts from the same weights (joiners download the swarm's anyway)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="train until the global round reaches this")
    ap.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per round")
    ap.add_argument("--round-seconds", type=float, default=None,
                    help="rounds by time: sync every this many seconds, however many steps this site managed")
    ap.add_argument("--adaptive", action="store_true",
                    help="adaptive rounds by time: a round lasts --inner-steps steps of the swarm's fastest worker")
    ap.add_argument("--step-delay", type=float, default=0.0,
                    help="sleep this long in every inner step: play a slower machine (try it with --round-seconds)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20, help="inner lr warmup steps, then cosine")
    ap.add_argument("--seed", type=int, default=None, help="data seed (default: from the site's data shard)")
    ap.add_argument("--save", default=None, help="write the final global model here (safetensors)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: a GPU per rank if this machine has enough, else the CPU")
    args = ap.parse_args()

    device = pick_device(args.device)
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # on every site: DiLoCo's weights meet subnormals; before DiLoCo starts its
        # threads, which take the setting from this one (docs/USAGE.md)
    distributed = "RANK" in os.environ  # started by torchrun
    if distributed:
        start_group(device)
    rank = dist.get_rank() if distributed else 0
    model = build().to(device)
    if distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss = torch.tensor(float("nan"))  # no step at all if the swarm is already past --rounds when we join
    total = args.rounds * args.inner_steps

    with diloco.DiLoCo(model, opt, inner_steps=args.inner_steps, round_seconds=args.round_seconds,
                       adaptive=args.adaptive) as d:  # the line
        # each site its own data (each rank its own part of it), and the swarm's place in the lr schedule
        data = batches(args.seed if args.seed is not None else d.data_shard * 1000 + rank)
        while d.round < args.rounds and not d.ended:  # d.ended: the whole swarm's run ended (SIGUSR2 to a peer)
            for group in opt.param_groups:
                group["lr"] = lr_at(d.swarm_step, args.lr, args.warmup, total)
            x, y = (t.to(device, non_blocking=True) for t in next(data))
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            time.sleep(args.step_delay)
            opt.step()
            opt.zero_grad()
    if args.save:
        d.save_final(args.save)  # the global model (on a site, rank 0 writes it)
    if rank == 0:
        print(f"done: round {d.round}, loss {loss.item():.4f}, digest {d.digest}, swarm step {d.swarm_step}, "
              f"data shard {d.data_shard}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
