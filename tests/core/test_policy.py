"""Policy and value losses against naive float64 implementations written from ALGORITHMS.md."""

from __future__ import annotations

import math

import pytest
import torch
from masks import SHAPES, random_mask

from posttrain.core.aggregate import aggregate_loss
from posttrain.core.policy import (
    explained_variance,
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
    value_loss,
)


def policy_inputs(B, T, gen, spread=0.4, per_token_adv=True):
    """float64 logprobs (leaf, requires grad), old logprobs, advantages, mask."""
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    lp = (old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread)
    lp.requires_grad_(True)
    shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return lp, old, adv, random_mask(B, T, gen, first_row_nonempty=True)


def tok_adv(adv, b, t):
    return float(adv[b, t]) if adv.dim() == 2 else float(adv[b])


# --- naive references ------------------------------------------------------------------------

def naive_ppo(lp, old, adv, mask, cl, ch, dual=None):
    """Per-token loss and d loss_t / d ℓ_t, plus clip counts, by the formula, token by token."""
    B, T = mask.shape
    loss = torch.zeros(B, T, dtype=torch.float64)
    grad = torch.zeros(B, T, dtype=torch.float64)
    n = n_low = n_high = n_dual = 0
    ratios = []
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            a = tok_adv(adv, b, t)
            rho = math.exp(float(lp[b, t]) - float(old[b, t]))
            ratios.append(rho)
            clipped_rho = min(max(rho, 1 - cl), 1 + ch)
            unclipped_term, clipped_term = -a * rho, -a * clipped_rho
            value = max(unclipped_term, clipped_term)
            # gradient: the ratio's derivative survives unless the clipped term is chosen
            # with the ratio outside the clip range
            g = -a * rho if (unclipped_term >= clipped_term or clipped_rho == rho) else 0.0
            if dual is not None and a < 0 and value > -dual * a:
                value, g = -dual * a, 0.0
                n_dual += 1
            loss[b, t], grad[b, t] = value, g
            n += 1
            n_low += rho < 1 - cl and a < 0
            n_high += rho > 1 + ch and a > 0
    stats = {"clip_frac_low": n_low / n, "clip_frac_high": n_high / n,
             "dual_clip_frac": n_dual / n, "ratio_mean": sum(ratios) / n,
             "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return loss, grad, stats


def naive_gspo(lp, old, adv, mask, cl, ch, token_adv=False):
    """GSPO per-token loss and d(Σ_t loss)/dℓ_t with sequence ratio s_i (naive loops).

    With ``token_adv`` the clipping uses A_{i,t} per token (GSPO-token); else the sequence
    advantage A_i (a (B, T) input averaged over the sequence's tokens)."""
    B, T = mask.shape
    loss = torch.zeros(B, T, dtype=torch.float64)
    grad = torch.zeros(B, T, dtype=torch.float64)
    seqs, n_low, n_high = [], 0, 0
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        if not idx:
            continue
        s = math.exp(sum(float(lp[b, t]) - float(old[b, t]) for t in idx) / len(idx))
        seq_a = (sum(tok_adv(adv, b, t) for t in idx) / len(idx))
        seqs.append(s)
        n_low += s < 1 - cl and seq_a < 0
        n_high += s > 1 + ch and seq_a > 0
        cs = min(max(s, 1 - cl), 1 + ch)
        for t in idx:
            a = tok_adv(adv, b, t) if token_adv else seq_a
            value = max(-a * s, -a * cs)
            active = -a * s >= -a * cs or cs == s
            loss[b, t] = value
            if token_adv:
                # s_{i,t} = sg[s_i]·exp(ℓ_t - sg[ℓ_t]): d/dℓ_t = s_i, only on token t
                grad[b, t] = -a * s if active else 0.0
            else:
                # every token of the row carries L_i; d L_i/dℓ_u = -A s / |y_i| for each u;
                # summing the |y_i| copies gives -A s per token
                grad[b, t] = -a * s if active else 0.0
    n = len(seqs)
    stats = {"clip_frac_low": n_low / n, "clip_frac_high": n_high / n,
             "ratio_mean": sum(seqs) / n, "ratio_min": min(seqs), "ratio_max": max(seqs)}
    return loss, grad, stats


def naive_value(values, old_values, returns, mask, clip):
    B, T = mask.shape
    loss = torch.zeros(B, T, dtype=torch.float64)
    grad = torch.zeros(B, T, dtype=torch.float64)
    n = n_clip = 0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            v, vo, r = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
            un = (v - r) ** 2
            n += 1
            if clip is None:
                loss[b, t], grad[b, t] = 0.5 * un, v - r
                continue
            vc = vo + min(max(v - vo, -clip), clip)
            cl = (vc - r) ** 2
            loss[b, t] = 0.5 * max(un, cl)
            n_clip += cl > un
            if un >= cl:
                grad[b, t] = v - r
            else:  # the clipped term: its derivative is (vc - r) inside the clip range, else 0
                grad[b, t] = (vc - r) if abs(v - vo) < clip else 0.0
    return loss, grad, n_clip / n


def naive_explained_variance(values, returns, mask):
    r = [float(x) for x in returns[mask]]
    res = [float(x) - float(y) for x, y in zip(returns[mask], values[mask], strict=True)]

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    return 0.0 if var(r) == 0 else 1.0 - var(res) / var(r)


def check_metrics(metrics, stats, keys):
    for k in keys:
        torch.testing.assert_close(metrics[k].double(), torch.tensor(stats[k], dtype=torch.float64),
                                   msg=k)


# --- PPO clip --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("per_token_adv", [True, False])
def test_ppo_clip_matches_naive(shape, clip, dual, per_token_adv):
    """Per-token loss, gradient w.r.t. ℓ, clip fractions, dual-clip fraction and ratio stats
    equal the token-by-token formula (clip-higher and dual clip included)."""
    gen = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    lp, old, adv, mask = policy_inputs(*shape, gen, spread=0.6, per_token_adv=per_token_adv)
    if dual is not None:  # make sure some negative-advantage tokens have huge ratios
        with torch.no_grad():
            lp[0] = old[0] + 2.0
    loss, metrics = ppo_clip_loss(lp, old, adv, mask, clip[0], clip[1], dual)
    want, want_grad, stats = naive_ppo(lp.detach(), old, adv, mask, clip[0], clip[1], dual)
    torch.testing.assert_close(loss, want)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, want_grad)
    keys = ["clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max"]
    check_metrics(metrics, stats, keys + (["dual_clip_frac"] if dual else []))


def test_ppo_clip_fractions_by_hand():
    """Six tokens with ε_low = 0.2, ε_high = 0.28, one masked: ρ = 0.5 & A<0 is low-clipped,
    ρ = 1.5 & A>0 is high-clipped, ρ = 1.25 & A>0 is inside 1.28, the rest are not clipped."""
    ratio = torch.tensor([[0.5, 0.5, 1.5, 1.5, 1.25, 0.1]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0, 2.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    old = torch.zeros(1, 6, dtype=torch.float64)
    lp = ratio.log().requires_grad_(True)
    loss, m = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 5)
    # losses: 0.8 (clipped), -0.5, -1.28 (clipped), 1.5, -2.5, masked 0
    torch.testing.assert_close(loss, torch.tensor([[0.8, -0.5, -1.28, 1.5, -2.5, 0.0]],
                                                  dtype=torch.float64))
    loss.sum().backward()
    # dL/dℓ = -A ρ where not clipped: (0, -0.5, 0, 1.5, -2.5, 0)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.5, 0.0, 1.5, -2.5, 0.0]],
                                                     dtype=torch.float64))
    assert m["ratio_min"].item() == pytest.approx(0.5)
    assert m["ratio_max"].item() == pytest.approx(1.5)
    assert m["ratio_mean"].item() == pytest.approx((0.5 + 0.5 + 1.5 + 1.5 + 1.25) / 5)
    # with symmetric 0.2 the 1.25 token is clipped too
    _, m = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert m["clip_frac_high"].item() == pytest.approx(2 / 5)


def test_dual_clip_by_hand():
    """Dual clip c = 3 on A = -1: ρ = 5 gives loss 3 (bounded, no gradient), ρ = 2 gives 2;
    positive advantages are untouched."""
    ratio = torch.tensor([[5.0, 2.0, 5.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    lp = ratio.log().requires_grad_(True)
    loss, m = ppo_clip_loss(lp, torch.zeros(1, 3, dtype=torch.float64), adv,
                            torch.ones(1, 3), dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, -1.2]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 2.0, 0.0]], dtype=torch.float64))
    assert m["dual_clip_frac"].item() == pytest.approx(1 / 3)


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_must_exceed_one(c):
    """dual_clip ≤ 1 is rejected."""
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        ppo_clip_loss(x, x, torch.ones(1), torch.ones(1, 2), dual_clip=c)


@pytest.mark.parametrize("delta", [100.0, -100.0, 1e4, -1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_log_ratios_stay_finite(delta, dtype):
    """Log-ratios of ±100 and ±1e4 give a finite loss and finite gradients in every policy
    loss (float32 and float64)."""
    old = torch.full((2, 4), -5.0, dtype=dtype)
    lp = (old + delta).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    for fn, kwargs in [(ppo_clip_loss, {}), (ppo_clip_loss, {"dual_clip": 3.0}),
                       (ppo_clip_loss, {"clip_low": 0.2, "clip_high": 0.28}),
                       (gspo_loss, {}), (gspo_token_loss, {})]:
        lp.grad = None
        loss, metrics = fn(lp, old, adv, mask, **kwargs)
        total = aggregate_loss(loss, mask, "token_mean")
        total.backward()
        assert torch.isfinite(loss).all() and torch.isfinite(total)
        assert torch.isfinite(lp.grad).all()
        assert all(torch.isfinite(v).all() for v in metrics.values())


# --- GSPO ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
@pytest.mark.parametrize("per_token_adv", [True, False])
def test_gspo_matches_naive(shape, clip, per_token_adv):
    """GSPO's sequence ratio, sequence clipping, per-token loss (L_i on each token), gradient
    and sequence-counted clip fractions equal the formula; a (B, T) advantage is averaged
    over each sequence's tokens."""
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    spread = 4e-4 if clip[0] < 1e-2 else 0.3
    lp, old, adv, mask = policy_inputs(*shape, gen, spread=spread, per_token_adv=per_token_adv)
    loss, metrics = gspo_loss(lp, old, adv, mask, *clip)
    want, want_grad, stats = naive_gspo(lp.detach(), old, adv, mask, *clip)
    torch.testing.assert_close(loss, want)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, want_grad)
    check_metrics(metrics, stats, list(stats))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_token_matches_naive(shape, clip):
    """GSPO-token with per-token advantages: L_{i,t} = -min(s_i A_{i,t}, clip(s_i) A_{i,t}),
    gradient s_i·(-A_{i,t}) on token t only."""
    gen = torch.Generator().manual_seed(shape[0] * 11 + shape[1])
    spread = 4e-4 if clip[0] < 1e-2 else 0.3
    lp, old, adv, mask = policy_inputs(*shape, gen, spread=spread)
    loss, metrics = gspo_token_loss(lp, old, adv, mask, *clip)
    want, want_grad, stats = naive_gspo(lp.detach(), old, adv, mask, *clip, token_adv=True)
    torch.testing.assert_close(loss, want)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, want_grad)
    check_metrics(metrics, stats, list(stats))


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
@pytest.mark.parametrize("layout", ["T=1", "one token behind a prompt"])
def test_gspo_equals_ppo_on_length_one_completions(clip, layout):
    """With one response token per sequence, GSPO is token-level PPO: same loss, gradient,
    clip fractions and ratio statistics."""
    gen = torch.Generator().manual_seed(4)
    B = 12
    if layout == "T=1":
        T, mask = 1, torch.ones(B, 1, dtype=torch.bool)
    else:
        T = 6
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[torch.arange(B), torch.randint(0, T, (B,), generator=gen)] = True
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64)
    spread = 5e-4 if clip[0] < 1e-2 else 0.3
    noise = torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    lp1 = (old + noise).requires_grad_(True)
    lp2 = (old + noise).requires_grad_(True)
    l1, m1 = gspo_loss(lp1, old, adv, mask, *clip)
    l2, m2 = ppo_clip_loss(lp2, old, adv, mask, *clip)
    assert 0 < m2["clip_frac_low"] + m2["clip_frac_high"] < 1  # both regimes exercised
    torch.testing.assert_close(l1, l2)
    l1.sum().backward()
    l2.sum().backward()
    torch.testing.assert_close(lp1.grad, lp2.grad)
    for k in ("clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max"):
        torch.testing.assert_close(m1[k], m2[k], msg=k)


@pytest.mark.parametrize("fn", [ppo_clip_loss, gspo_loss, gspo_token_loss])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_on_policy_ratio_is_exactly_one(fn, dtype):
    """With old_logprobs = logprobs.detach() every ratio is exactly 1 (μ = 1), nothing is
    clipped, the loss is -A on each token and its gradient is -A."""
    gen = torch.Generator().manual_seed(9)
    mask = random_mask(6, 7, gen, first_row_nonempty=True)
    lp = (-torch.rand(6, 7, generator=gen) * 30).to(dtype).requires_grad_(True)
    adv = torch.randn(6, generator=gen).to(dtype)
    loss, m = fn(lp, lp.detach(), adv, mask)
    assert m["ratio_min"].item() == 1.0
    assert m["ratio_max"].item() == 1.0
    assert m["ratio_mean"].item() == 1.0
    assert m["clip_frac_low"].item() == 0.0 and m["clip_frac_high"].item() == 0.0
    want = torch.where(mask, -adv[:, None].expand(6, 7), torch.zeros((), dtype=dtype))
    assert torch.equal(loss, want)
    loss.sum().backward()
    assert torch.equal(lp.grad, want)


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_token_with_sequence_advantages_has_gspo_gradient(clip, seed):
    """GSPO-token with A_{i,t} = A_i aggregated by seq_mean has GSPO's loss and gradient."""
    gen = torch.Generator().manual_seed(seed)
    B, T = 8, 10
    mask = random_mask(B, T, gen, first_row_nonempty=True)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    spread = 4e-4 if clip[0] < 1e-2 else 0.3
    noise = torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    lp1 = (old + noise).requires_grad_(True)
    lp2 = (old + noise).requires_grad_(True)
    g1 = aggregate_loss(gspo_loss(lp1, old, adv, mask, *clip)[0], mask, "seq_mean")
    tok_adv2 = adv[:, None].expand(B, T).clone()
    g2 = aggregate_loss(gspo_token_loss(lp2, old, tok_adv2, mask, *clip)[0], mask, "seq_mean")
    torch.testing.assert_close(g1, g2)
    g1.backward()
    g2.backward()
    assert lp1.grad.abs().sum() > 0
    torch.testing.assert_close(lp1.grad, lp2.grad)


# --- value loss and explained variance -------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", [None, 0.2, 1.0])
def test_value_loss_matches_naive(shape, clip):
    """½ max((V-R)², (V_clip-R)²) (or ½ (V-R)² without clipping), its gradient w.r.t. V,
    value_clip_frac and explained_variance equal the formula."""
    gen = torch.Generator().manual_seed(shape[0] + 13 * shape[1])
    B, T = shape
    mask = random_mask(B, T, gen, first_row_nonempty=True)
    old_values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    values = (old_values + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5)
    values.requires_grad_(True)
    returns = torch.randn(B, T, generator=gen, dtype=torch.float64)
    loss, metrics = value_loss(values, old_values, returns, mask, clip)
    want, want_grad, frac = naive_value(values.detach(), old_values, returns, mask, clip)
    torch.testing.assert_close(loss, want)
    loss.sum().backward()
    torch.testing.assert_close(values.grad, want_grad)
    assert metrics["value_clip_frac"].item() == pytest.approx(frac)
    assert metrics["explained_variance"].item() == pytest.approx(
        naive_explained_variance(values.detach(), returns, mask), abs=1e-9)


def test_value_loss_by_hand():
    """V_old = 0, ε_v = 0.2: (V=1, R=0) → max(1, 0.04)/2 = 0.5; (V=1, R=2) → max(1, 3.24)/2
    = 1.62 with the clipped term (no gradient); (V=0.1, R=1) → both 0.81/2."""
    values = torch.tensor([[1.0, 1.0, 0.1]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[0.0, 2.0, 1.0]], dtype=torch.float64)
    loss, m = value_loss(values, torch.zeros(1, 3, dtype=torch.float64), returns,
                         torch.ones(1, 3), 0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.5, 1.62, 0.405]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[1.0, 0.0, -0.9]],
                                                         dtype=torch.float64))
    assert m["value_clip_frac"].item() == pytest.approx(1 / 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_explained_variance_matches_naive(seed):
    """1 - Var[R - V]/Var[R] over unmasked tokens; 1 for a perfect critic, 0 for constant
    returns, and masked garbage is ignored."""
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(5, 9, gen, first_row_nonempty=True)
    returns = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    values = returns + torch.randn(5, 9, generator=gen, dtype=torch.float64) * 0.5
    values[~mask] = 1e9
    ev = explained_variance(values, returns, mask)
    assert ev.item() == pytest.approx(naive_explained_variance(values, returns, mask), abs=1e-12)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    const = torch.full_like(returns, 2.5)
    assert explained_variance(values, const, mask).item() == 0.0


# --- gradients flow only through logprobs and values -----------------------------------------

@pytest.mark.parametrize("fn", [ppo_clip_loss, gspo_loss, gspo_token_loss])
@pytest.mark.parametrize("adv_dim", [1, 2])
def test_policy_losses_give_no_gradient_to_constants(fn, adv_dim):
    """advantages and old_logprobs receive no gradient even when they require grad; the
    gradient reaches logprobs."""
    gen = torch.Generator().manual_seed(2)
    lp, old, adv, mask = policy_inputs(4, 5, gen, spread=1e-4, per_token_adv=adv_dim == 2)
    old.requires_grad_(True)
    adv.requires_grad_(True)
    loss, _ = fn(lp, old, adv, mask)
    aggregate_loss(loss, mask, "token_mean").backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0
    for t in (old, adv):
        assert t.grad is None or not t.grad.any()


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_gives_no_gradient_to_returns_or_old_values(clip):
    """returns and old_values receive no gradient; values do."""
    gen = torch.Generator().manual_seed(3)
    values, old_values, returns = torch.randn(3, 4, 5, generator=gen).unbind(0)
    for t in (values, old_values, returns):
        t.requires_grad_(True)
    mask = random_mask(4, 5, gen, first_row_nonempty=True)
    loss, _ = value_loss(values, old_values, returns, mask, clip)
    aggregate_loss(loss, mask, "token_mean").backward()
    assert values.grad is not None and values.grad.abs().sum() > 0
    for t in (old_values, returns):
        assert t.grad is None or not t.grad.any()
