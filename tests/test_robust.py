"""Robust aggregation (comms/robust.py): the pure rules, and a poisoning peer among real collectives.

The swarm-level tests run eight `Collective`s over in-process transports in one event loop (as in
test_collective.py); one of them multiplies its pseudo-gradient by 1e4 every round.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from diloco.comms import Collective, CollectiveConfig, InProcNetwork, RoundKey, span_bounds
from diloco.comms import robust
from diloco.comms.reduce import average
from diloco.comms.robust import RobustConfig
from diloco.compression import Reason
from diloco.compression.pipeline import Decoded
from diloco.config import ConfigError, SwarmConfig

RUN = "robust"
DIGEST = "d" * 16
PEERS = [f"p{i}" for i in range(8)]
BAD = "p7"
NUMEL = 4000


def _cfg(reduce_timeout: float = 10.0, result_timeout: float = 20.0, **robust_kw) -> CollectiveConfig:
    """Every peer delivers in these rounds: the owners' and results' deadlines only bound them (an exchange of the
    eight in-process peers took 1.57 s once, its core shared with the rest of the suite)."""
    return CollectiveConfig(gather_timeout=0.5, reduce_timeout=reduce_timeout, result_timeout=result_timeout,
                            call_timeout=5.0,
                            robust=RobustConfig(**robust_kw))


def _dense(values) -> Decoded:
    return Decoded(None, torch.tensor(values, dtype=torch.float32))


# ---------------------------------------------------------------------- the pure rules


@pytest.mark.unit
def test_lower_median_is_an_element_and_ignores_one_outlier():
    assert robust.median([3.0, 1.0, 2.0]) == 2.0
    assert robust.median([1.0, 2.0, 3.0, 1e9]) == 2.0
    assert robust.median([5.0]) == 5.0


@pytest.mark.unit
def test_clip_scales_bring_outliers_to_the_bound_and_need_three_contributions():
    scales = robust.clip_scales([1.0, 2.0, 3.0, 100.0], clip=4.0)
    assert scales[:3] == [1.0, 1.0, 1.0]
    assert math.isclose(scales[3] * 100.0, 4.0 * 2.0)
    assert robust.clip_scales([1.0, 100.0], clip=4.0) == [1.0, 1.0]  # two: no median to trust
    assert robust.clip_scales([1.0, 2.0, 100.0], clip=0) == [1.0, 1.0, 1.0]  # off
    assert robust.clip_scales([0.0, 0.0, 5.0], clip=4.0) == [1.0, 1.0, 1.0]  # median 0: no scale to clip to


@pytest.mark.unit
def test_offenders_are_those_far_above_the_median():
    assert robust.offenders([1.0, 1.1, 0.9, 17.0], strike=16.0) == [3]
    assert robust.offenders([1.0, 1.1, 0.9, 15.0], strike=16.0) == []
    assert robust.offenders([1.0, 1e6], strike=16.0) == []


@pytest.mark.unit
def test_honest_inputs_combine_bit_identically_to_the_plain_mean():
    g = torch.Generator().manual_seed(0)
    parts = [Decoded(None, torch.randn(1000, generator=g)) for _ in range(5)]
    out = robust.combine(parts, 1000, RobustConfig())
    assert out.clipped == []
    assert torch.equal(out.values, average(parts, 1000))


@pytest.mark.unit
def test_combine_clips_one_huge_contribution_to_the_bound():
    g = torch.Generator().manual_seed(1)
    honest = [Decoded(None, torch.randn(1000, generator=g)) for _ in range(4)]
    bad = Decoded(None, 1e4 * torch.randn(1000, generator=g))
    out = robust.combine(honest + [bad], 1000, RobustConfig(clip=4.0))
    assert out.clipped == [4]
    med = robust.median(out.norms)
    assert math.isclose(robust.norm(Decoded(None, bad.values * out.scales[4])), 4.0 * med, rel_tol=1e-5)
    honest_mean = average(honest, 1000)
    # one of n moves the mean by at most (clip * median + |honest mean|) / n
    bound = (4.0 * med + robust.norm(Decoded(None, honest_mean))) / 5
    assert robust.norm(Decoded(None, out.values - honest_mean)) <= bound * (1 + 1e-5)


@pytest.mark.unit
def test_combine_takes_the_norms_admission_measured_and_measures_the_rest():
    g = torch.Generator().manual_seed(2)
    parts = [Decoded(None, torch.randn(1000, generator=g)) for _ in range(4)] + \
        [Decoded(None, 100 * torch.randn(1000, generator=g))]  # far above the others, below max_rms
    cfg = RobustConfig(clip=4.0)
    assessed = [robust.assess(p, cfg) for p in parts]
    assert [why for _, why in assessed] == ["", "", "", "", ""]
    plain = robust.combine(parts, 1000, cfg)
    given = robust.combine(parts, 1000, cfg, norms=[size for size, _ in assessed])
    partly = robust.combine(parts, 1000, cfg, norms=[assessed[0][0], None, None, assessed[3][0], None])
    for out in (given, partly):
        assert out.norms == plain.norms and out.scales == plain.scales and out.clipped == [4]
        assert torch.equal(out.values, plain.values)
    with pytest.raises(ValueError, match="4 norms for 5 contributions"):
        robust.combine(parts, 1000, cfg, norms=[1.0] * 4)
    size, why = robust.assess(Decoded(None, torch.tensor([3.0, float("nan")])), cfg)
    assert why == "holds NaN or Inf" and math.isnan(size)


@pytest.mark.unit
def test_sparse_contributions_are_clipped_on_the_values_they_hold():
    parts = [Decoded(torch.tensor([0, 1]), torch.tensor([1.0, 1.0])),
             Decoded(torch.tensor([1, 2]), torch.tensor([1.0, -1.0])),
             Decoded(torch.tensor([2, 3]), torch.tensor([1.0, 1.0])),
             Decoded(torch.tensor([0, 3]), torch.tensor([1e6, 1e6]))]
    out = robust.combine(parts, 4, RobustConfig(clip=2.0))
    assert out.clipped == [3]
    assert float(out.values.abs().max()) <= 2.0


@pytest.mark.unit
def test_trimmed_mean_drops_extremes_per_coordinate_in_any_order():
    vals = [torch.tensor([1.0, -5.0]), torch.tensor([2.0, 0.0]), torch.tensor([100.0, 1.0]),
            torch.tensor([3.0, 2.0]), torch.tensor([-50.0, 3.0])]
    out = robust.trimmed_mean(vals, 1)
    assert torch.equal(out, torch.tensor([2.0, 1.0]))
    assert torch.equal(robust.trimmed_mean(vals[::-1], 1), out)
    combined = robust.combine([Decoded(None, v) for v in vals], 2, RobustConfig(clip=0, trim=0.2))
    assert torch.equal(combined.values, out)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_finite_is_false_for_any_nan_or_inf_and_true_for_huge_finite_values(dtype):
    """`finite` answers from a dot product where it can; values whose squares overflow are still finite."""
    from diloco.compression.codecs import all_finite as finite

    base = torch.randn(10_001, dtype=torch.float32).to(dtype)
    assert finite(base) and finite(torch.empty(0, dtype=dtype)) and finite(base.view(1, -1)[:, ::2])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 5_000, 10_000):
            x = base.clone()
            x[at] = bad
            assert not finite(x), (bad, at)
    huge = base.clone()
    huge[7] = 3e38 if dtype != torch.float64 else 1e300  # its square overflows; the value itself is finite
    huge[8] = -huge[7]
    assert finite(huge)


@pytest.mark.unit
def test_finite_takes_its_dot_products_a_piece_at_a_time(monkeypatch):
    """A GPU's dot takes at most 2^31 - 1 values: longer tensors are checked in pieces, a bad value in any one of
    them found."""
    import diloco.compression.codecs as codecs_module

    monkeypatch.setattr(codecs_module, "DOT_PIECE", 10)
    x = torch.randn(95)
    assert codecs_module.all_finite(x)
    for at in (0, 9, 10, 57, 94):
        y = x.clone()
        y[at] = float("nan")
        assert not codecs_module.all_finite(y), at


@pytest.mark.unit
def test_admission_refuses_non_finite_and_absurd_values():
    cfg = RobustConfig(max_rms=10.0)
    assert robust.admit(_dense([1.0, -2.0]), cfg) == (True, "")
    ok, why = robust.admit(_dense([1.0, float("nan")]), cfg)
    assert not ok and "NaN" in why
    ok, why = robust.admit(_dense([100.0, 100.0]), cfg)
    assert not ok and "max_rms=10" in why
    for bad in (float("inf"), float("-inf")):  # each non-finite value, wherever it sits among 2M
        values = torch.zeros(2_000_000)
        values[1_500_000] = bad
        assert robust.admit(Decoded(None, values), cfg)[1] == "holds NaN or Inf"
    huge = robust.admit(_dense([3.4e38, -3.4e38, 3.4e38]), RobustConfig(max_rms=float("inf")))
    assert huge == (True, "")  # the largest float32s square to a finite float64: finite, and admitted


@pytest.mark.unit
def test_bad_settings_say_what_to_fix():
    with pytest.raises(ValueError, match="clip must be 0"):
        RobustConfig(clip=0.5)
    with pytest.raises(ValueError, match="trim must be in"):
        RobustConfig(trim=0.5)
    with pytest.raises(ValueError, match="ban_after"):
        RobustConfig(ban_after=-1)
    with pytest.raises(ValueError, match="needs a dense compression pipeline"):
        CollectiveConfig(compression="topk:64/4096+s2", robust=RobustConfig(trim=0.1))
    with pytest.raises(ConfigError, match="trim"):
        SwarmConfig(round=CollectiveConfig(robust=RobustConfig(trim=0.7)))


# ---------------------------------------------------------------------- a poisoning peer among eight


def _deltas(rnd: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rnd)
    out = {p: 0.01 * torch.randn(NUMEL, generator=g) for p in PEERS}
    out[BAD] = out[BAD] * 1e4
    return out


def _span_bound(deltas: dict[str, torch.Tensor], view, clip: float) -> list[tuple[int, int, float]]:
    """Per span of `view`: (lo, hi, the most one peer may move that span's mean away from the honest mean)."""
    honest = [p for p in view if p != BAD]
    out = []
    for lo, hi in span_bounds(NUMEL, len(view)):
        norms = [float(deltas[p][lo:hi].norm()) for p in view]
        honest_mean = torch.stack([deltas[p][lo:hi] for p in honest]).mean(0)
        out.append((lo, hi, (clip * robust.median(norms) + float(honest_mean.norm())) / len(view)))
    return out


async def _run(cfg: CollectiveConfig, rounds: int):
    net = InProcNetwork()
    cs = {p: await Collective.create(net.transport(p), RUN, cfg) for p in PEERS}
    history = []
    for r in range(rounds):
        deltas = _deltas(r)
        outs = await asyncio.gather(*(cs[p].run_round(RoundKey(r), DIGEST, PEERS, deltas[p]) for p in PEERS))
        history.append((deltas, dict(zip(PEERS, outs))))
    return cs, history


@pytest.mark.swarm
def test_one_poisoning_peer_of_eight_is_clipped_then_banned():
    # every peer is there and answers at once: the exchange's deadlines only bound it, far above what eight peers in
    # one event loop take on a busy 2-core machine (an idle suite once took 1.57 s for an exchange a 1 s result
    # deadline then failed); no span here waits one out
    cfg = _cfg(clip=4.0, ban_after=3)
    cs, history = asyncio.run(_run(cfg, rounds=5))
    honest = [p for p in PEERS if p != BAD]
    for r, (deltas, outs) in enumerate(history):
        first = outs[honest[0]]
        assert first.committed, first.reason
        for p in honest:  # every honest peer applies the same aggregate
            assert outs[p].committed and torch.equal(outs[p].aggregate, first.aggregate)
        honest_mean = torch.stack([deltas[p] for p in honest]).mean(0)
        if r < 3:  # the attacker is in the view, clipped by every honest owner
            assert first.view == tuple(PEERS)
            for lo, hi, bound in _span_bound(deltas, first.view, 4.0):
                err = float((first.aggregate[lo:hi] - honest_mean[lo:hi]).norm())
                if (lo, hi) != span_bounds(NUMEL, 8)[first.view.index(BAD)]:  # its own span it may set freely
                    assert err <= bound * (1 + 1e-4), (r, lo, err, bound)
        else:  # banned by everyone after three strikes: the honest seven average alone
            assert first.view == tuple(honest)
            assert torch.allclose(first.aggregate, honest_mean, rtol=0, atol=1e-7)
    for p in honest:
        c = cs[p]
        assert BAD in c.banned and c.strikes[BAD] == 3
        assert c.robust_events["banned"] == 1 and c.robust_events["clipped"] >= 3
        assert set(c.strikes) == {BAD}  # nobody honest was struck
    assert sum(cs[p].rejections[Reason.BANNED.value] for p in honest) > 0  # its later frames were refused


@pytest.mark.swarm
def test_without_robust_aggregation_the_same_peer_wrecks_the_mean():
    """Negative control: the damage the defence prevents is real."""
    _, history = asyncio.run(_run(_cfg(clip=0, ban_after=0), rounds=1))
    deltas, outs = history[0]
    honest = [p for p in PEERS if p != BAD]
    honest_mean = torch.stack([deltas[p] for p in honest]).mean(0)
    agg = outs[honest[0]].aggregate
    err = float((agg - honest_mean).norm())
    defended = math.sqrt(sum(b * b for _, _, b in _span_bound(deltas, outs[honest[0]].view, 4.0)))
    assert err > 100 * defended


@pytest.mark.swarm
def test_non_finite_contributions_never_reach_the_aggregate_and_earn_a_ban():
    """p3's pseudo-gradient is NaN: every owner refuses it (p3 its own too), rounds commit without it,
    and the majority's marks ban it after two rounds on every peer alike."""
    ids, numel = PEERS[:4], 64

    async def main():
        net = InProcNetwork()
        # p3, banned, waits out its last round's result deadline: 3 s, long enough for the others' results
        cfg = _cfg(reduce_timeout=2.0, result_timeout=3.0, ban_after=2)
        cs = {p: await Collective.create(net.transport(p), RUN, cfg) for p in ids}
        history = []
        for r in range(3):
            g = torch.Generator().manual_seed(r)
            deltas = {p: torch.randn(numel, generator=g) for p in ids}
            deltas["p3"] = torch.full((numel,), float("nan"))
            outs = await asyncio.gather(*(cs[p].run_round(RoundKey(r), DIGEST, ids, deltas[p]) for p in ids))
            history.append((deltas, dict(zip(ids, outs))))
        return cs, history

    cs, history = asyncio.run(main())
    for r, (deltas, outs) in enumerate(history):
        o = outs["p0"]
        assert o.committed, o.reason
        assert bool(torch.isfinite(o.aggregate).all())
        assert torch.allclose(o.aggregate, torch.stack([deltas[p] for p in ids[:3]]).mean(0), rtol=0, atol=1e-6)
        assert all(torch.equal(outs[p].aggregate, o.aggregate) for p in ids[:3])
        if r < 2:
            assert o.view == tuple(ids) and o.offenders == ("p3",)
            assert all("p3" not in c for c in o.contributors)
        else:
            assert o.view == tuple(ids[:3])
    for p in ids[:3]:
        assert cs[p].banned == {"p3"} and cs[p].rejections[Reason.NON_FINITE.value] >= 2


# ---------------------------------------------------------------------- our own update diverged


@pytest.mark.unit
def test_a_worker_whose_own_update_is_not_finite_rolls_back_and_sends_nothing():
    from diloco import DiLoCo

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def step(poison: bool = False) -> None:
        loss = torch.nn.functional.mse_loss(model(x), y) * (float("nan") if poison else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()

    with DiLoCo(model, opt, swarm=None, inner_steps=3) as d:
        for _ in range(3):
            step()
        assert d.round == 1 and d.rollbacks == 0
        theta = [p.detach().clone() for p in d.state.params]
        step()
        step(poison=True)  # a diverged inner step: NaN gradients, NaN moments, NaN weights
        assert any(not bool(torch.isfinite(p).all()) for p in model.parameters())
        step()  # the sync
        assert d.rollbacks == 1 and d.round == 1
        last = d.reports[-1]
        assert not last.committed and "non-finite" in last.reason and last.bytes_sent == 0
        for p, t, g in zip(model.parameters(), theta, d.state.params):
            assert torch.equal(p.detach(), t) and torch.equal(g, t)  # back at θ, θ untouched
        assert not opt.state  # the NaN moments are gone
        for _ in range(3):
            step()
        assert d.round == 2 and d.reports[-1].committed  # and training goes on
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
