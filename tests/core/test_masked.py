"""Masked reductions against plain float64 Python loops over the unmasked entries."""

from __future__ import annotations

import math

import pytest
import torch

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


def _tol(dtype):
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 1e-12, "atol": 1e-12}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_count_mean_over_everything(shape, dtype):
    """masked_sum/count/mean over all dims equal the loop over the kept entries."""
    for seed in range(3):
        x, mask = _data(shape, seed, dtype)
        vals = _kept(x, mask)
        s = masked_sum(x, mask)
        assert s.dtype == dtype
        assert math.isclose(float(s), sum(vals), rel_tol=_tol(dtype)["rtol"], abs_tol=1e-5)
        assert float(masked_count(mask)) == len(vals)
        expect_mean = sum(vals) / len(vals) if vals else 0.0
        assert math.isclose(float(masked_mean(x, mask)), expect_mean,
                            rel_tol=_tol(dtype)["rtol"], abs_tol=1e-5)


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
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in rest]).reshape(-1, len(rest)):
        idx = tuple(idx.tolist())
        vals = [float(xs[(k, *idx)]) for k in range(xs.shape[0]) if ms[(k, *idx)]]
        expect_sum[idx] = sum(vals)
        expect_cnt[idx] = len(vals)
        expect_mean[idx] = sum(vals) / len(vals) if vals else 0.0
    torch.testing.assert_close(masked_sum(x, mask, dim), expect_sum)
    torch.testing.assert_close(masked_count(mask, dim), expect_cnt)
    torch.testing.assert_close(masked_mean(x, mask, dim), expect_mean)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unbiased", [True, False])
def test_var_matches_textbook(shape, dtype, unbiased):
    """masked_var is Σ(x-mean)²/(n-1) (or /n) over the kept entries; too few entries give 0."""
    for seed in range(3):
        x, mask = _data(shape, 100 + seed, dtype)
        expect = _naive_var(_kept(x, mask), unbiased)
        got = masked_var(x, mask, unbiased=unbiased)
        assert math.isclose(float(got), expect, rel_tol=_tol(dtype)["rtol"], abs_tol=1e-5)


def test_var_with_one_or_two_entries():
    """One entry: unbiased 0 (not NaN), population 0; two entries: hand-computed values."""
    x = torch.tensor([[3.0, 5.0, 100.0]])
    one = torch.tensor([[True, False, False]])
    two = torch.tensor([[True, True, False]])
    assert float(masked_var(x, one, unbiased=True)) == 0.0
    assert float(masked_var(x, one, unbiased=False)) == 0.0
    assert float(masked_var(x, two, unbiased=True)) == pytest.approx(2.0)  # (1 + 1) / 1
    assert float(masked_var(x, two, unbiased=False)) == pytest.approx(1.0)  # (1 + 1) / 2


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
        tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
        torch.testing.assert_close(got.double(), expect, **tol)


def test_whiten_gives_unit_variance():
    """Whitened kept entries have mean 0 and population variance 1 (independent check)."""
    x, mask = _data((4, 9), 7)
    w = masked_whiten(x, mask)
    vals = _kept(w, mask)
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
    torch.testing.assert_close(x.grad, expect)
