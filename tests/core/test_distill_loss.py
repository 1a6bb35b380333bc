"""The distillation divergences against a float64 reference written from their formulas
(softmax by hand, ``Σ p log(p / q)`` over the tokens where ``p > 0``), values and gradients,
on random and extreme logits; the tolerance is the float32 error of the computation."""

from __future__ import annotations

import math

import pytest
import torch

from bounds import unit_roundoff
from posttrain.core.distill import distill_token_loss

U = unit_roundoff()


def _probs(x: torch.Tensor) -> torch.Tensor:
    finite = torch.where(torch.isfinite(x), x, torch.full_like(x, -math.inf))
    e = torch.exp(finite - finite.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def _kl64(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(p.shape[0], dtype=torch.float64)
    for i in range(p.shape[0]):
        for v in range(p.shape[1]):
            if p[i, v] > 0:
                out[i] = out[i] + p[i, v] * (torch.log(p[i, v]) - torch.log(q[i, v]))
    return out


def reference(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    q, p = _probs(student.double()), _probs(teacher.double())
    if beta == 1.0:
        return _kl64(q, p)
    if beta == 0.0:
        return _kl64(p, q)
    m = beta * p + (1 - beta) * q
    return beta * _kl64(p, m) + (1 - beta) * _kl64(q, m)


def _tolerance(student, teacher, ref) -> torch.Tensor:
    """Per row: each float32 log-softmax entry is within ``a = 4u(R + log V)`` (R the
    logits' range), the mixture's log adds as much again; the products and the sum of V
    terms round within ``(√V + 2)·u`` of the terms' size."""
    V = student.shape[-1]
    def spread(x):
        f = torch.where(torch.isfinite(x), x, torch.nan)
        return (f.nan_to_num(nan=-math.inf).max(-1).values
                - f.nan_to_num(nan=math.inf).min(-1).values)
    R = torch.maximum(spread(student.double()), spread(teacher.double()))
    a = 4 * U * (R + math.log(V))
    return 3 * a + (a + (math.sqrt(V) + 2) * U) * ref.abs() + 1e-30


CASES = {
    "normal": lambda g: (torch.randn(12, 40, generator=g), torch.randn(12, 40, generator=g)),
    "wide": lambda g: (8 * torch.randn(12, 40, generator=g), 8 * torch.randn(12, 40, generator=g)),
    "near one-hot": lambda g: (1e4 * torch.randn(6, 30, generator=g),
                               1e4 * torch.randn(6, 30, generator=g)),
    "equal": lambda g: (lambda x: (x, x.clone()))(torch.randn(6, 30, generator=g)),
    "large vocabulary": lambda g: (torch.randn(3, 3000, generator=g),
                                   torch.randn(3, 3000, generator=g)),
}


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5, 0.1, 0.9])
@pytest.mark.parametrize("case", list(CASES))
def test_divergence_matches_float64_reference(case, beta):
    g = torch.Generator().manual_seed(hash(case) % 1000)
    student, teacher = CASES[case](g)
    ours = distill_token_loss(student, teacher, beta)
    ref = reference(student, teacher, beta)
    assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
    assert ((ours.double() - ref).abs() <= _tolerance(student, teacher, ref)).all()
    assert (ours >= -_tolerance(student, teacher, ref).float()).all()  # a divergence
    if case == "equal" and beta in (0.0, 1.0):  # the same log-probs: exactly 0
        assert (ours == 0).all()


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5])
def test_gradient_matches_float64_reference(beta):
    g = torch.Generator().manual_seed(3)
    student, teacher = 3 * torch.randn(8, 25, generator=g), 3 * torch.randn(8, 25, generator=g)
    weights = torch.rand(8, generator=g)
    teacher.requires_grad_(True)  # the loss detaches it: no gradient reaches the teacher
    s32 = student.clone().requires_grad_(True)
    (distill_token_loss(s32, teacher, beta) * weights).sum().backward()
    s64 = student.double().requires_grad_(True)
    q, p = torch.softmax(s64, -1), torch.softmax(teacher.detach().double(), -1)
    kl = lambda a, b: (a * (a.log() - b.log())).sum(-1)  # noqa: E731 (all positive here)
    m = beta * p + (1 - beta) * q
    ref = (kl(q, p) if beta == 1 else kl(p, q) if beta == 0
           else beta * kl(p, m) + (1 - beta) * kl(q, m))
    (ref * weights.double()).sum().backward()
    assert teacher.grad is None
    # the gradient is q ⊙ (terms of size ≤ |log q − log p| + KL): each within the
    # log-softmax error a of the logits' range, plus the V-term sums' rounding
    V = student.shape[1]
    a = 4 * U * (float(student.max() - student.min() + teacher.detach().max()
                       - teacher.detach().min())
                 + math.log(V))
    size = float((q.log() - p.log()).abs().max()) + float(ref.detach().max()) + 1
    tol = (4 * a + 4 * (math.sqrt(V) + 2) * U) * size
    assert (s32.grad.double() - s64.grad).abs().max() <= tol


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5])
def test_ruled_out_tokens_are_finite_never_nan(beta):
    """A logit of -inf (a masked token) in either model: where the other model also rules
    it out, it adds nothing; where the other gives it mass, the divergence is huge and
    finite. Values and gradients are finite either way."""
    student = torch.tensor([[0.0, 1.0, -math.inf, 2.0], [0.5, -math.inf, 0.0, 0.0]])
    teacher = torch.tensor([[0.0, -math.inf, -math.inf, 1.0], [0.5, 0.0, -math.inf, 0.0]])
    s = student.clone().requires_grad_(True)
    out = distill_token_loss(s, teacher, beta)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(s.grad).all()
    with torch.no_grad():
        ref = reference(student, teacher, beta)
    infinite = torch.isinf(ref)
    assert infinite.any() == (beta in (0.0, 1.0))  # the mixture has mass wherever either has
    assert (out[infinite] > 1e20).all()
    assert ((out.double() - ref)[~infinite].abs() <= 1e-6).all()


def test_beta_outside_the_unit_interval_is_refused():
    with pytest.raises(ValueError, match="beta"):
        distill_token_loss(torch.zeros(1, 2), torch.zeros(1, 2), 1.5)
