"""A plain PyTorch training loop turned into a DiLoCo worker by one line.

Run it alone (single-worker DiLoCo, no network):
    python examples/plain_loop.py

Run a swarm of two on this machine (two terminals, same directory):
    python examples/plain_loop.py --start                 # prints its address; writes the swarm secret
    python examples/plain_loop.py --join /ip4/127.0.0.1/tcp/…/p2p/12D3Koo…

Across machines: `--start --host 0.0.0.0` on one, `--join <its public address>` on the others, after
copying the secret file (diloco-plain-loop-example.secret) to them, e.g. with scp.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import diloco
from diloco.credentials import resolve


def make_data(seed: int, n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """A toy regression task: y = sin(x·w) with a fixed w, x drawn per worker."""
    g = torch.Generator().manual_seed(seed)
    w = 0.3 * torch.linspace(-1, 1, 16)
    x = torch.randn(n, 16, generator=g)
    return x, torch.sin(x @ w).unsqueeze(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", action="store_true", help="start a swarm")
    ap.add_argument("--join", nargs="*", default=None, help="address(es) of a running peer")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--secret-file", type=Path, default=Path("diloco-plain-loop-example.secret"),
                    help="the swarm secret's file (--start creates it if missing)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0, help="data seed of this worker")
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the global state stays in host memory either way
    torch.manual_seed(0)  # every worker starts from the same model
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = (t.to(device) for t in make_data(args.seed))
    x_eval, y_eval = (t.to(device) for t in make_data(10_000, n=1024))

    swarm = None
    if args.start or args.join:  # the swarm secret: created by --start, read from the file by --join
        secret, _ = resolve(args.secret_file, run_id="plain-loop-example", create=args.start)
        cfg = diloco.SwarmConfig(run_id="plain-loop-example", secret=secret)
    if args.start:
        swarm = diloco.Swarm.start(cfg, host=args.host)
        print("others join with:\n  python examples/plain_loop.py --join", swarm.addresses[0])
    elif args.join:
        swarm = diloco.Swarm.join(args.join, cfg, host=args.host)

    try:
        with diloco.DiLoCo(model, optimizer, swarm=swarm, inner_steps=args.inner_steps) as d:  # the one line
            for step in range(args.steps):
                if d.ended:  # the whole swarm's run ended (docs/USAGE.md, "Ending the whole run")
                    break
                i = torch.randint(0, len(x), (64,), device=device)
                loss = torch.nn.functional.mse_loss(model(x[i]), y[i])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        with torch.no_grad(), d.global_weights():  # evaluate the global (outer) parameters
            eval_loss = torch.nn.functional.mse_loss(model(x_eval), y_eval).item()
        print(f"rounds committed: {d.round}  held-out MSE of the global model: {eval_loss:.4f}")
    finally:
        if swarm is not None:
            swarm.close()


if __name__ == "__main__":
    main()
