"""tests/leanstart/sitecustomize.py, which every process of the suite starts with: optimizers built and stepped
without TorchDynamo imported give bit-identical results, and once it is imported torch's own wrappers run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LEAN = Path(__file__).parent / "leanstart"

TRAIN = r"""
import hashlib, sys
import torch
torch.manual_seed(0)
out = hashlib.sha256()
for make in (lambda p: torch.optim.AdamW(p, lr=1e-2), lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
             lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False)):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = make(model.parameters())
    for _ in range(5):
        x = torch.randn(4, 8)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    assert torch.is_grad_enabled()  # the step's grad mode was put back
    for p in model.parameters():
        out.update(p.detach().numpy().tobytes())
print(out.hexdigest(), "torch._dynamo" in sys.modules)
"""

AFTER = r"""
import sys
import torch
opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
zero_grad = torch.optim.Optimizer.zero_grad.__wrapped__
opt.zero_grad()
before = hasattr(zero_grad, "__dynamo_disable")
import torch._dynamo
opt.zero_grad()
print(before, hasattr(zero_grad, "__dynamo_disable"))
"""


def _run(code: str, *, lean: bool) -> str:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != LEAN]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LEAN), *paths] if lean else paths)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=True).stdout.strip()


@pytest.mark.unit
def test_optimizers_give_the_same_bits_without_dynamo_imported_and_torchs_wrappers_run_once_it_is():
    lean, plain = _run(TRAIN, lean=True).split(), _run(TRAIN, lean=False).split()
    assert lean[0] == plain[0]
    assert (lean[1], plain[1]) == ("False", "True")
    # torch's `_disable_dynamo` marks the function it disabled at its first call: never before the import, then yes
    assert _run(AFTER, lean=True).split() == ["False", "True"]
    assert _run(AFTER, lean=False).split() == ["True", "True"]
