"""Rollout mismatch correction (docs/algorithms.md §3.8): per-token weights for samples that
a sampler drew from a distribution numerically different from the trainer's.

The sampler (vLLM, a lower-precision engine) drew token ``y_t`` from its own distribution,
the *behaviour* policy, and reported its log-probability ``ℓ^beh_t`` with the sample. The
surrogate of §3.5 is anchored at the trainer's recomputed ``ℓ^old_t``. Their ratio on the
sampled token,

    κ_t = π_old(y_t) / π_beh(y_t) = exp(clamp(ℓ^old_t - ℓ^beh_t, -20, 20)),

(written ρ in TRL and verl; κ here so it is not §3.5's ρ) is turned into a weight ``w_t``
that multiplies the per-token policy loss. With ``S_i = Σ_t m_t log κ_t`` over the sequence
(and each exponent below clamped to ±20 too):

    none               w_t = m_t                              (metrics only)
    token_truncate     w_t = min(κ_t, C)                      (TIS)
    token_mask         w_t = 1[a ≤ κ_t ≤ b]                   (token rejection)
    icepop             w_t = κ_t · 1[a ≤ κ_t ≤ b]             (IcePop's M(κ))
    sequence_truncate  w_t = min(exp(S_i), C)                 (product ratio, truncated)
    sequence_mask      w_t = 1[a ≤ exp(S_i / |y_i|) ≤ b]      (geometric-mean rejection)

``C`` is ``Correction.high``; ``[a, b]`` is ``[low, high]``. Every weight is 0 where
``m_t = 0``. Where TRL, verl and IcePop differ from these conventions is the table in
docs/algorithms.md §3.8.

Non-finite inputs: a token whose ``ℓ^old_t - ℓ^beh_t`` is not finite (a ``-inf`` or NaN
behaviour log-prob, or an overflowing difference) gets weight 0 and is counted in
``rollout_corr/nonfinite``; in a sequence mode its whole sequence gets weight 0, since the
sequence ratio does not exist. Positions with ``m_t = 0`` are ignored whatever they hold.
Mode ``none`` leaves the mask as it is (the behaviour log-probs do not enter the loss then).
A weight of 0 does not remove a NaN already in the loss (``NaN · 0`` is NaN): ``ℓ^old`` is
expected finite on unmasked tokens.

Everything runs without gradient; the weights are constants. The computation is in float32
(float64 when an input is float64). Its error bound is derived in the docstring of
``tests/core/test_correction.py``; to first order, with ``u = 2^-24`` (float32): a relative
``(min(|Δ|, 21) + 4)·u`` on each κ_t, ``T·u·Σ_t|log κ_t|`` more on a sequence sum over ``T``
columns, and ``N·u`` relative on a mean over ``N`` entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from posttrain.core.masked import masked_mean, masked_min_max
from posttrain.core.policy import LOG_RATIO_CLAMP

CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
               "icepop")
TRUNCATIONS = ("token_truncate", "sequence_truncate")

DEFAULT_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "none": (None, None),
    "token_truncate": (None, 3.0),       # TRL's vllm_importance_sampling_cap / clip_max
    "sequence_truncate": (None, 3.0),    # the same cap (verl's rollout_is_threshold: 2.0)
    "token_mask": (1.0 / 3.0, 3.0),      # TRL's cap; the lower bound its reciprocal (verl k1)
    "sequence_mask": (0.999, 1.001),     # verl's geometric rejection presets ("0.999_1.001")
    "icepop": (0.5, 5.0),                # IcePop's α, β as verl's decoupled_token_icepop
}
"""``(low, high)`` a mode gets when the field is left ``None``."""


@dataclass(frozen=True)
class Correction:
    """Which rollout mismatch correction to apply, and its bounds.

    Bounds left ``None`` take the mode's :data:`DEFAULT_BOUNDS` at construction, so
    ``Correction("icepop").low == 0.5``. :meth:`validate` checks them.
    """

    mode: str = "none"
    """One of :data:`CORRECTIONS`."""
    low: float | None = None
    """Lower end ``a`` of the kept band (``token_mask``, ``sequence_mask``, ``icepop``);
    ``0 < low ≤ 1``. Truncation modes cap from above only and take no ``low``."""
    high: float | None = None
    """The truncation cap ``C`` (``≥ 1``), or the upper end ``b`` of the kept band
    (``≥ 1``, ``> low``)."""

    def __post_init__(self) -> None:
        low, high = DEFAULT_BOUNDS.get(self.mode, (None, None))
        if self.low is None:
            object.__setattr__(self, "low", low)
        if self.high is None:
            object.__setattr__(self, "high", high)

    def validate(self) -> None:
        """Raise ``ValueError`` (one line) for an unknown mode or bounds the mode cannot use.

        A cap below 1 would shrink the weight of tokens on which sampler and trainer agree
        (κ = 1), and a band that excludes 1 would reject them, so both are refused. ``none``
        uses no bounds and checks none.
        """
        if self.mode not in CORRECTIONS:
            raise ValueError(f"unknown rollout correction {self.mode!r}; expected one of "
                             f"{', '.join(CORRECTIONS)}")
        if self.mode == "none":
            return
        for name in ("low", "high"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ValueError(f"{self.mode}: {name} must be a finite number, got {value!r}")
        if self.mode in TRUNCATIONS:
            if self.low is not None:
                raise ValueError(f"{self.mode} caps weights from above only: leave low unset "
                                 f"(got low={self.low})")
            if self.high is None or self.high < 1.0:
                raise ValueError(f"{self.mode}: the cap high must be >= 1 (a cap below 1 "
                                 f"shrinks tokens the sampler and trainer agree on), got "
                                 f"{self.high}")
            return
        if self.low is None or self.high is None:
            raise ValueError(f"{self.mode} needs both low and high, got low={self.low}, "
                             f"high={self.high}")
        if self.low <= 0.0:
            raise ValueError(f"{self.mode}: low must be > 0, got {self.low}")
        if self.low >= self.high:
            raise ValueError(f"{self.mode}: low must be < high, got low={self.low}, "
                             f"high={self.high}")
        if not self.low <= 1.0 <= self.high:
            raise ValueError(f"{self.mode}: the band [low, high] = [{self.low}, {self.high}] "
                             f"must contain 1 (tokens the sampler and trainer agree on)")


@torch.no_grad()
def correction_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    correction: Correction,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights ``(B, T)`` for the per-token policy loss, and 0-dim metrics.

    ``old_logprobs`` is the trainer's ``ℓ^old``, ``behaviour_logprobs`` the sampler's
    ``ℓ^beh``, both ``(B, T)``; the module docstring gives ``w_t`` per mode. The weights are
    detached, 0 where ``response_mask`` is 0 and at rejected tokens, and always finite;
    float32 (float64 when an input is float64).

    Metrics, all over the tokens with ``m_t = 1`` of this batch (0 for an empty mask):
    ``rollout_corr/gap_mean`` and ``gap_max`` (``|ℓ^old - ℓ^beh|``, clamped at 20),
    ``prob_error`` (mean ``|κ - 1|``), ``weight_mean`` / ``weight_min`` / ``weight_max``,
    ``truncated_frac`` (share of tokens whose weight the cap lowered; in
    ``sequence_truncate``, tokens of capped sequences), ``masked_frac`` (share of finite
    tokens set to 0 by the band or by a non-finite token in their sequence) and
    ``nonfinite`` (share of tokens with a non-finite log-ratio, which enter the gap metrics
    as 0). Means divide by the batch's token count, so the caller combines micro-batches by
    a token-weighted mean (and ``_min`` / ``_max`` keys by min / max).
    """
    correction.validate()
    if not old_logprobs.shape == behaviour_logprobs.shape == response_mask.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, behaviour_logprobs "
                         f"{tuple(behaviour_logprobs.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must have one shape (B, T)")
    wide = torch.float64 in (old_logprobs.dtype, behaviour_logprobs.dtype)
    dtype = torch.float64 if wide else torch.float32
    mask = response_mask.bool()
    diff = old_logprobs.detach().to(dtype) - behaviour_logprobs.detach().to(dtype)  # (B, T)
    finite = mask & torch.isfinite(diff)      # tokens whose ratio exists
    broken = mask & ~finite                   # unmasked tokens with a non-finite log-ratio
    zero = torch.zeros((), dtype=dtype, device=diff.device)
    log_ratio = torch.where(finite, diff, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)              # κ_t; 1 where it does not exist
    truncated = torch.zeros_like(mask)        # the cap lowered the weight
    rejected = torch.zeros_like(mask)         # a finite token given weight 0
    mode, low, high = correction.mode, correction.low, correction.high

    if mode == "none":
        weights = mask.to(dtype)
    elif mode in ("token_truncate", "token_mask", "icepop"):
        if mode == "token_truncate":
            weights = ratio.clamp(max=high)
            truncated = finite & (ratio > high)
        else:
            inside = (ratio >= low) & (ratio <= high)
            rejected = finite & ~inside
            weights = inside.to(dtype) if mode == "token_mask" else ratio * inside
        weights = torch.where(finite, weights, zero)
    else:  # sequence modes: one weight per row, written on each of its tokens
        intact = ~broken.any(dim=-1)                                   # (B,)
        if mode == "sequence_truncate":
            seq_log = log_ratio.sum(dim=-1)                            # log Π_t κ_t
        else:
            seq_log = masked_mean(log_ratio, finite, dim=-1)           # log of the geo. mean
        seq_ratio = torch.exp(seq_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))   # (B,)
        if mode == "sequence_truncate":
            seq_weight = seq_ratio.clamp(max=high)
            kept = intact
            truncated = finite & (intact & (seq_ratio > high)).unsqueeze(-1)
        else:
            seq_weight = torch.ones_like(seq_ratio)
            kept = intact & (seq_ratio >= low) & (seq_ratio <= high)
        rejected = finite & ~kept.unsqueeze(-1)
        weights = torch.where(finite & kept.unsqueeze(-1), seq_weight.unsqueeze(-1), zero)

    gap = log_ratio.abs()
    weight_min, weight_max = masked_min_max(weights, mask)
    metrics = {
        "rollout_corr/gap_mean": masked_mean(gap, mask),
        "rollout_corr/gap_max": masked_min_max(gap, finite)[1],
        "rollout_corr/prob_error": masked_mean((ratio - 1.0).abs(), mask),
        "rollout_corr/weight_mean": masked_mean(weights, mask),
        "rollout_corr/weight_min": weight_min,
        "rollout_corr/weight_max": weight_max,
        "rollout_corr/truncated_frac": masked_mean(truncated.to(dtype), mask),
        "rollout_corr/masked_frac": masked_mean(rejected.to(dtype), mask),
        "rollout_corr/nonfinite": masked_mean(broken.to(dtype), mask),
    }
    return weights, metrics


__all__ = ["CORRECTIONS", "DEFAULT_BOUNDS", "Correction", "correction_weights"]
