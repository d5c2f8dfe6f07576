"""Models that break naive wrappers, each trained by two peers through an in-process swarm (the real
round protocol, codecs and outer optimizer over the in-process transport): tied weights, frozen
parameters, several parameter groups, a learning-rate scheduler, gradient accumulation, bf16 autocast,
bf16 parameters, a torch.compile'd model, and BatchNorm buffers. Both peers must end every run on one
global-state digest; what each case adds is asserted where it is built.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from test_swarm_inproc import H, Harness, _run_threads

from diloco import DiLoCo

pytestmark = pytest.mark.swarm

ROUNDS = 3


@dataclass
class Case:
    """How to build one peer's model and optimizer, and how to take one inner step."""

    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]
    micro: int = 1  # micro-batches per optimizer step (gradient accumulation)
    autocast: bool = False
    scheduler: bool = False
    extra: dict = field(default_factory=dict)


def _mlp(dtype: torch.dtype = torch.float32, norm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(6, 16)]
    if norm:
        layers.append(torch.nn.BatchNorm1d(16))
    layers += [torch.nn.Tanh(), torch.nn.Linear(16, 1)]
    return torch.nn.Sequential(*layers).to(dtype)


class Tied(torch.nn.Module):
    """An embedding whose weight is also the output projection (GPT-2's wte / lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 6)
        self.mix = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.emb(x).mean(1))))


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _frozen() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _mlp()
    model[0].weight.requires_grad_(False)
    return model, _adamw(model)


def _groups() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _mlp()
    return model, torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-2},
                                     {"params": model[2].parameters(), "lr": 3e-3, "weight_decay": 0.0}])


def _compiled() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _mlp()
    return torch.compile(model, backend="eager"), _adamw(model)  # "eager": no C compiler needed on CI


CASES = {
    "tied_weights": Case(lambda: (m := Tied(), _adamw(m))),
    "frozen_parameters": Case(_frozen),
    "param_groups": Case(_groups),
    "lr_scheduler": Case(lambda: (m := _mlp(), _adamw(m)), scheduler=True),
    "gradient_accumulation": Case(lambda: (m := _mlp(), _adamw(m)), micro=3),
    "bf16_autocast": Case(lambda: (m := _mlp(), _adamw(m)), autocast=True),
    "bf16_parameters": Case(lambda: (m := _mlp(torch.bfloat16), _adamw(m))),
    "torch_compile": Case(_compiled),
    "batchnorm_buffers": Case(lambda: (m := _mlp(norm=True), _adamw(m))),
}


def _batch(model: torch.nn.Module, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(model, Tied):
        x = torch.randint(0, 10, (8, 4), generator=g)
        return x, x[:, 0]
    x = torch.randn(16, 6, generator=g)
    return x, x[:, :3].sum(1, keepdim=True)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if isinstance(model, Tied):
        return torch.nn.functional.cross_entropy(model(x), y)
    out = model(x.to(next(model.parameters()).dtype))
    return torch.nn.functional.mse_loss(out.float(), y)


@pytest.mark.parametrize("name", list(CASES))
def test_two_peers_train_the_model_and_end_on_one_digest(name):
    case = CASES[name]
    built = [case.build() for _ in range(2)]  # in the test thread: torch's RNG is shared by threads
    h = Harness()
    start = threading.Barrier(2, timeout=10)
    out: dict[int, DiLoCo] = {}
    optimizer_steps: dict[int, int] = {}

    def peer(i: int) -> Callable[[], None]:
        model, opt = built[i]
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if case.scheduler else None
        g = torch.Generator().manual_seed(10 + i)

        def run() -> None:
            d = DiLoCo(model, opt, swarm=h.swarm(f"{name}{i}"), inner_steps=H)
            steps = 0
            with d:
                start.wait()
                while d.round < ROUNDS and steps < 20 * H:
                    for _ in range(case.micro):  # gradient accumulation: one optimizer step per `micro` batches
                        x, y = _batch(model, g)
                        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.autocast):
                            loss = _loss(model, x, y) / case.micro
                        loss.backward()
                    opt.step()
                    opt.zero_grad()
                    steps += 1
                    if sched is not None:
                        sched.step()
            out[i] = d
            optimizer_steps[i] = steps
        return run

    try:
        _run_threads([peer(0), peer(1)], [start])
    finally:
        h.close()
    d0, d1 = out[0], out[1]
    assert d0.round == d1.round == ROUNDS and d0.digest == d1.digest
    assert all(r.peers == 2 for r in d0.reports if r.committed)
    assert d0.steps == optimizer_steps[0]  # inner steps are optimizer steps, however many micro-batches each took
    m0, m1 = built[0][0], built[1][0]
    trained = [p for p in m0.parameters() if p.requires_grad]
    assert sum(p.numel() for p in d0.state.params) == sum(p.numel() for p in trained)
    if name == "tied_weights":  # the shared tensor is one parameter (emb = out), synchronized once, still shared
        assert len(d0.state.params) == len(list(m0.parameters())) == 3 and m0.out.weight is m0.emb.weight
    if name == "frozen_parameters":  # not synchronized, and untouched
        assert torch.equal(m0[0].weight, m1[0].weight) and torch.equal(m0[0].weight, _mlp()[0].weight)
    if name == "lr_scheduler":  # the inner schedule is the user's: it moved on every optimizer step
        assert built[0][1].param_groups[0]["lr"] < 1e-2
    if name == "bf16_parameters":  # θ is kept in fp32; the model gets its bf16 rounding
        assert all(p.dtype == torch.float32 for p in d0.state.params)
        with d0.global_weights():
            assert all(p.dtype == torch.bfloat16 for p in m0.parameters())
    if name == "torch_compile":  # the compiled wrapper's `_orig_mod.` prefix is not part of the schema
        assert d0.schema == DiLoCo(_mlp(), _adamw(_mlp()), swarm=None, inner_steps=H).schema
    if name == "batchnorm_buffers":  # running statistics are buffers: each peer keeps its own
        bn0, bn1 = m0[1], m1[1]
        assert not torch.equal(bn0.running_mean, bn1.running_mean)
        with d0.global_weights(), d1.global_weights():
            assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
