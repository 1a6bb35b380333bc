"""Rollout mismatch correction against a naive float64 loop written from docs/algorithms.md
§3.8, with tolerances from a float32 (float64) error bound rather than from measured errors.

The error bound (``naive`` computes it next to each value). ``u`` is the unit roundoff of
the compute dtype (2^-24 for float32, 2^-53 for float64); the inputs are exact in it, and the
reference reads the same values in float64 (its own rounding is added: ``naive``'s ``u``).
- ``Δ = ℓ^old - ℓ^beh`` is one rounding: ``|Δ̂ - Δ| ≤ u|Δ|``; the clamp to ±20 is
  1-Lipschitz, so the clamped log-ratio ``δ`` is off by at most ``e_δ = u·min(|Δ|, 21)``.
- torch's ``exp`` is within 2 ulp (Sleef u10 and glibc on CPU, CUDA's ``expf``), i.e. a
  relative ``4u``; so ``|κ̂ - κ| ≤ κ(exp(e_δ)(1 + 4u) - 1)``.
- A cap or band bound given as a Python float is rounded to the dtype: ``u·C``.
- A sum of ``N`` terms (any order) is off by at most ``γ_N Σ|x|``, ``γ_N = Nu/(1 - Nu)``;
  a sequence sum runs over the ``T`` columns of its row, a masked mean over all ``B·T``
  entries (masked ones are exact zeros), and its division adds ``u`` relative.
- Counts are exact integers, so a fraction is off by ``u`` relative once every keep /
  reject / truncate decision agrees with the reference. ``naive`` checks that each
  decision's statistic is farther from its threshold than its error bound
  (``decisions_clear``); a test asserts it, so a verdict never depends on rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from masks import SHAPES, random_mask

from posttrain.core import CORRECTIONS, Correction, correction_weights
from posttrain.core.correction import DEFAULT_BOUNDS

DTYPES = [torch.float32, torch.float64]
U = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
EXP_REL = 4.0  # exp within 2 ulp = 4u relative
CLAMP = 20.0
KEYS = ["gap_mean", "gap_max", "prob_error", "weight_mean", "weight_min", "weight_max",
        "truncated_frac", "masked_frac", "nonfinite"]

# every mode with its defaults, and with bounds that make the random inputs hit both sides
CASES = [
    Correction("none"),
    Correction("token_truncate"),
    Correction("token_truncate", high=1.5),
    Correction("token_mask"),
    Correction("token_mask", 0.8, 1.25),
    Correction("icepop"),
    Correction("icepop", 0.8, 2.0),
    Correction("sequence_truncate"),
    Correction("sequence_truncate", high=1.2),
    Correction("sequence_mask"),
    Correction("sequence_mask", 0.7, 1.4),
]


def _gamma(n: int, u: float) -> float:
    return n * u / (1.0 - n * u)


def _exp_err(value: float, arg_err: float, u: float) -> float:
    """Bound on |exp(x̂) - exp(x)| given |x̂ - x| ≤ arg_err and exp's own rounding."""
    return value * (math.exp(arg_err) * (1.0 + EXP_REL * u) - 1.0)


def _clamp(x: float) -> float:
    return min(max(x, -CLAMP), CLAMP)


@dataclass
class Reference:
    weights: torch.Tensor          # (B, T) float64
    weight_err: torch.Tensor       # (B, T) bound on |computed - reference|
    metrics: dict[str, float]
    bounds: dict[str, float]
    decisions_clear: bool


def naive(old, beh, mask, corr: Correction) -> Reference:
    """The weights and metrics of §3.8 token by token in float64, with their error bounds."""
    dtype = torch.float64 if torch.float64 in (old.dtype, beh.dtype) else torch.float32
    # the reference's own float64 rounding adds to the computed one's: every bound is first
    # order in u, so bounding with the sum of both unit roundoffs covers the two together
    u, biggest = U[dtype] + U[torch.float64], torch.finfo(dtype).max
    B, T = mask.shape
    o, b, m = old.double().tolist(), beh.double().tolist(), mask.bool().tolist()
    mode, lo, hi = corr.mode, corr.low, corr.high
    W = torch.zeros(B, T, dtype=torch.float64)
    E = torch.zeros(B, T, dtype=torch.float64)
    clear = True

    def decide(stat: float, err: float, threshold: float) -> None:
        nonlocal clear
        if abs(stat - threshold) <= err + u * threshold:
            clear = False

    # per token: clamped log-ratio δ, ratio κ, their bounds; None where Δ is not finite
    tok = {}
    for i in range(B):
        for t in range(T):
            if not m[i][t]:
                continue
            d = o[i][t] - b[i][t]
            if not (math.isfinite(d) and abs(d) <= biggest):  # the dtype's Δ overflows too
                tok[i, t] = None
                continue
            delta, e_delta = _clamp(d), u * min(abs(d), CLAMP + 1.0)
            kappa = math.exp(delta)
            tok[i, t] = (delta, e_delta, kappa, _exp_err(kappa, e_delta, u))

    truncated = masked = broken = 0
    for i in range(B):
        cols = [t for t in range(T) if m[i][t]]
        if mode in ("sequence_truncate", "sequence_mask"):
            if not cols or any(tok[i, t] is None for t in cols):
                masked += sum(tok[i, t] is not None for t in cols)
                broken += sum(tok[i, t] is None for t in cols)
                continue
            s_sum = sum(tok[i, t][0] for t in cols)
            e_sum = (sum(tok[i, t][1] for t in cols)
                     + _gamma(T, u) * sum(abs(tok[i, t][0]) + tok[i, t][1] for t in cols))
            if mode == "sequence_truncate":
                s = math.exp(_clamp(s_sum))
                e_s = _exp_err(s, e_sum, u)
                decide(s, e_s, hi)
                w, e_w = min(s, hi), e_s + u * hi
                truncated += len(cols) * (s > hi)
            else:
                n_i = len(cols)
                mean, e_mean = s_sum / n_i, e_sum / n_i + u * (abs(s_sum) + e_sum) / n_i
                g = math.exp(_clamp(mean))
                e_g = _exp_err(g, e_mean, u)
                decide(g, e_g, lo)
                decide(g, e_g, hi)
                keep = lo <= g <= hi
                w, e_w = float(keep), 0.0
                masked += len(cols) * (not keep)
            for t in cols:
                W[i, t], E[i, t] = w, e_w
            continue
        for t in cols:
            if tok[i, t] is None:
                broken += 1
                W[i, t] = 1.0 if mode == "none" else 0.0
                continue
            _, _, kappa, e_kappa = tok[i, t]
            if mode == "none":
                W[i, t] = 1.0
            elif mode == "token_truncate":
                decide(kappa, e_kappa, hi)
                W[i, t], E[i, t] = min(kappa, hi), e_kappa + u * hi
                truncated += kappa > hi
            else:
                decide(kappa, e_kappa, lo)
                decide(kappa, e_kappa, hi)
                keep = lo <= kappa <= hi
                masked += not keep
                if keep:
                    W[i, t], E[i, t] = (1.0, 0.0) if mode == "token_mask" else (kappa, e_kappa)

    n, N = sum(map(sum, m)), B * T
    finite = [v for v in tok.values() if v is not None]
    everything = [(i, t) for (i, t) in tok]

    def mean(terms, errs):
        if n == 0:
            return 0.0, 0.0
        hi_sum = sum(map(abs, terms)) + sum(errs)
        bound = sum(errs) + _gamma(N, u) * hi_sum + u * hi_sum * (1.0 + _gamma(N, u))
        return sum(terms) / n, bound / n

    def frac(count):
        return (count / n, 2 * u * count / n) if n else (0.0, 0.0)

    metrics, bounds = {}, {}
    metrics["gap_mean"], bounds["gap_mean"] = mean([abs(v[0]) for v in finite],
                                                   [v[1] for v in finite])
    metrics["gap_max"] = max((abs(v[0]) for v in finite), default=0.0)
    bounds["gap_max"] = max((v[1] for v in finite), default=0.0)
    metrics["prob_error"], bounds["prob_error"] = mean(
        [abs(v[2] - 1.0) for v in finite],
        [v[3] + u * (abs(v[2] - 1.0) + v[3]) for v in finite])
    ws = [float(W[i, t]) for i, t in everything]
    es = [float(E[i, t]) for i, t in everything]
    metrics["weight_mean"], bounds["weight_mean"] = mean(ws, es)
    metrics["weight_min"], metrics["weight_max"] = min(ws, default=0.0), max(ws, default=0.0)
    bounds["weight_min"] = bounds["weight_max"] = max(es, default=0.0)
    metrics["truncated_frac"], bounds["truncated_frac"] = frac(truncated)
    metrics["masked_frac"], bounds["masked_frac"] = frac(masked)
    metrics["nonfinite"], bounds["nonfinite"] = frac(broken)
    return Reference(W, E, metrics, bounds, clear)


def assert_matches(weights, metrics, ref: Reference):
    assert ref.decisions_clear, "test data sits within rounding of a threshold: change it"
    assert torch.isfinite(weights).all()
    assert ((weights.double() - ref.weights).abs() <= ref.weight_err).all()
    assert sorted(metrics) == sorted(f"rollout_corr/{k}" for k in KEYS)
    for k in KEYS:
        got = float(metrics[f"rollout_corr/{k}"])
        assert math.isfinite(got), k
        assert abs(got - ref.metrics[k]) <= ref.bounds[k], (k, got, ref.metrics[k], ref.bounds[k])


def inputs(B, T, gen, dtype, spread=0.8, holes=False):
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    beh = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    return old.to(dtype), beh.to(dtype), random_mask(B, T, gen, holes=holes,
                                                     first_row_nonempty=True)


def _label(c: Correction) -> str:
    return f"{c.mode}-{c.low}-{c.high}"


# --- against the naive reference -------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("corr", CASES, ids=_label)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("holes", [False, True])
def test_matches_naive_on_random_inputs(shape, corr, dtype, holes):
    """Weights and every metric equal the token-by-token formula within the error bound,
    with garbage (inf, NaN) at masked positions that must not matter."""
    gen = torch.Generator().manual_seed(shape[0] * 131 + shape[1] + holes)
    old, beh, mask = inputs(*shape, gen, dtype, holes=holes)
    beh = torch.where(mask, beh, torch.full_like(beh, float("nan")))
    old = torch.where(mask, old, torch.full_like(old, float("-inf")))
    weights, metrics = correction_weights(old, beh, mask, corr)
    assert weights.dtype == dtype and weights.shape == shape
    assert (weights[~mask] == 0).all()
    assert_matches(weights, metrics, naive(old, beh, mask, corr))


@pytest.mark.parametrize("corr", CASES, ids=_label)
def test_every_mode_acts_on_random_inputs(corr):
    """The random case is not trivial: the cap lowers some weights and leaves others, each
    band keeps some tokens and rejects others, icepop keeps ratios (not ones), a sequence
    weight is one value per row, and no-correction returns the mask."""
    gen = torch.Generator().manual_seed(7)
    old, beh, mask = inputs(16, 24, gen, torch.float32, holes=True)
    weights, metrics = correction_weights(old, beh, mask, corr)
    assert_matches(weights, metrics, naive(old, beh, mask, corr))
    ratio = torch.exp((old - beh).clamp(-20, 20))
    kept = weights[mask]
    trunc, rej = (float(metrics[f"rollout_corr/{k}"]) for k in ("truncated_frac", "masked_frac"))
    if corr.mode == "none":
        assert torch.equal(weights, mask.float())
    if corr.mode in ("token_truncate", "sequence_truncate"):
        assert 0 < trunc < 1 and rej == 0
        assert ((kept - corr.high).abs() < 1e-6).any()                               # capped
        assert ((kept < corr.high * (1 - 1e-3)) & ((kept - 1).abs() > 1e-3)).any()  # and not
    if corr.mode == "token_truncate":
        capped = mask & (ratio > corr.high)
        assert capped.any() and (weights[capped] < ratio[capped]).all()
    if corr.mode in ("token_mask", "sequence_mask", "icepop"):
        assert trunc == 0
        if corr != Correction("sequence_mask"):  # the default geometric band is ±0.1%
            assert 0 < rej < 1
        else:
            assert rej == 1  # spread 0.8 per token is far outside it: every row rejected
    if corr.mode in ("token_mask", "sequence_mask"):
        assert set(kept.unique().tolist()) <= {0.0, 1.0}
    if corr.mode == "icepop":
        nonzero = kept[kept > 0]
        assert ((nonzero - 1).abs() > 0.1).any()
        assert (nonzero >= corr.low).all() and (nonzero <= corr.high).all()
    if corr.mode.startswith("sequence"):
        for i in range(mask.shape[0]):
            row = weights[i][mask[i]]
            assert (row == row[0]).all() if row.numel() else True


def test_token_modes_by_hand():
    """κ = (0.25, 0.6, 1, 2, 4), one extra masked token: TIS caps 4 at 3; the token mask
    [1/3, 3] rejects 0.25 and 4 and keeps ones; icepop [0.5, 5] rejects 0.25 and keeps the
    ratios themselves."""
    kappa = torch.tensor([[0.25, 0.6, 1.0, 2.0, 4.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    beh = torch.full_like(kappa, -1.0)
    old = beh + kappa.log()
    want = {
        "token_truncate": ([0.25, 0.6, 1.0, 2.0, 3.0, 0.0], 1 / 5, 0.0),
        "token_mask": ([0.0, 1.0, 1.0, 1.0, 0.0, 0.0], 0.0, 2 / 5),
        "icepop": ([0.0, 0.6, 1.0, 2.0, 4.0, 0.0], 0.0, 1 / 5),
    }
    for mode, (w, trunc, rej) in want.items():
        weights, m = correction_weights(old, beh, mask, Correction(mode))
        torch.testing.assert_close(weights, torch.tensor([w], dtype=torch.float64))
        assert float(m["rollout_corr/truncated_frac"]) == pytest.approx(trunc)
        assert float(m["rollout_corr/masked_frac"]) == pytest.approx(rej)
        assert float(m["rollout_corr/weight_mean"]) == pytest.approx(sum(w) / 5)
    gaps = [abs(math.log(k)) for k in (0.25, 0.6, 1.0, 2.0, 4.0)]
    assert float(m["rollout_corr/gap_mean"]) == pytest.approx(sum(gaps) / 5)
    assert float(m["rollout_corr/gap_max"]) == pytest.approx(math.log(4.0))
    assert float(m["rollout_corr/prob_error"]) == pytest.approx((0.75 + 0.4 + 0 + 1 + 3) / 5)


def test_sequence_modes_by_hand():
    """Row 0: κ = (2, 2, 2): product 8 (capped at 3), geometric mean 2 (outside [0.5, 1.5]).
    Row 1: κ = (1.2, 1/1.2, e^0.1): product e^0.1, geometric mean e^(0.1/3), both inside.
    The product is what truncation uses, the geometric mean what the mask uses."""
    log_k = torch.tensor([[math.log(2)] * 3, [math.log(1.2), -math.log(1.2), 0.1]],
                         dtype=torch.float64)
    beh = torch.full_like(log_k, -2.0)
    old, mask = beh + log_k, torch.ones(2, 3, dtype=torch.bool)
    weights, m = correction_weights(old, beh, mask, Correction("sequence_truncate"))
    torch.testing.assert_close(weights, torch.tensor([[3.0] * 3, [math.exp(0.1)] * 3],
                                                     dtype=torch.float64))
    assert float(m["rollout_corr/truncated_frac"]) == pytest.approx(0.5)
    weights, m = correction_weights(old, beh, mask, Correction("sequence_mask", 0.5, 1.5))
    torch.testing.assert_close(weights, torch.tensor([[0.0] * 3, [1.0] * 3],
                                                     dtype=torch.float64))
    assert float(m["rollout_corr/masked_frac"]) == pytest.approx(0.5)


# --- extreme inputs --------------------------------------------------------------------------

def extreme_batch(dtype):
    """Ratios of e^±30 (beyond the clamp) and e^±19.5 (inside it), a -inf and a NaN
    behaviour log-prob on unmasked tokens, a NaN old log-prob, a difference that overflows
    float32, garbage on masked tokens, an all-masked row and a clean row."""
    inf, nan = float("inf"), float("nan")
    old = torch.tensor([
        [0.0, 0.0, -1.0, -1.0, -2.0],
        [-1.0, -1.0, nan, -1.0, -0.5],
        [inf, nan, -inf, 1.0, 0.0],
        [3e38, -1.0, -1.0, -1.0, -1.0],
        [-1.0, -1.2, -0.8, -1.1, -0.9],
    ], dtype=torch.float64)
    beh = torch.tensor([
        [-30.0, 30.0, -20.5, 18.5, -2.0],
        [-inf, -1.1, -1.0, nan, -0.4],
        [nan, inf, -inf, -inf, 5.0],
        [-3e38, -1.1, -0.9, -1.0, -1.05],
        [-1.05, -1.1, -0.85, -1.0, -1.0],
    ], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 1], [0, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    return old.to(dtype), beh.to(dtype), mask


@pytest.mark.parametrize("mode", CORRECTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_inputs_stay_finite_and_match(mode, dtype):
    """Nothing non-finite leaks into weights or metrics; a non-finite token gets weight 0 and
    is counted (in a sequence mode its whole row is dropped); masked garbage is ignored."""
    old, beh, mask = extreme_batch(dtype)
    corr = Correction(mode)
    weights, metrics = correction_weights(old, beh, mask, corr)
    assert_matches(weights, metrics, naive(old, beh, mask, corr))
    # unmasked tokens with a non-finite Δ: (1, 0), (1, 2), and (3, 0) in float32 only
    broken = 3 if dtype == torch.float32 else 2
    n = int(mask.sum())
    assert float(metrics["rollout_corr/nonfinite"]) == pytest.approx(broken / n)
    assert (weights[2] == 0).all()
    if mode != "none":
        assert weights[1, 0] == 0 and weights[1, 2] == 0
    if mode.startswith("sequence"):
        assert (weights[1] == 0).all()
    if mode == "token_truncate":
        assert weights[0, 0] == pytest.approx(3.0) and weights[0, 1] == pytest.approx(
            math.exp(-20.0), rel=1e-5)
    if mode in ("token_mask", "icepop"):
        assert (weights[0, :4] == 0).all() and weights[0, 4] == 1.0


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("mode", CORRECTIONS)
def test_empty_batch_gives_zero_metrics(shape, mode):
    old = torch.zeros(shape)
    weights, metrics = correction_weights(old, old, torch.zeros(shape, dtype=torch.bool),
                                          Correction(mode))
    assert weights.shape == shape
    assert all(float(v) == 0.0 for v in metrics.values())


@pytest.mark.parametrize("mode", CORRECTIONS)
def test_all_masked_batch_gives_zeros(mode):
    gen = torch.Generator().manual_seed(3)
    old, beh, _ = inputs(4, 6, gen, torch.float32)
    beh[0, 0] = float("-inf")
    weights, metrics = correction_weights(old, beh, torch.zeros(4, 6), Correction(mode))
    assert (weights == 0).all()
    assert all(float(v) == 0.0 for v in metrics.values())


# --- properties ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [c for c in CORRECTIONS if c != "none"])
def test_zero_weights_are_masked_or_nonfinite(mode):
    """Every κ is ≥ e^-20 > 0, so a kept token's weight is positive: the share of zero
    weights is exactly masked_frac + nonfinite."""
    gen = torch.Generator().manual_seed(11)
    old, beh, mask = inputs(12, 10, gen, torch.float32, holes=True)
    rows, cols = mask.nonzero(as_tuple=True)
    beh[rows[::9], cols[::9]] = float("-inf")  # a few unmasked tokens the sampler calls impossible
    beh[~mask] = float("nan")
    corr = Correction(mode) if mode != "sequence_mask" else Correction(mode, 0.7, 1.4)
    weights, m = correction_weights(old, beh, mask, corr)
    zero_share = float((weights[mask] == 0).double().mean())
    assert float(m["rollout_corr/nonfinite"]) > 0
    assert zero_share == pytest.approx(float(m["rollout_corr/masked_frac"])
                                       + float(m["rollout_corr/nonfinite"]), abs=1e-6)


@pytest.mark.parametrize("corr", CASES, ids=_label)
def test_micro_batches_combine_to_the_whole_batch(corr):
    """Rows split into micro-batches: weights are the rows' weights, token-weighted means of
    the micro-batch means and min/max of the _min/_max keys (empty micro-batches skipped)
    give the whole batch's metrics. float64; the tolerance adds the micro-batch bounds and
    the combination's own rounding (≤ 4u per micro-batch, relative)."""
    gen = torch.Generator().manual_seed(5)
    old, beh, mask = inputs(10, 9, gen, torch.float64, holes=True)
    whole_w, whole = correction_weights(old, beh, mask, corr)
    ref = naive(old, beh, mask, corr)
    parts = [slice(0, 1), slice(1, 5), slice(5, 6), slice(6, 10)]
    counts, outs, bounds = [], [], []
    for s in parts:
        w, m = correction_weights(old[s], beh[s], mask[s], corr)
        assert ((w - whole_w[s]).abs() <= 2 * ref.weight_err[s]).all()
        counts.append(int(mask[s].sum()))
        outs.append(m)
        bounds.append(naive(old[s], beh[s], mask[s], corr).bounds)
    assert 0 in counts  # random_mask empties the middle row: an empty micro-batch is included
    n, u = sum(counts), U[torch.float64]
    for k in KEYS:
        key = f"rollout_corr/{k}"
        live = [(c, float(m[key]), b[k]) for c, m, b in zip(counts, outs, bounds, strict=True)
                if c]
        if k.endswith(("_min", "_max")):
            combined = (min if k.endswith("_min") else max)(v for _, v, _ in live)
            tol = max(b for _, _, b in live)
        else:
            combined = sum(c * v for c, v, _ in live) / n
            tol = sum(c * b for c, _, b in live) / n + 4 * len(live) * u * abs(combined)
        assert abs(combined - float(whole[key])) <= tol + ref.bounds[k], k


def test_weights_carry_no_gradient():
    """Inputs that require grad give detached weights and metrics, and are left unchanged."""
    gen = torch.Generator().manual_seed(2)
    old, beh, mask = inputs(3, 4, gen, torch.float64)
    old.requires_grad_(True)
    beh.requires_grad_(True)
    before = (old.detach().clone(), beh.detach().clone())
    with torch.enable_grad():
        for mode in CORRECTIONS:
            weights, metrics = correction_weights(old * 1.0, beh, mask, Correction(mode))
            assert not weights.requires_grad and weights.grad_fn is None
            assert not any(v.requires_grad for v in metrics.values())
    assert torch.equal(old.detach(), before[0]) and torch.equal(beh.detach(), before[1])


def test_bfloat16_inputs_compute_in_float32():
    gen = torch.Generator().manual_seed(4)
    old, beh, mask = inputs(4, 7, gen, torch.float32)
    old16, beh16 = old.bfloat16(), beh.bfloat16()
    corr = Correction("icepop")
    weights, metrics = correction_weights(old16, beh16, mask, corr)
    assert weights.dtype == torch.float32
    assert_matches(weights, metrics, naive(old16.float(), beh16.float(), mask, corr))


def test_icepop_with_a_vanishing_lower_bound_is_trls_token_mask():
    """TRL's token_mask keeps κ·1[κ ≤ C] (no lower bound); κ ≥ e^-20 ≈ 2.1e-9 after the
    clamp, so icepop with low = 1e-9 is exactly that."""
    gen = torch.Generator().manual_seed(9)
    old, beh, mask = inputs(6, 8, gen, torch.float64, spread=1.5)
    old[0, 0], beh[0, 0], mask[0, 0] = 0.0, 25.0, True   # κ = e^-25, clamped to e^-20
    weights, _ = correction_weights(old, beh, mask, Correction("icepop", 1e-9, 3.0))
    ratio = torch.exp((old - beh).clamp(-20, 20))
    assert torch.equal(weights, torch.where(mask & (ratio <= 3.0), ratio, 0.0))


# --- configuration ---------------------------------------------------------------------------

def test_defaults_fill_in_and_validate():
    for mode in CORRECTIONS:
        corr = Correction(mode)
        assert (corr.low, corr.high) == DEFAULT_BOUNDS[mode]
        corr.validate()
    assert (Correction("icepop").low, Correction("icepop").high) == (0.5, 5.0)
    assert Correction("token_mask", high=4.0).low == pytest.approx(1 / 3)
    with pytest.raises(AttributeError):
        Correction().mode = "icepop"  # frozen


@pytest.mark.parametrize("corr, words", [
    (Correction("tis"), "unknown rollout correction"),
    (Correction("token_truncate", high=0.9), ">= 1"),
    (Correction("sequence_truncate", high=0.0), ">= 1"),
    (Correction("token_truncate", low=0.5), "leave low unset"),
    (Correction("token_mask", 0.0, 2.0), "low must be > 0"),
    (Correction("icepop", -0.5, 5.0), "low must be > 0"),
    (Correction("icepop", 2.0, 2.0), "low must be < high"),
    (Correction("sequence_mask", 1.01, 1.02), "must contain 1"),
    (Correction("token_mask", 0.2, 0.9), "must contain 1"),
    (Correction("icepop", 0.5, float("inf")), "finite number"),
    (Correction("token_truncate", high=float("nan")), "finite number"),
    (Correction("token_mask", True, 3.0), "finite number"),
])
def test_invalid_configurations_raise_one_line(corr, words):
    with pytest.raises(ValueError, match=words) as info:
        corr.validate()
    assert "\n" not in str(info.value)
    old = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=words):
        correction_weights(old, old, torch.ones(1, 2), corr)


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="one shape"):
        correction_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3),
                           Correction("icepop"))
