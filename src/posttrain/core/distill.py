"""On-policy distillation's per-token loss: the divergence between the student's and the
teacher's whole next-token distributions at each sampled position (docs/algorithms.md).

With ``P`` the teacher and ``Q`` the student (softmax of their logits) and
``M = β·P + (1-β)·Q``:

- ``β = 1``: the reverse KL ``KL(Q‖P) = Σ_v Q (log Q − log P)`` (mode-seeking; the default);
- ``β = 0``: the forward KL ``KL(P‖Q)``;
- ``0 < β < 1``: the generalised Jensen–Shannon divergence
  ``JSD_β = β·KL(P‖M) + (1-β)·KL(Q‖M)`` (Agarwal et al., GKD).

Every term is ``p·(log p − log q)`` with ``0·log 0 = 0``: a token one distribution gives
no mass to adds nothing and never NaN.
"""

from __future__ import annotations

import math

import torch

FLOOR = -1e30
"""Log-probabilities are floored here: a token one model rules out (a logit of -inf) where
the other puts mass gives a huge finite divergence, never inf or NaN."""


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``Σ_v p (log p − log q)`` over the last axis, 0 where ``p = 0`` (the difference is
    zeroed before the product, so no ``0·∞`` reaches the forward or the backward)."""
    p = logp.exp()
    return (p * torch.where(p > 0, logp - logq, 0.0)).sum(-1)


def distill_token_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                       beta: float = 1.0) -> torch.Tensor:
    """The divergence at each position, ``(N,)`` from ``(N, V)`` logits (float32 math; the
    gradient flows into the student's logits only)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    logq = torch.log_softmax(student_logits.float(), -1).clamp(min=FLOOR)
    logp = torch.log_softmax(teacher_logits.detach().float(), -1).clamp(min=FLOOR)
    if beta == 1.0:
        return _kl(logq, logp)
    if beta == 0.0:
        return _kl(logp, logq)
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
    return beta * _kl(logp, logm) + (1.0 - beta) * _kl(logq, logm)
