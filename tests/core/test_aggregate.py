"""Loss aggregation modes against their naive formulas, and micro-batch invariance."""

from __future__ import annotations

import pytest
import torch
from masks import SHAPES, random_mask

from posttrain.core.aggregate import AGGREGATIONS, aggregate_loss, step_normalizer


def naive_aggregate(loss, mask, mode, constant=1.0):
    """The module docstring's formulas with Python loops in float64."""
    B, T = mask.shape
    rows = [[float(loss[b, t]) for t in range(T) if mask[b, t]] for b in range(B)]
    n_tokens = sum(len(r) for r in rows)
    n_seqs = sum(1 for r in rows if r)
    if mode == "token_mean":
        return sum(sum(r) for r in rows) / n_tokens if n_tokens else 0.0
    if n_seqs == 0:
        return 0.0
    if mode == "seq_mean":
        return sum(sum(r) / len(r) for r in rows if r) / n_seqs
    if mode == "seq_sum":
        return sum(sum(r) for r in rows) / n_seqs
    if mode == "seq_sum_const":
        return sum(sum(r) for r in rows) / (n_seqs * constant)
    raise AssertionError(mode)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("seed", [0, 1])
def test_aggregate_matches_naive(shape, mode, seed):
    """Each mode equals its formula; garbage (inf/NaN) in masked slots does not leak."""
    gen = torch.Generator().manual_seed(seed * 1000 + shape[0] * 10 + shape[1])
    mask = random_mask(*shape, gen)
    mask[0, 0] = True  # at least one token
    loss = torch.randn(*shape, generator=gen, dtype=torch.float64) * 3
    garbage = loss.clone()
    garbage[~mask] = float("nan")
    garbage[~mask & (torch.rand(*shape, generator=gen) > 0.5)] = float("inf")
    want = naive_aggregate(loss, mask, mode, constant=7.0)
    for x in (loss, garbage):
        got = aggregate_loss(x, mask, mode, constant=7.0)
        assert got.item() == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_by_hand(mode):
    """Row 0: tokens (1, 2, 3) behind a prompt; row 1: token (6); row 2 empty; C = 4."""
    loss = torch.tensor([[9.0, 1.0, 2.0, 3.0], [6.0, 9.0, 9.0, 9.0], [9.0] * 4])
    mask = torch.tensor([[0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    want = {
        "token_mean": (1 + 2 + 3 + 6) / 4,
        "seq_mean": ((1 + 2 + 3) / 3 + 6 / 1) / 2,
        "seq_sum": (1 + 2 + 3 + 6) / 2,
        "seq_sum_const": (1 + 2 + 3 + 6) / (2 * 4),
    }[mode]
    assert aggregate_loss(loss, mask, mode, constant=4.0).item() == pytest.approx(want)


@pytest.mark.parametrize("shape", SHAPES)
def test_step_normalizer_counts(shape):
    """token_mean divides by the unmasked token count; the others by the number of sequences
    with at least one unmasked token."""
    gen = torch.Generator().manual_seed(shape[1])
    mask = random_mask(*shape, gen)
    n_tok = sum(int(x) for x in mask.flatten())
    n_seq = sum(1 for row in mask if any(bool(x) for x in row))
    for mode in AGGREGATIONS:
        want = n_tok if mode == "token_mean" else n_seq
        assert step_normalizer(mask, mode).item() == want


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_explicit_normalizer_is_used(mode):
    """An explicit normaliser replaces the batch's own count: loss scales as n_own / n."""
    gen = torch.Generator().manual_seed(1)
    mask = random_mask(4, 6, gen)
    mask[0] = True
    loss = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    own = float(step_normalizer(mask, mode))
    base = naive_aggregate(loss, mask, mode, constant=3.0)
    for n in (own, 2 * own + 5, torch.tensor(3.0)):
        got = aggregate_loss(loss, mask, mode, normalizer=n, constant=3.0)
        assert got.item() == pytest.approx(base * own / float(n))


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("normalizer", [None, 0.0])
def test_empty_mask_gives_zero_not_nan(mode, normalizer):
    """An all-masked batch gives loss 0 and a zero (not NaN) gradient, even with NaN in the
    masked slots."""
    loss = torch.full((3, 4), float("nan"), dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out = aggregate_loss(loss, mask, mode, normalizer=normalizer)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(3, 4, dtype=torch.float64))


def test_unknown_mode_raises():
    """An unknown aggregation mode is a ValueError in both functions."""
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError):
        step_normalizer(mask, "mean")
    with pytest.raises(ValueError):
        aggregate_loss(torch.zeros(2, 2), mask, "mean", normalizer=1.0)


# --- micro-batch invariance ------------------------------------------------------------------

def toy_batch(B=16, T=12, V=7, d=5, seed=0):
    """A tiny float64 "policy" (shared weights, so every sequence's gradient overlaps) and a
    batch of sequences of varying lengths, one of them empty."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        start = int(torch.randint(0, 4, (1,), generator=gen))
        length = 0 if i == 5 else int(torch.randint(1, T - start + 1, (1,), generator=gen))
        mask[i, start:start + length] = True
    weight0 = torch.randn(d, V, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    return feats, tokens, mask, weight0, adv


def toy_logprobs(weight, feats, tokens):
    return torch.log_softmax(feats @ weight, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def micro_batches(B: int, size: int):
    return [slice(s, min(B, s + size)) for s in range(0, B, size)]


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("size", [1, 3, 4, 16])
def test_micro_batch_gradient_equals_full_batch(mode, size):
    """Summing the backward passes of micro-batches aggregated with the full step's normaliser
    gives the full-batch loss and gradient (float64, to 1e-6)."""
    feats, tokens, mask, weight0, adv = toy_batch()
    C = 12.0

    def per_token(w, sl):
        lp = toy_logprobs(w, feats[sl], tokens[sl])
        return -adv[sl] * lp + 0.1 * lp.square()  # a non-linear per-token loss

    w_full = weight0.clone().requires_grad_(True)
    full = aggregate_loss(per_token(w_full, slice(None)), mask, mode, constant=C)
    full.backward()

    norm = step_normalizer(mask, mode)
    w_micro = weight0.clone().requires_grad_(True)
    total = 0.0
    for sl in micro_batches(len(mask), size):
        part = aggregate_loss(per_token(w_micro, sl), mask[sl], mode, normalizer=norm,
                              constant=C)
        part.backward()
        total += part.item()
    # float64: both sides add the same ≤ B·T = 192 per-token terms of O(1-10) in another
    # grouping, ≤ 192·u64·Σ|terms| ~ 1e-11, far below 1e-9 and 1e-6; a micro-batch with its
    # own normaliser instead of the step's scales its share of the gradient by the counts'
    # ratio, an O(1) relative error of that share
    assert total == pytest.approx(full.item(), rel=1e-9, abs=1e-9)
    torch.testing.assert_close(w_micro.grad, w_full.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batch_own_normaliser_differs(mode):
    """Control for the invariance test: normalising each micro-batch by its own count does
    change the gradient (so the invariance test can fail)."""
    feats, tokens, mask, weight0, adv = toy_batch()
    w_full = weight0.clone().requires_grad_(True)
    aggregate_loss(-adv * toy_logprobs(w_full, feats, tokens), mask, mode).backward()
    w_micro = weight0.clone().requires_grad_(True)
    for sl in micro_batches(len(mask), 4):
        lp = toy_logprobs(w_micro, feats[sl], tokens[sl])
        aggregate_loss(-adv[sl] * lp, mask[sl], mode).backward()
    assert (w_micro.grad - w_full.grad).abs().max() > 1e-3
