"""The worker's state (diloco.holding) and what a synchronization no longer does on the training thread: a lone
worker's fp32 round encodes nothing, Δ is formed in the same memory every slot, and the outer Nesterov step runs
in its foreach form, bit for bit."""

from __future__ import annotations

import pytest
import torch

from diloco import DiLoCo
from diloco.holding import Holding
from diloco.outer import nesterov, outer_step
from diloco.state import GlobalState

pytestmark = pytest.mark.unit


def _state(seed: int = 0) -> GlobalState:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(300, 70, generator=g), torch.randn(1000, generator=g)]
    state = GlobalState(params, nesterov())
    outer_step(state.outer, state.params, torch.randn(22000, generator=g), 1.0)  # momentum in the state too
    state.round = 3
    return state


def test_the_digest_held_is_the_state_hashed_in_place_and_follows_every_change():
    state = _state()
    expected = state.manifest().digest
    held = Holding(state, nesterov(), torch.device("cpu"))
    assert held.digest == expected and held.manifest.digest == expected
    with held.changing() as s:
        s.params[1].add_(1.0)
        s.round += 1
    assert held.digest == s.manifest().digest != expected
    assert list(held.recent) == [(3, expected), (4, held.digest)]


def test_foreach_nesterov_steps_bit_for_bit_like_the_loop_over_tensors():
    g = torch.Generator().manual_seed(5)
    params = [torch.randn(257, 33, generator=g), torch.randn(4099, generator=g)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(4)]
    out = {}
    for foreach in (False, True):
        theta = [p.clone() for p in params]
        opt = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True, foreach=foreach)
        for step in grads:
            for t, d in zip(theta, step):
                t.grad = d.clone()
            opt.step()
        out[foreach] = theta
    assert all(torch.equal(a, b) for a, b in zip(out[False], out[True]))
    assert nesterov()([torch.zeros(1)]).defaults["foreach"] is True


def _lone(monkeypatch=None, **kw) -> tuple[DiLoCo, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return DiLoCo(model, opt, swarm=None, inner_steps=2, **kw), model, opt


def _train(d: DiLoCo, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 8) -> None:
    g = torch.Generator().manual_seed(1)
    with d:
        for _ in range(steps):
            loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()


def test_a_lone_fp32_round_encodes_nothing_and_forms_delta_in_the_same_memory(monkeypatch):
    d, model, opt = _lone()
    buffers = set()
    real = d.engine._buffer

    def seen(frag):
        out = real(frag)
        buffers.add(out.data_ptr())
        return out

    monkeypatch.setattr(d.engine, "_buffer", seen)
    monkeypatch.setattr(d.engine.local_pipeline, "encode", lambda *_: pytest.fail("a lone fp32 round encoded Δ"))
    _train(d, model, opt)
    assert d.round == 4 and len(buffers) == 1
    assert {r.bits_per_param for r in d.reports} == {32.0}  # what the codec would have sent

    plain, model2, opt2 = _lone()  # the same run, Δ freshly allocated every slot: the same state, bit for bit
    monkeypatch.setattr(plain.engine, "_buffer", lambda frag: None)
    _train(plain, model2, opt2)
    assert plain.digest == d.digest


def test_a_lone_lossy_round_still_goes_through_its_codec():
    d, model, opt = _lone(compression="q8")
    _train(d, model, opt)
    assert d.round == 4 and all(0 < r.bits_per_param < 10 for r in d.reports)
