"""Policy-gradient and value losses. Each returns the loss per token ``(B, T)`` (0 at masked
positions) and a dict of 0-dim metric tensors; reducing the per-token loss to a scalar is the
separate job of :func:`posttrain.core.aggregate.aggregate_loss`.

Shapes: ``logprobs``, ``old_logprobs``, ``response_mask`` are ``(B, T)``; ``advantages`` is
``(B, T)`` or ``(B,)`` (one value per sequence, broadcast over its tokens). Gradients flow
through ``logprobs`` (and ``values``) only.

Log-ratios are clamped to ``[-20, 20]`` before the exponential: a ratio beyond e^20 is far
outside any clip range, and the clamp keeps the loss and its gradient finite in float32.
"""

from __future__ import annotations

import torch

from posttrain.core.masked import masked_mean, masked_min_max, masked_var

LOG_RATIO_CLAMP = 20.0


def _token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    advantages = advantages.detach().to(like.dtype)
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def _zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    lo, hi = masked_min_max(ratio.detach(), mask)
    return {"ratio_mean": masked_mean(ratio.detach(), mask), "ratio_min": lo, "ratio_max": hi}


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped surrogate (PPO, Schulman et al. 2017; clip-higher, DAPO §3.1).

        ρ_t = exp(ℓ_t - ℓ_t^old)
        L_t = -min(ρ_t A_t, clip(ρ_t, 1 - ε_low, 1 + ε_high) A_t)

    ``dual_clip = c > 1`` (Ye et al. 2020, arXiv 1912.09729) also bounds the loss of
    negative-advantage tokens at ``-c·A_t`` so a huge ratio cannot blow up the update.

    Metrics: ``clip_frac_low`` / ``clip_frac_high`` = share of tokens whose gradient the lower
    / upper clip removes (ρ < 1-ε_low with A < 0; ρ > 1+ε_high with A > 0),
    ``dual_clip_frac``, and ratio mean/min/max.
    """
    adv = _token_advantages(advantages, logprobs)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics: dict[str, torch.Tensor] = {}
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -adv * dual_clip
        dual_active = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
        metrics["dual_clip_frac"] = masked_mean(dual_active.float(), response_mask)
    with torch.no_grad():
        r = ratio.detach()
        metrics["clip_frac_low"] = masked_mean(((r < 1.0 - clip_low) & (adv < 0)).float(),
                                               response_mask)
        metrics["clip_frac_high"] = masked_mean(((r > 1.0 + clip_high) & (adv > 0)).float(),
                                                response_mask)
        metrics.update(_ratio_metrics(ratio, response_mask))
    return _zero_masked(loss, response_mask), metrics


def _sequence_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """GSPO's ``s_i = exp(mean_t(ℓ - ℓ^old))`` over unmasked tokens, ``(B,)``."""
    mean_log_ratio = masked_mean(logprobs - old_logprobs.detach(), response_mask, dim=-1)
    return torch.exp(mean_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _sequence_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    advantages = advantages.detach()
    return advantages if advantages.dim() == 1 else masked_mean(advantages, response_mask, dim=-1)


def _gspo_metrics(
    s: torch.Tensor, adv: torch.Tensor, response_mask: torch.Tensor, clip_low: float,
    clip_high: float,
) -> dict[str, torch.Tensor]:
    """Sequence-level clip fractions: GSPO clips whole sequences, so we count sequences."""
    has_tokens = response_mask.bool().any(dim=-1)
    s = s.detach()
    low = ((s < 1.0 - clip_low) & (adv < 0)).float()
    high = ((s > 1.0 + clip_high) & (adv > 0)).float()
    metrics = {
        "clip_frac_low": masked_mean(low, has_tokens),
        "clip_frac_high": masked_mean(high, has_tokens),
    }
    metrics.update(_ratio_metrics(s, has_tokens))
    return metrics


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., arXiv 2507.18071): sequence-level ratio and clipping.

        s_i = exp( (1/|y_i|) Σ_t m_t (ℓ_{i,t} - ℓ_{i,t}^old) )
        L_i = -min(s_i A_i, clip(s_i, 1 - ε_low, 1 + ε_high) A_i)

    ``advantages`` is ``(B,)`` (a ``(B, T)`` input is averaged over each sequence's tokens).
    The sequence loss ``L_i`` is written on every unmasked token of sequence ``i``, so the
    per-sequence mean aggregation (``seq_mean``) yields exactly ``mean_i L_i``.
    """
    adv = _sequence_advantages(advantages, response_mask).to(logprobs.dtype)
    s = _sequence_ratio(logprobs, old_logprobs, response_mask)
    seq_loss = torch.maximum(-adv * s, -adv * s.clamp(1.0 - clip_low, 1.0 + clip_high))
    loss = seq_loss.unsqueeze(-1).expand_as(logprobs)
    with torch.no_grad():
        metrics = _gspo_metrics(s, adv, response_mask, clip_low, clip_high)
    return _zero_masked(loss, response_mask), metrics


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (arXiv 2507.18071, §4.3), for per-token advantages ``(B, T)``.

        s_{i,t} = sg[s_i] · exp(ℓ_{i,t} - sg[ℓ_{i,t}])     (value s_i, token-wise gradient)
        L_{i,t} = -min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 - ε_low, 1 + ε_high) A_{i,t})

    With ``A_{i,t} = A_i`` and ``seq_mean`` aggregation its gradient equals GSPO's.
    """
    adv = _token_advantages(advantages, logprobs)
    s = _sequence_ratio(logprobs, old_logprobs, response_mask)
    s_tok = s.detach().unsqueeze(-1) * torch.exp(logprobs - logprobs.detach())
    loss = torch.maximum(-adv * s_tok, -adv * s_tok.clamp(1.0 - clip_low, 1.0 + clip_high))
    with torch.no_grad():
        metrics = _gspo_metrics(s, _sequence_advantages(adv, response_mask), response_mask,
                                clip_low, clip_high)
    return _zero_masked(loss, response_mask), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (docs/algorithms.md §3), per token ``(B, T)``.

        V^clip = V^old + clip(V - V^old, -ε_v, ε_v)
        L_t    = ½ max((V_t - R_t)², (V^clip_t - R_t)²)

    ``clip_range=None`` gives the plain ``½ (V - R)²``. Metrics: ``value_clip_frac`` (share of
    tokens where the clipped term is the larger) and ``explained_variance``.
    """
    returns = returns.detach()
    old_values = old_values.detach()
    unclipped = (values - returns).square()
    metrics: dict[str, torch.Tensor] = {}
    if clip_range is None:
        loss = 0.5 * unclipped
        metrics["value_clip_frac"] = torch.zeros((), device=values.device)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (v_clip - returns).square()
        loss = 0.5 * torch.maximum(unclipped, clipped)
        metrics["value_clip_frac"] = masked_mean((clipped > unclipped).float().detach(),
                                                 response_mask)
    metrics["explained_variance"] = explained_variance(values.detach(), returns, response_mask)
    return _zero_masked(loss, response_mask), metrics


@torch.no_grad()
def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``1 - Var[R - V] / Var[R]`` over unmasked tokens; 0 when ``Var[R]`` is 0."""
    var_r = masked_var(returns, response_mask, unbiased=False)
    var_res = masked_var(returns - values, response_mask, unbiased=False)
    ev = 1.0 - var_res / var_r.clamp_min(1e-12)
    return torch.where(var_r > 0, ev, torch.zeros_like(ev))


__all__ = [
    "explained_variance",
    "gspo_loss",
    "gspo_token_loss",
    "ppo_clip_loss",
    "value_loss",
]
