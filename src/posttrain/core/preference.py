"""Pairwise preference losses: the Bradley–Terry reward-model loss and the DPO family.

All functions return the loss per pair, shape ``(B,)``, so a trainer can sum over
micro-batches and divide by the pair count of the whole optimiser step, plus a dict of
0-dim metric tensors (means over the pairs given). Every ``-log σ(z)`` is ``softplus(-z)``:
finite and with finite gradients for any finite ``z``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge")


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    center_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley–Terry loss (docs/algorithms.md §1), per pair ``(B,)``.

        loss = -log σ(r_c - r_r - margin) + c · (r_c + r_r)²

    ``margin`` (scalar or ``(B,)``) comes from the data when it carries one. The centring term
    (Eisenstein et al. 2023) keeps rewards near zero; ``c = 0`` switches it off.
    Metrics: ``accuracy`` = mean[r_c > r_r], ``margin`` = mean(r_c - r_r).
    """
    diff = chosen_rewards - rejected_rewards
    z = diff if margin is None else diff - margin
    loss = F.softplus(-z)
    if center_coef:
        loss = loss + center_coef * (chosen_rewards + rejected_rewards).square()
    with torch.no_grad():
        metrics = {
            "accuracy": (diff > 0).float().mean(),
            "margin": diff.float().mean(),
            "chosen_reward": chosen_rewards.float().mean(),
            "rejected_reward": rejected_rewards.float().mean(),
        }
    return loss, metrics


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO and its close variants (docs/algorithms.md §2), per pair ``(B,)``.

    Inputs are sequence log-likelihoods ``log π(y|x) = Σ_t m_t ℓ_t``, shape ``(B,)``. With
    ``Δ(y) = log π_θ(y|x) - log π_ref(y|x)`` and ``z = β (Δ(y_w) - Δ(y_l))``:

        sigmoid  (Rafailov et al. 2023):  -log σ(z)
        robust   (cDPO, label smoothing ε): -(1-ε) log σ(z) - ε log σ(-z)
        ipo      (Azar et al. 2023):      (z/β - 1/(2β))², on length-averaged log-likelihoods
        hinge    (SLiC, Zhao et al. 2023): relu(1 - z)

    IPO needs ``chosen_lengths`` and ``rejected_lengths`` (completion token counts, ``(B,)``):
    the log-likelihoods are divided by them before Δ is formed. Reference log-likelihoods
    are constants. Metrics: implicit rewards ``β Δ`` for chosen and rejected, their accuracy
    (chosen > rejected) and margin.
    """
    ref_chosen_logps = ref_chosen_logps.detach()
    ref_rejected_logps = ref_rejected_logps.detach()
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("IPO uses length-averaged log-likelihoods: pass chosen_lengths "
                             "and rejected_lengths")
        cl = chosen_lengths.to(chosen_logps.dtype).clamp_min(1.0)
        rl = rejected_lengths.to(rejected_logps.dtype).clamp_min(1.0)
        chosen_delta = (chosen_logps - ref_chosen_logps) / cl
        rejected_delta = (rejected_logps - ref_rejected_logps) / rl
    else:
        chosen_delta = chosen_logps - ref_chosen_logps
        rejected_delta = rejected_logps - ref_rejected_logps
    z = beta * (chosen_delta - rejected_delta)

    if loss_type == "sigmoid":
        loss = F.softplus(-z)
    elif loss_type == "robust":
        eps = label_smoothing
        loss = (1.0 - eps) * F.softplus(-z) + eps * F.softplus(z)
    elif loss_type == "ipo":
        loss = (z / beta - 1.0 / (2.0 * beta)).square()
    elif loss_type == "hinge":
        loss = torch.relu(1.0 - z)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {DPO_LOSS_TYPES}")

    with torch.no_grad():
        chosen_r = beta * chosen_delta
        rejected_r = beta * rejected_delta
        metrics = {
            "chosen_reward": chosen_r.float().mean(),
            "rejected_reward": rejected_r.float().mean(),
            "reward_accuracy": (chosen_r > rejected_r).float().mean(),
            "reward_margin": (chosen_r - rejected_r).float().mean(),
        }
    return loss, metrics
