"""Masked reductions against plain float64 Python loops over the unmasked entries."""

from __future__ import annotations

import math

import pytest
import torch

from bounds import assert_within, moment_errors, unit_roundoff
from posttrain.core.masked import (
    masked_count,
    masked_mean,
    masked_min_max,
    masked_sum,
    masked_var,
    masked_whiten,
)

SHAPES = [(1, 1), (1, 6), (3, 7), (5, 2), (2, 3, 4)]
DTYPES = [torch.float32, torch.float64]


def _data(shape, seed, dtype=torch.float64, p_keep=0.6):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1).to(dtype)
    mask = torch.rand(shape, generator=g) < p_keep
    return x, mask


def _kept(x, mask):
    """The unmasked entries, as Python floats (in float64)."""
    pairs = zip(x.flatten().tolist(), mask.flatten().tolist(), strict=True)
    return [float(v) for v, m in pairs if m]


def _naive_var(vals, unbiased):
    n = len(vals)
    denom = n - 1 if unbiased else n
    if denom <= 0:
        return 0.0
    mean = sum(vals) / n
    return sum((v - mean) ** 2 for v in vals) / denom


# Error bounds derived from each reduction's arithmetic (tests/bounds.py), for the function in
# ``dtype`` against the float64 loop: the same arithmetic at both unit roundoffs, summed. Sums
# are bounded in any order ((k − 1)·u·Σ|x| over the k kept values; the zeros that stand for
# masked entries add exactly). The kept values are O(1)..10 and at most 24: the float32
# bounds are ≤ 5e-5 for sums, means and variances, so a 1% error (or one entry lost or let
# in) is far beyond them; the whitened values' are ≤ 2e-3, where one kept value meets
# r = eps^-½ = 1e4 (its mean's rounding bound times r), still 15 times below 1% of it.


def _stat_bounds(vals, dtype):
    """The error of masked_sum, masked_mean, masked_var (unbiased, population) over ``vals``
    computed in ``dtype``, plus the float64 loop's: the sum's (k − 1)·u·Σ|x|; the mean's, the
    centring's and Σc²'s (bounds.moment_errors); the variance Σc²'s error over the divisor
    and the division's u·var."""
    x = torch.tensor(vals, dtype=torch.float64)
    k = len(vals)
    out = dict.fromkeys(("sum", "mean", "var", "var_pop"), 0.0)
    if k == 0:
        return out
    for dt in (dtype, torch.float64):
        u = unit_roundoff(dt)
        out["sum"] += (k - 1) * u * float(x.abs().sum())
        _, _, e_mean, _, sumsq, e_sumsq = moment_errors(x, dt)
        out["mean"] += e_mean
        for key, denom in (("var", k - 1), ("var_pop", k)):
            if denom > 0:
                out[key] += e_sumsq / denom + u * sumsq / denom
    return out


def _whiten_bound(vals, dtype, shift_mean, eps):
    """Per kept value, masked_whiten's error in ``dtype`` plus the float64 loop's: the centred
    value's (bounds.moment_errors) times r = (var + eps)^-½; r's relative error, half that of
    var + eps (Σc²'s over k, u·var and the sum's u) plus 2u (sqrt and reciprocal), times
    |c·r|; the product's u·|c·r|; without shift the mean's error and the sum's u·|w|."""
    x = torch.tensor(vals, dtype=torch.float64)
    k = len(vals)
    total = torch.zeros(k, dtype=torch.float64)
    for dt in (dtype, torch.float64):
        u = unit_roundoff(dt)
        mean, c, e_mean, e_c, sumsq, e_sumsq = moment_errors(x, dt)
        var = sumsq / k
        r = 1 / math.sqrt(var + eps)
        rel_r = (e_sumsq / k + u * var + u * (var + eps)) / (2 * (var + eps)) + 2 * u
        w = c * r
        total += e_c * r + w.abs() * (rel_r + u)
        if not shift_mean:
            total += e_mean + u * (w + mean).abs()
    return total


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_count_mean_over_everything(shape, dtype):
    """masked_sum/count/mean over all dims equal the loop over the kept entries."""
    for seed in range(3):
        x, mask = _data(shape, seed, dtype)
        vals = _kept(x, mask)
        s = masked_sum(x, mask)
        assert s.dtype == dtype
        bound = _stat_bounds(vals, dtype)
        assert abs(float(s) - sum(vals)) <= bound["sum"]
        assert float(masked_count(mask)) == len(vals)
        expect_mean = sum(vals) / len(vals) if vals else 0.0
        assert abs(float(masked_mean(x, mask)) - expect_mean) <= bound["mean"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dim", [0, -1])
def test_sum_count_mean_along_dim(shape, dim):
    """With ``dim``, each slice is reduced on its own; an empty slice gives mean 0."""
    x, mask = _data(shape, 11 + len(shape), p_keep=0.4)
    xs, ms = x.movedim(dim, 0), mask.movedim(dim, 0)  # reduce over the leading axis
    rest = xs.shape[1:]
    expect_sum = torch.zeros(rest, dtype=torch.float64)
    expect_cnt = torch.zeros(rest)
    expect_mean = torch.zeros(rest, dtype=torch.float64)
    bound_sum = torch.zeros(rest, dtype=torch.float64)
    bound_mean = torch.zeros(rest, dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in rest]).reshape(-1, len(rest)):
        idx = tuple(idx.tolist())
        vals = [float(xs[(k, *idx)]) for k in range(xs.shape[0]) if ms[(k, *idx)]]
        expect_sum[idx] = sum(vals)
        expect_cnt[idx] = len(vals)
        expect_mean[idx] = sum(vals) / len(vals) if vals else 0.0
        bound = _stat_bounds(vals, torch.float64)
        bound_sum[idx], bound_mean[idx] = bound["sum"], bound["mean"]
    assert_within(masked_sum(x, mask, dim), expect_sum, 1.0, bound_sum, "sum")
    assert torch.equal(masked_count(mask, dim), expect_cnt)  # integers: exact
    assert_within(masked_mean(x, mask, dim), expect_mean, 1.0, bound_mean, "mean")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unbiased", [True, False])
def test_var_matches_textbook(shape, dtype, unbiased):
    """masked_var is Σ(x-mean)²/(n-1) (or /n) over the kept entries; too few entries give 0."""
    for seed in range(3):
        x, mask = _data(shape, 100 + seed, dtype)
        vals = _kept(x, mask)
        expect = _naive_var(vals, unbiased)
        got = masked_var(x, mask, unbiased=unbiased)
        bound = _stat_bounds(vals, dtype)["var" if unbiased else "var_pop"]
        assert abs(float(got) - expect) <= bound, (float(got), expect, bound)


def test_var_with_one_or_two_entries():
    """One entry: unbiased 0 (not NaN), population 0; two entries: hand-computed values."""
    x = torch.tensor([[3.0, 5.0, 100.0]])
    one = torch.tensor([[True, False, False]])
    two = torch.tensor([[True, True, False]])
    assert float(masked_var(x, one, unbiased=True)) == 0.0
    assert float(masked_var(x, one, unbiased=False)) == 0.0
    # mean 4, squares 1: every step exact in float32
    assert float(masked_var(x, two, unbiased=True)) == 2.0  # (1 + 1) / 1
    assert float(masked_var(x, two, unbiased=False)) == 1.0  # (1 + 1) / 2


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_textbook(shape, dtype, shift_mean):
    """(x - mean)/sqrt(var_pop + eps) on kept entries (+ mean without shift), 0 elsewhere."""
    eps = 1e-8
    for seed in range(2):
        x, mask = _data(shape, 200 + seed, dtype)
        vals = _kept(x, mask)
        mean = sum(vals) / len(vals) if vals else 0.0
        scale = 1.0 / math.sqrt(_naive_var(vals, unbiased=False) + eps)
        flat = []
        for v, m in zip(x.flatten().tolist(), mask.flatten().tolist(), strict=True):
            w = (v - mean) * scale + (0.0 if shift_mean else mean)
            flat.append(w if m else 0.0)
        expect = torch.tensor(flat, dtype=torch.float64).view(shape)
        got = masked_whiten(x, mask, shift_mean=shift_mean, eps=eps)
        assert got.dtype == dtype
        bound = torch.zeros(shape, dtype=torch.float64)
        if vals:
            bound[mask] = _whiten_bound(vals, dtype, shift_mean, eps)
        assert_within(got, expect, 1.0, bound, f"shift_mean={shift_mean}")


def test_whiten_gives_unit_variance():
    """Whitened kept entries have mean 0 and population variance 1 (independent check)."""
    x, mask = _data((4, 9), 7)
    w = masked_whiten(x, mask)
    vals = _kept(w, mask)
    # float64 over ≤ 36 values: the rounding is ≲ 36·u64·max|x|/std ~ 1e-14 for the mean and
    # relative for the variance, which eps/var (~1e-9) moves too; an unwhitened or wrongly
    # centred batch is O(1) off
    assert sum(vals) / len(vals) == pytest.approx(0.0, abs=1e-12)
    assert _naive_var(vals, unbiased=False) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_min_max_matches_loop(shape):
    """masked_min_max returns min and max of the kept entries."""
    for seed in range(3):
        x, mask = _data(shape, 300 + seed, torch.float32)
        vals = _kept(x, mask)
        lo, hi = masked_min_max(x, mask)
        assert float(lo) == (min(vals) if vals else 0.0)
        assert float(hi) == (max(vals) if vals else 0.0)


def test_min_max_ignores_extreme_masked_values():
    """A huge or -inf value at a masked position is not the min or max."""
    x = torch.tensor([[1.0, -float("inf"), 2.0], [float("inf"), -5.0, 1e30]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    lo, hi = masked_min_max(x, mask)
    assert (float(lo), float(hi)) == (-5.0, 2.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_mask_gives_zero_not_nan(dtype):
    """An all-zero mask gives 0 for sum, count, mean, var, min/max and a zero whitened tensor."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, 0] = float("nan")
    mask = torch.zeros(3, 4, dtype=torch.bool)
    assert float(masked_sum(x, mask)) == 0.0
    assert float(masked_count(mask)) == 0.0
    assert float(masked_mean(x, mask)) == 0.0
    assert float(masked_var(x, mask)) == 0.0
    assert float(masked_var(x, mask, unbiased=False)) == 0.0
    assert torch.equal(masked_whiten(x, mask), torch.zeros_like(x))
    assert [float(v) for v in masked_min_max(x, mask)] == [0.0, 0.0]
    assert torch.equal(masked_mean(x, mask, dim=-1), torch.zeros(3, dtype=dtype))


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0,)])
def test_empty_tensor_gives_zero(shape):
    """A tensor with no elements is an empty mask too: min/max give 0 (amin/amax alone refuse
    an empty reduction), like the mean."""
    x, mask = torch.zeros(shape), torch.zeros(shape, dtype=torch.bool)
    assert [float(v) for v in masked_min_max(x, mask)] == [0.0, 0.0]
    assert float(masked_mean(x, mask)) == 0.0


def test_float_and_int_masks_act_like_bool():
    """A 0/1 float or int mask selects the same entries as the bool mask."""
    x, mask = _data((3, 5), 5)
    for other in (mask.float(), mask.long()):
        assert torch.equal(masked_sum(x, other), masked_sum(x, mask))
        assert torch.equal(masked_mean(x, other), masked_mean(x, mask))
        assert torch.equal(masked_var(x, other), masked_var(x, mask))
        assert torch.equal(masked_whiten(x, other), masked_whiten(x, mask))


def _poisoned(shape, seed, dtype):
    """x with inf, -inf and NaN planted at masked positions, plus the same x cleaned."""
    x, mask = _data(shape, seed, dtype, p_keep=0.5)
    mask = mask.clone()
    mask.view(-1)[:3] = False
    mask.view(-1)[3] = True
    bad = x.clone()
    bad.view(-1)[0], bad.view(-1)[1], bad.view(-1)[2] = float("inf"), -float("inf"), float("nan")
    clean = torch.where(mask, x, torch.zeros_like(x))
    return bad, clean, mask


REDUCTIONS = {
    "sum": lambda x, m: masked_sum(x, m),
    "sum_dim": lambda x, m: masked_sum(x, m, dim=-1),
    "mean": lambda x, m: masked_mean(x, m),
    "mean_dim": lambda x, m: masked_mean(x, m, dim=0),
    "var": lambda x, m: masked_var(x, m),
    "var_pop": lambda x, m: masked_var(x, m, unbiased=False),
    "whiten": lambda x, m: masked_whiten(x, m),
    "whiten_noshift": lambda x, m: masked_whiten(x, m, shift_mean=False),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_at_masked_positions_does_not_leak(name, dtype):
    """inf/NaN at masked positions change neither the value nor the gradient of the kept ones."""
    fn = REDUCTIONS[name]
    bad, clean, mask = _poisoned((4, 6), 42, dtype)
    bad.requires_grad_(True)
    clean.requires_grad_(True)
    w = torch.randn(fn(clean, mask).shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out_bad, out_clean = fn(bad, mask), fn(clean, mask)
    assert torch.isfinite(out_bad).all()
    torch.testing.assert_close(out_bad, out_clean, rtol=0, atol=0)
    (out_bad * w).sum().backward()
    (out_clean * w).sum().backward()
    assert torch.isfinite(bad.grad).all()
    torch.testing.assert_close(bad.grad, clean.grad, rtol=0, atol=0)
    assert torch.equal(bad.grad[~mask], torch.zeros_like(bad.grad[~mask]))


def test_masked_mean_gradient_is_mask_over_count():
    """d masked_mean / dx = m / Σm: kept entries share the gradient, masked ones get none."""
    x, mask = _data((3, 5), 9)
    x.requires_grad_(True)
    masked_mean(x, mask).backward()
    n = int(mask.sum())
    expect = torch.where(mask, torch.full_like(x, 1.0 / n), torch.zeros_like(x))
    # the backward divides the upstream 1 by the count, one rounding, as 1.0 / n: bitwise
    assert torch.equal(x.grad, expect)
