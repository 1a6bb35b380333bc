"""Configs of the offline commands (SFT, reward model, DPO): their batching, and defaults
that reach the documented targets on the built-in task with no config file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from posttrain.config.base import RunConfig
from posttrain.config.errors import check
from posttrain.config.packing import PackingFields
from posttrain.core.preference import DPO_LOSS_TYPES


@dataclass
class OfflineConfig(PackingFields, RunConfig):
    """Training on a fixed dataset: batching, epochs and example length."""

    batch_size: int = 16
    """Examples per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimiser step; the loss is normalised over the whole step."""
    epochs: float = 1.0
    """Passes over the training data (ignored when max_steps > 0)."""
    max_length: int = 512
    """Longest tokenised example (prompt + completion) allowed."""
    overlong: str = "error"
    """What to do with a longer example: error, truncate (cut the completion) or drop."""

    def validate(self) -> None:
        super().validate()
        check(self.batch_size >= 1 and self.grad_accum >= 1,
              "batch_size and grad_accum must be ≥ 1")
        self._check_packing()
        check(self.epochs > 0 or self.max_steps > 0, "need epochs > 0 or max_steps > 0")
        check(self.max_length >= 2, "max_length must be ≥ 2")
        check(self.overlong in ("error", "truncate", "drop"),
              "overlong must be error, truncate or drop")

    def total_steps(self, n_examples: int) -> int:
        """Optimiser steps of the run: max_steps, or epochs over ``n_examples``."""
        if self.max_steps > 0:
            return self.max_steps
        return max(1, math.ceil(self.epochs * n_examples / (self.batch_size * self.grad_accum)))


@dataclass
class SFTConfig(OfflineConfig):
    """Supervised fine-tuning on prompt/completion or chat data (loss on completions only)."""

    COMMAND: ClassVar[str] = "sft"
    lr: float = 1e-4
    batch_size: int = 32


@dataclass
class RMConfig(OfflineConfig):
    """Bradley–Terry reward model on prompt/chosen/rejected pairs. The defaults' held-out
    pair accuracy on the built-in task over CPU kernels and seeds: docs/benchmarks.md,
    "Reward-model robustness"."""

    COMMAND: ClassVar[str] = "rm"
    lr: float = 3e-4
    batch_size: int = 16
    epochs: float = 6.0
    center_coef: float = 0.0
    """Weight c of the centring term c·(r_c + r_r)² (0 = off)."""
    head_init: str = "unit_scores"
    """A fresh scalar head (a causal LM's): unit_scores draws it so that its scores of the
    first batch_size training pairs have standard deviation 1; transformers keeps
    transformers' N(0, 0.02²), under which the built-in recipe sat at ln 2 for hundreds of
    steps and ended at 0.74 or 1.00 with the CPU's rounding (docs/benchmarks.md)."""

    def validate(self) -> None:
        super().validate()
        check(self.center_coef >= 0, "center_coef must be ≥ 0")
        check(self.head_init in ("unit_scores", "transformers"),
              "head_init must be unit_scores or transformers")


@dataclass
class DPOConfig(OfflineConfig):
    """Direct preference optimisation against a frozen reference. The defaults lift the
    built-in model's held-out accuracy by about 42 points (docs/benchmarks.md): β = 0.5
    rather than the usual 0.1, because pairs the model already separates then saturate
    sooner and the harder pairs keep their weight; lr 2e-5 over 3 epochs."""

    COMMAND: ClassVar[str] = "dpo"
    lr: float = 2e-5
    batch_size: int = 16
    epochs: float = 3.0
    beta: float = 0.5
    """β: strength of the implicit KL constraint."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), robust (cDPO), ipo or hinge."""
    label_smoothing: float = 0.0
    """ε of the robust (cDPO) loss."""
    ref_model: str | None = None
    """Reference policy; none = the starting model."""
    precompute_ref: bool = True
    """Compute the reference log-likelihoods once before training and free the reference."""
    share_prompt: bool | None = None
    """Run each prompt once for both its completions (its keys and values are shared, with
    gradient); false = two full sequences per pair; none = automatic: on when the pair fits
    one packed forward call (sdpa or eager attention), else on from 2M parameters (below
    that a second forward call costs more than it saves)."""

    def validate(self) -> None:
        super().validate()
        check(self.beta > 0, "beta must be > 0")
        check(self.loss_type in DPO_LOSS_TYPES,
              f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}")
        check(0 <= self.label_smoothing < 0.5, "label_smoothing must be in [0, 0.5)")
