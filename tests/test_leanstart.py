"""tests/leanstart/sitecustomize.py, which every process of the suite starts with: optimizers built and stepped
before TorchDynamo is imported give the same bits as through torch's own wrappers, which run once it is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LEAN = Path(__file__).parent / "leanstart"

CHECK = r"""
import hashlib, sys
import torch

def train():
    torch.manual_seed(0)
    out = hashlib.sha256()
    for make in (lambda p: torch.optim.AdamW(p, lr=1e-2), lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
                 lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False)):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = make(model.parameters())
        for _ in range(5):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt.load_state_dict(opt.state_dict())
        assert torch.is_grad_enabled()  # the step's grad mode was put back
        for p in model.parameters():
            out.update(p.detach().numpy().tobytes())
    return out.hexdigest()

zero_grad = torch.optim.Optimizer.zero_grad.__wrapped__  # torch's `_disable_dynamo` marks it at its first call
lean = train()
print("torch._dynamo" in sys.modules, hasattr(zero_grad, "__dynamo_disable"))
import torch._dynamo
print(train() == lean, hasattr(zero_grad, "__dynamo_disable"))
"""


@pytest.mark.unit
def test_optimizers_give_the_same_bits_before_dynamo_is_imported_as_through_torchs_wrappers_after():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(LEAN), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    # before: TorchDynamo not imported, torch's wrapper never ran; after: the same bits, through torch's wrapper
    assert out == ["False", "False", "True", "True"]
