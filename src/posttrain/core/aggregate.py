"""Reducing a per-token loss ``(B, T)`` to the scalar that is back-propagated.

The normaliser is an argument, not something computed from the micro-batch at hand: a
trainer passes the token count (or sequence count) of the *whole optimiser step*, summed over
gradient-accumulation micro-batches and ranks. Then the sum of the micro-batch losses equals
the full-batch loss, and the gradient does not depend on how the batch was cut.

    token_mean     Σ_{i,t} m L / N_tokens                       DAPO, PPO
    seq_mean       Σ_i (Σ_t m L / |y_i|) / N_seqs              GRPO, GSPO
    seq_sum        Σ_i Σ_t m L / N_seqs
    seq_sum_const  Σ_i Σ_t m L / (N_seqs · C)                  Dr. GRPO (C = max new tokens)

``normalizer=None`` uses the count of the batch given (right for a single micro-batch).
"""

from __future__ import annotations

import torch

from posttrain.core.masked import masked_count, masked_sum

AGGREGATIONS = ("token_mean", "seq_mean", "seq_sum", "seq_sum_const")


def step_normalizer(response_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The count a mode divides by, for the batch ``response_mask`` ``(B, T)``: unmasked tokens
    for ``token_mean``, sequences with at least one unmasked token otherwise. Sum it over the
    micro-batches (and ranks) of a step before passing it to :func:`aggregate_loss`."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")
    if mode == "token_mean":
        return masked_count(response_mask)
    return response_mask.bool().any(dim=-1).float().sum()


def aggregate_loss(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    normalizer: torch.Tensor | float | None = None,
    constant: float = 1.0,
) -> torch.Tensor:
    """Scalar loss from ``per_token_loss`` ``(B, T)`` (see the module docstring for modes).

    ``constant`` is Dr. GRPO's ``C`` and is used by ``seq_sum_const`` only. A normaliser of 0
    (an empty step) is treated as 1, so an all-masked batch gives 0, not NaN.
    """
    if normalizer is None:
        normalizer = step_normalizer(response_mask, mode)
    normalizer = torch.as_tensor(normalizer, dtype=per_token_loss.dtype,
                                 device=per_token_loss.device).clamp_min(1.0)
    if mode == "token_mean":
        total = masked_sum(per_token_loss, response_mask)
    elif mode == "seq_mean":
        lengths = masked_count(response_mask, dim=-1).to(per_token_loss.dtype).clamp_min(1.0)
        total = (masked_sum(per_token_loss, response_mask, dim=-1) / lengths).sum()
    elif mode == "seq_sum":
        total = masked_sum(per_token_loss, response_mask)
    elif mode == "seq_sum_const":
        total = masked_sum(per_token_loss, response_mask) / constant
    else:
        raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")
    return total / normalizer
