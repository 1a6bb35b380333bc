"""KL estimators between the policy and a frozen reference, and KL-coefficient controllers.

For a token sampled from the policy, with ``r = ℓ - ℓ_ref`` (log π/π_ref):

    k1 = r                       unbiased, can be negative
    k2 = r² / 2                  biased, low variance, non-negative
    k3 = exp(-r) - 1 + r         unbiased, non-negative (Schulman, "Approximating KL")

k3 is the estimator GRPO adds to its loss (docs/algorithms.md §4). Its ``exp(-r)`` overflows float32
when ``r < -88``; we clamp ``r`` to ``[-clamp, clamp]`` inside the exponential and the linear
term (default 20), which leaves every realistic value exact and keeps gradients finite.
"""

from __future__ import annotations

import math

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k3",
    clamp: float = 20.0,
) -> torch.Tensor:
    """Per-token KL estimate, shape of the inputs (``(B, T)``).

    Gradients flow through ``logprobs`` only; ``ref_logprobs`` is treated as a constant.
    """
    r = logprobs - ref_logprobs.detach()
    if estimator == "k1":
        return r
    if estimator == "k2":
        return 0.5 * r.square()
    if estimator == "k3":
        r = r.clamp(-clamp, clamp)
        # expm1, not exp(-r) - 1: the latter cancels catastrophically for small |r| and goes
        # negative in float32 (about -6e-8 at |r| ~ 1e-4, where the true value is ~5e-9).
        return torch.expm1(-r) + r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """Ziegler et al. (2019), arXiv 1909.08593, §2.2: a proportional controller on log-space.

        e = clip(KL / target - 1, -0.2, 0.2)
        k ← k · (1 + e · min(n_steps / horizon, 1))

    ``n_steps`` is the number of samples (or optimiser steps) since the last update. The
    step fraction is capped at 1, so one update moves k by at most ±20% and k stays
    positive however short the horizon.
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if not (math.isfinite(target) and math.isfinite(horizon)) or target <= 0 or horizon <= 0:
            raise ValueError("adaptive KL needs finite target > 0 and horizon > 0")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        if not math.isfinite(current_kl):
            return self.value
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * min(n_steps / self.horizon, 1.0)
        return self.value
