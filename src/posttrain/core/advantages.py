"""Advantage estimators. Everything here runs without gradient: advantages and returns are
constants of the policy update (docs/algorithms.md, "Gradients flow only through ℓ").

Group statistics are vectorised with ``index_add_`` over ``group_ids`` ``(N,)`` (integers in
``[0, n_groups)``), so groups may have unequal sizes (after filtering) and there is no Python
loop over groups. The time recursions (GAE, discounted returns) loop over ``T`` only, each
step vectorised over the batch.
"""

from __future__ import annotations

import torch

from posttrain.core.masked import masked_whiten


def _group_sums(values: torch.Tensor, group_ids: torch.Tensor,
                weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group sum and size, each gathered back to ``(N,)``; with ``weights`` (each
    row's share of its sample, :func:`sample_weights`) the weighted sum and the number of
    samples."""
    n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    sums = torch.zeros(n_groups, dtype=values.dtype, device=values.device)
    sums.index_add_(0, group_ids, values if weights is None else values * weights)
    sizes = torch.zeros(n_groups, dtype=values.dtype, device=values.device)
    sizes.index_add_(0, group_ids, torch.ones_like(values) if weights is None else weights)
    if weights is not None:  # (k shares of 1/k sum to 1 up to rounding: a count)
        sizes = sizes.round()
    return sums[group_ids], sizes[group_ids]


def sample_weights(sample_ids: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor | None:
    """Each row's share of its sample, ``1/k`` for a sample of ``k`` rows (``sample_ids``
    ``(N,)``: the rows of one sample share an id, e.g. the trajectories of an agent episode
    that was split); None for None (a row per sample)."""
    if sample_ids is None:
        return None
    _, index, counts = torch.unique(sample_ids, return_inverse=True, return_counts=True)
    return 1.0 / counts[index].to(dtype)


def _group_constant(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: whether every member of the sample's group has the same value.

    Needed because ``sum / size`` is not exactly the common value in floating point (seven
    rewards of 0.7 in float32 have a mean one ulp off), and dividing that rounding error by an
    equally tiny std would turn an all-equal group into advantages of order 1.
    """
    n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    lo = values.new_zeros(n_groups).scatter_reduce(0, group_ids, values, "amin",
                                                   include_self=False)
    hi = values.new_zeros(n_groups).scatter_reduce(0, group_ids, values, "amax",
                                                   include_self=False)
    return (lo == hi)[group_ids]


@torch.no_grad()
def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    sample_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO's group-normalised advantage (DeepSeekMath, arXiv 2402.03300, §4.1.2), ``(N,)``.

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)     # population std

    ``scale_by_std=False`` gives Dr. GRPO's ``A_i = r_i - mean(r_group)`` (arXiv 2503.20783).
    A group whose rewards are all equal, or that has one member, gets advantage 0.
    ``sample_ids``: rows of one sample share an id and its reward (the trajectories of a
    split agent episode); the group's mean and std are then over samples, not rows.
    """
    rewards = rewards.to(torch.float32) if not rewards.is_floating_point() else rewards
    weights = sample_weights(sample_ids, rewards.dtype)
    sums, sizes = _group_sums(rewards, group_ids, weights)
    mean = sums / sizes
    centred = torch.where(_group_constant(rewards, group_ids), 0.0, rewards - mean)
    if not scale_by_std:
        return centred
    sq, _ = _group_sums(centred.square(), group_ids, weights)
    std = (sq / sizes).sqrt()
    return centred / (std + eps)


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor,
                    sample_ids: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al., arXiv 2402.14740), ``(N,)``.

        A_i = r_i - (Σ_{j≠i} r_j) / (G - 1)

    A group of one has no baseline to leave out: its advantage is 0. ``sample_ids``: as
    for :func:`group_advantages` (the sample left out is the row's whole sample).
    """
    rewards = rewards.to(torch.float32) if not rewards.is_floating_point() else rewards
    sums, sizes = _group_sums(rewards, group_ids, sample_weights(sample_ids, rewards.dtype))
    others = (sums - rewards) / (sizes - 1.0).clamp_min(1.0)
    keep = (sizes > 1) & ~_group_constant(rewards, group_ids)
    return torch.where(keep, rewards - others, torch.zeros_like(rewards))


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over ``(B, T)`` tokens.

        δ_t = R_t + γ V_{t+1} - V_t,   A_t = δ_t + γ λ A_{t+1},   returns_t = A_t + V_t

    with ``V_{T+1} = 0`` after the last unmasked token. Masked positions (prompt, padding) are
    skipped: the recursion carries ``V_{t+1}`` and ``A_{t+1}`` across them unchanged, so the
    result does not depend on where padding sits. Returns ``(advantages, returns)``, each
    ``(B, T)`` and 0 at masked positions.
    """
    mask = response_mask.to(values.dtype)
    B, T = values.shape
    next_value = values.new_zeros(B)
    next_adv = values.new_zeros(B)
    adv = torch.zeros_like(values)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m > 0, a, 0.0)  # where, not a * m: inf * 0 is NaN
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, a, next_adv)
    returns = torch.where(mask > 0, adv + values, 0.0)
    return adv, returns


@torch.no_grad()
def discounted_returns(
    rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """``G_t = R_t + γ G_{t+1}`` over unmasked tokens, ``(B, T)``; 0 at masked positions."""
    mask = response_mask.to(rewards.dtype)
    B, T = rewards.shape
    running = rewards.new_zeros(B)
    out = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        m = mask[:, t]
        g = rewards[:, t] + gamma * running
        out[:, t] = torch.where(m > 0, g, 0.0)
        running = torch.where(m > 0, g, running)
    return out


@torch.no_grad()
def token_level_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """Per-token RLHF reward (docs/algorithms.md §3), ``(B, T)``.

        R_t = -k · KL_t,   R_T = -k · KL_T + score     (T the last unmasked token)

    ``kl`` ``(B, T)`` is a per-token estimate (see :func:`posttrain.core.kl.kl_penalty`),
    ``scores`` ``(B,)`` the sequence reward. A row with an empty mask gets no reward.
    """
    mask = response_mask.bool()
    rewards = torch.where(mask, -kl_coef * kl, torch.zeros_like(kl))
    T = mask.shape[1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)  # (B,)
    has_tokens = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
    rewards[rows, last[has_tokens]] += scores[has_tokens].to(rewards.dtype)
    return rewards


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, arXiv 2501.03262): discounted returns of the KL-penalised token
    rewards, whitened over every unmasked token of the batch. Returns ``(advantages,
    returns)``, each ``(B, T)``.

    For REINFORCE++-baseline, subtract the group mean from the scores before building the
    token rewards (``group_advantages(scores, ids, scale_by_std=False)``).
    """
    returns = discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns
