"""KL estimators and KL-coefficient controllers against the textbook formulas."""

from __future__ import annotations

import math

import pytest
import torch

from bounds import assert_within, unit_roundoff
from posttrain.core.kl import AdaptiveKLController, FixedKLController, kl_penalty

SHAPES = [(1, 1), (2, 5), (4, 3)]


def _logprobs(shape, seed, spread, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(shape, generator=g, dtype=torch.float64) * 6
    ref = lp + torch.randn(shape, generator=g, dtype=torch.float64) * spread
    return lp.to(dtype), ref.to(dtype)


def _naive(estimator, lp, ref):
    """Per element, in float64: k1 = r, k2 = r²/2, k3 = exp(ref - lp) - (ref - lp) - 1."""
    out = []
    for a, b in zip(lp.flatten().tolist(), ref.flatten().tolist(), strict=True):
        r = a - b
        if estimator == "k1":
            out.append(r)
        elif estimator == "k2":
            out.append(0.5 * r * r)
        else:
            out.append(math.exp(b - a) - (b - a) - 1.0)
    return torch.tensor(out, dtype=torch.float64).view(lp.shape)


def _scale(estimator, r, naive=False):
    """Element by element, the size of what a float ``estimator`` rounds (times u, its error;
    no reductions, so no length enters). ``r`` is the exact log-ratio (clamped, for k3).
    k1 = ℓ − ℓ_ref: one rounding of |r|. k2 = r²/2: r's rounding twice (relative) and the
    square's once, 3·k2. k3 = expm1(−r) + r: r's rounding times dk3/dr = 1 − e^{−r}, expm1
    within an ulp (2u) of |e^{−r} − 1|, and the sum's rounding. ``naive``: the reference's
    exp(−r) − r − 1 instead, whose exp, subtraction and −1 round on e^{−r}, |e^{−r} − r| and
    k3 (near r = 0 that is ~1, not k3: the cancellation expm1 avoids)."""
    if estimator == "k1":
        return r.abs()
    if estimator == "k2":
        return 1.5 * r.square()
    em = torch.expm1(-r)
    tail = 2 * em.abs() if not naive else 2 * torch.exp(-r) + (torch.exp(-r) - r).abs()
    return r.abs() * em.abs() + tail + (em + r).abs()


def _bound(estimator, lp, ref, dtype, clamp=20.0):
    """``kl_penalty`` in ``dtype`` against the float64 formula: both computations' errors."""
    r = (lp.double() - ref.double())
    if estimator == "k3":
        r = r.clamp(-clamp, clamp)
    return (unit_roundoff(dtype) * _scale(estimator, r)
            + unit_roundoff(torch.float64) * _scale(estimator, r, naive=True))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("spread", [1e-3, 0.5, 3.0])
def test_estimators_match_formula(shape, estimator, spread):
    """k1/k2/k3 equal the formulas of ALGORITHMS.md §4 on random float32 log-probs."""
    lp, ref = _logprobs(shape, 3, spread)
    got = kl_penalty(lp, ref, estimator)
    assert got.shape == lp.shape and got.dtype == torch.float32
    # element by element within the derived bound, ~u of the value (a 1% error is 10^5
    # times beyond it)
    assert_within(got, _naive(estimator, lp.double(), ref.double()), 1.0,
                  _bound(estimator, lp, ref, torch.float32), estimator)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_estimators_in_float64(estimator):
    """float64 inputs give float64 results equal to the float64 formula."""
    lp, ref = _logprobs((3, 4), 5, 1.0, torch.float64)
    got = kl_penalty(lp, ref, estimator)
    assert got.dtype == torch.float64
    assert_within(got, _naive(estimator, lp, ref), 1.0,
                  _bound(estimator, lp, ref, torch.float64), estimator)


def test_k3_small_ratio_is_nonnegative_and_accurate():
    """For |r| ~ 1e-4 in float32, k3 ≈ r²/2 stays ≥ 0 with an error of a few ulp of r (not of 1):
    the derived bound (_scale) is ~2u·|r| there.

    ``exp(-r) - 1 + r`` in float32 is off by ~6e-8 there, ten times the value itself.
    """
    lp, ref = _logprobs((50, 40), 7, 1e-4)
    got = kl_penalty(lp, ref, "k3")
    assert (got >= 0).all()
    expect = _naive("k3", lp.double(), ref.double())
    assert_within(got, expect, 1.0, _bound("k3", lp, ref, torch.float32), "k3")


def test_k3_is_zero_when_equal():
    """k3 (and k1, k2) is exactly 0 when the policy equals the reference."""
    lp, _ = _logprobs((2, 3), 1, 0.0)
    for est in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(lp, lp.clone(), est), torch.zeros_like(lp))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_gradient_matches_analytic(estimator):
    """d/dℓ: k1 → 1, k2 → r, k3 → 1 - exp(-r) (r = ℓ - ℓ_ref), computed in float64."""
    lp, ref = _logprobs((3, 5), 2, 1.0, torch.float64)
    lp.requires_grad_(True)
    kl_penalty(lp, ref, estimator).sum().backward()
    r = [a - b for a, b in zip(lp.detach().flatten().tolist(), ref.flatten().tolist(), strict=True)]
    d = {"k1": lambda v: 1.0, "k2": lambda v: v, "k3": lambda v: 1.0 - math.exp(-v)}[estimator]
    expect = torch.tensor([d(v) for v in r], dtype=torch.float64).view(lp.shape)
    # float64 both: r's rounding (times the derivative's slope e^{−r} for k3), the backward's
    # exp/expm1 (an ulp of e^{−r}) and its sum with 1 (u·|1 − e^{−r}|), for each of the two
    e = torch.exp(-torch.tensor(r, dtype=torch.float64)).view(lp.shape)
    scale = 2 * ((1 + e) * (1 + torch.tensor(r, dtype=torch.float64).abs().view(lp.shape)) + 2 * e)
    assert_within(lp.grad, expect, unit_roundoff(torch.float64), scale, estimator)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reference_gets_no_gradient(estimator):
    """ref_logprobs is a constant: after backward its .grad is still None."""
    lp, ref = _logprobs((2, 4), 4, 1.0)
    lp.requires_grad_(True)
    ref.requires_grad_(True)
    kl_penalty(lp, ref, estimator).sum().backward()
    assert ref.grad is None
    assert lp.grad is not None and lp.grad.abs().sum() > 0


def test_k3_extreme_ratios_are_finite_and_clamped():
    """|r| = 100 in float32: finite loss and gradient; value is k3 at r = ±clamp."""
    lp = torch.tensor([-1.0, -150.0, -3.0, -3.0], requires_grad=True)
    ref = torch.tensor([-101.0, -50.0, -3.0 - 5.0, -3.0 + 5.0])  # r = 100, -100, 5, -5
    out = kl_penalty(lp, ref, "k3", clamp=20.0)
    expect = [math.exp(-20) - 1 + 20, math.exp(20) - 1 - 20,
              math.exp(-5) - 1 + 5, math.exp(5) - 1 - 5]
    # the r here are exact in float32 (integers): expm1's ulp and the sum's rounding, ~3u of
    # the value (4.85e8 at r = −20)
    assert_within(out, torch.tensor(expect, dtype=torch.float64), 1.0,
                  _bound("k3", lp.detach(), ref, torch.float32), "k3")
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()
    # Beyond the clamp the value is constant in ℓ; inside it the gradient is 1 - exp(-r).
    expect_grad = [0.0, 0.0, 1 - math.exp(-5), 1 - math.exp(5)]
    # the backward's exp (an ulp, 2u, of e^{−r}) and its sum with 1 (u·|1 − e^{−r}|); the
    # clamped entries get exactly 0
    e = torch.tensor([0.0, 0.0, math.exp(-5), math.exp(5)], dtype=torch.float64)
    assert_within(lp.grad, torch.tensor(expect_grad, dtype=torch.float64),
                  unit_roundoff(torch.float32), 2 * e + (1 - e).abs(), "k3 gradient")


def test_unknown_estimator_raises():
    """An unknown estimator name is an error."""
    lp, ref = _logprobs((1, 2), 0, 1.0)
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(lp, ref, "k4")


def test_fixed_controller_never_moves():
    """FixedKLController returns its coefficient whatever the KL."""
    c = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0, float("nan")):
        assert c.update(kl, 128) == 0.05
    assert c.value == 0.05


# The controllers are a few float64 (Python float) operations on scalars: rel=1e-12 is far
# above their rounding (~4·2^-53 relative) and far below any wrong step (1e-4 and more).


def test_adaptive_controller_hand_computed_updates():
    """k ← k·(1 + clip(KL/target - 1, ±0.2)·n/horizon), checked against hand arithmetic."""
    c = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    # KL 6.6: e = 0.1, n/h = 0.01 → 0.1 · 1.001
    assert c.update(6.6, 100) == pytest.approx(0.1001, rel=1e-12)
    # KL 6.0: e = 0 → unchanged
    assert c.update(6.0, 500) == pytest.approx(0.1001, rel=1e-12)
    # KL 4.8: e = -0.2 (exactly at the clip), n/h = 0.05 → 0.1001 · 0.99
    assert c.update(4.8, 500) == pytest.approx(0.099099, rel=1e-12)
    assert c.value == pytest.approx(0.099099, rel=1e-12)


@pytest.mark.parametrize("kl, factor", [(60.0, 1.02), (7.3, 1.02), (0.0, 0.98), (-5.0, 0.98)])
def test_adaptive_controller_clips_error(kl, factor):
    """Errors beyond ±0.2 are clipped: with n/h = 0.1 the coefficient moves by at most 2%."""
    c = AdaptiveKLController(init_coef=0.5, target=6.0, horizon=1000)
    assert c.update(kl, 100) == pytest.approx(0.5 * factor, rel=1e-12)


@pytest.mark.parametrize("kl", [float("nan"), float("inf"), -float("inf")])
def test_adaptive_controller_ignores_nonfinite_kl(kl):
    """A NaN or infinite KL measurement leaves the coefficient unchanged."""
    c = AdaptiveKLController(init_coef=0.2, target=1.0, horizon=100)
    c.update(1.1, 10)  # 0.2 · (1 + 0.1 · 0.1) = 0.202
    assert c.update(kl, 10) == pytest.approx(0.202, rel=1e-12)
    assert c.value == pytest.approx(0.202, rel=1e-12)


@pytest.mark.parametrize("target, horizon", [(0.0, 10), (-1.0, 10), (float("nan"), 10),
                                             (float("inf"), 10), (1.0, 0), (1.0, -5),
                                             (1.0, float("nan"))])
def test_adaptive_controller_rejects_bad_settings(target, horizon):
    """Target and horizon must be finite and positive."""
    with pytest.raises(ValueError):
        AdaptiveKLController(init_coef=0.1, target=target, horizon=horizon)


@pytest.mark.parametrize("kl", [0.0, 100.0])
def test_adaptive_controller_step_fraction_capped(kl):
    """More samples than the horizon in one update: k moves by at most ±20% and stays
    positive (uncapped, KL 0 with n/h = 12.8 would make it negative)."""
    c = AdaptiveKLController(init_coef=0.05, target=6.0, horizon=10)
    value = c.update(kl, 128)
    assert value == pytest.approx(0.05 * (0.8 if kl == 0 else 1.2), rel=1e-12)
    for _ in range(50):
        value = c.update(kl, 128)
    assert value > 0
