"""Property-based checks: finite inputs never give NaN or inf, in values or gradients."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.core.advantages import gae, group_advantages, rloo_advantages
from posttrain.core.aggregate import AGGREGATIONS, aggregate_loss
from posttrain.core.policy import gspo_loss, gspo_token_loss, ppo_clip_loss, value_loss

SETTINGS = settings(max_examples=60, deadline=None)


def floats(bound: float):
    return st.floats(-bound, bound, allow_nan=False, allow_infinity=False, width=32)


def tensor(draw, shape, bound: float) -> torch.Tensor:
    n = math.prod(shape)
    vals = draw(st.lists(floats(bound), min_size=n, max_size=n))
    return torch.tensor(vals, dtype=torch.float32).view(shape)


@st.composite
def shapes_and_masks(draw):
    """(B, T) and a mask: random bits, prompt/padding layout, all-empty, or all-full."""
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    kind = draw(st.sampled_from(["bits", "span", "empty", "full"]))
    if kind == "bits":
        bits = draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))
        mask = torch.tensor(bits).view(B, T)
    elif kind == "span":
        mask = torch.zeros(B, T, dtype=torch.bool)
        for i in range(B):
            start = draw(st.integers(0, T))
            mask[i, start:draw(st.integers(start, T))] = True
    else:
        mask = torch.full((B, T), kind == "full")
    return B, T, mask


def all_finite(*xs) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in xs)


@st.composite
def policy_case(draw):
    B, T, mask = draw(shapes_and_masks())
    lp = tensor(draw, (B, T), 1e4).requires_grad_(True)
    old = tensor(draw, (B, T), 1e4)
    adv_shape = draw(st.sampled_from([(B,), (B, T)]))
    adv = tensor(draw, adv_shape, 1e6)
    clip_low = draw(st.floats(0.0, 0.99))
    clip_high = draw(st.floats(0.0, 10.0))
    mode = draw(st.sampled_from(AGGREGATIONS))
    return lp, old, adv, mask, clip_low, clip_high, mode


def check_policy(fn, case, **kwargs):
    lp, old, adv, mask, clip_low, clip_high, mode = case
    loss, metrics = fn(lp, old, adv, mask, clip_low, clip_high, **kwargs)
    total = aggregate_loss(loss, mask, mode, constant=7.0)
    total.backward()
    assert all_finite(loss, total, lp.grad, *metrics.values())
    assert not loss[~mask].any()


@SETTINGS
@given(policy_case(), st.one_of(st.none(), st.floats(1.01, 10.0)))
def test_ppo_clip_loss_finite(case, dual):
    """ppo_clip_loss (with or without dual clip) is finite in value, metrics and gradient."""
    check_policy(ppo_clip_loss, case, dual_clip=dual)


@SETTINGS
@given(policy_case())
def test_gspo_loss_finite(case):
    """gspo_loss is finite in value, metrics and gradient."""
    check_policy(gspo_loss, case)


@SETTINGS
@given(policy_case())
def test_gspo_token_loss_finite(case):
    """gspo_token_loss is finite in value, metrics and gradient."""
    check_policy(gspo_token_loss, case)


@SETTINGS
@given(st.data(), shapes_and_masks(), st.one_of(st.none(), st.floats(0.0, 10.0)),
       st.sampled_from(AGGREGATIONS))
def test_value_loss_finite(data, shape_mask, clip, mode):
    """value_loss is finite in value, metrics and gradient for values/returns within ±1e6."""
    B, T, mask = shape_mask
    values = tensor(data.draw, (B, T), 1e6).requires_grad_(True)
    old_values = tensor(data.draw, (B, T), 1e6)
    returns = tensor(data.draw, (B, T), 1e6)
    loss, metrics = value_loss(values, old_values, returns, mask, clip)
    total = aggregate_loss(loss, mask, mode)
    total.backward()
    assert all_finite(loss, total, values.grad, *metrics.values())


@st.composite
def grouped_rewards(draw):
    n = draw(st.integers(1, 12))
    ids = torch.tensor(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)))
    if draw(st.booleans()):  # sometimes a group of identical rewards
        value = draw(floats(1e6))
        rewards = torch.full((n,), value, dtype=torch.float32)
    else:
        rewards = tensor(draw, (n,), 1e6)
    return rewards, ids


@SETTINGS
@given(grouped_rewards(), st.booleans())
def test_group_advantages_finite_and_bounded(case, scale):
    """Group advantages are finite; with the population std |A_i| ≤ √(G-1); all-equal
    groups give exactly 0."""
    rewards, ids = case
    adv = group_advantages(rewards, ids, scale_by_std=scale)
    assert all_finite(adv)
    for g in ids.unique():
        members = ids == g
        r = rewards[members]
        if bool((r == r[0]).all()):
            assert not adv[members].any()
        if scale:
            assert float(adv[members].abs().max()) <= math.sqrt(int(members.sum()) - 1) + 1e-3


@SETTINGS
@given(grouped_rewards())
def test_rloo_advantages_finite_and_centred(case):
    """RLOO advantages are finite and sum to ~0 within each group of two or more."""
    rewards, ids = case
    adv = rloo_advantages(rewards, ids)
    assert all_finite(adv)
    for g in ids.unique():
        members = ids == g
        scale = float(rewards[members].abs().max()) + 1.0
        assert abs(float(adv[members].double().sum())) <= 1e-5 * scale * int(members.sum())


@SETTINGS
@given(st.data(), shapes_and_masks(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_finite(data, shape_mask, gamma, lam):
    """GAE advantages and returns are finite and 0 at masked positions."""
    B, T, mask = shape_mask
    rewards = tensor(data.draw, (B, T), 1e6)
    values = tensor(data.draw, (B, T), 1e6)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    assert all_finite(adv, ret)
    assert not adv[~mask].any() and not ret[~mask].any()


@SETTINGS
@given(st.data(), shapes_and_masks(), st.sampled_from(AGGREGATIONS),
       st.one_of(st.none(), st.floats(0.0, 100.0)))
def test_aggregate_loss_finite(data, shape_mask, mode, normalizer):
    """aggregate_loss is finite in value and gradient for any mask (empty included) and any
    non-negative normaliser."""
    B, T, mask = shape_mask
    loss = tensor(data.draw, (B, T), 1e6).requires_grad_(True)
    out = aggregate_loss(loss, mask, mode, normalizer=normalizer, constant=3.0)
    out.backward()
    assert all_finite(out, loss.grad)
    if not mask.any():
        assert out.item() == 0.0
