"""The keys of ``posttrain distill``: on-policy distillation from a teacher
(docs/algorithms.md, 12)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.config.errors import check
from posttrain.config.rl import RLConfig


@dataclass
class DistillConfig(RLConfig):
    """``posttrain distill``: on-policy distillation on the RL loop (docs/algorithms.md). The
    student samples; the teacher's whole next-token distribution at every sampled position
    is the target; the loss is the per-token divergence of ``beta``. The reward terms are
    scored and logged (accuracy, the sample tables), and train with ``reward_coef``."""

    COMMAND: ClassVar[str] = "distill"
    teacher: str | None = None
    """The teacher: a model directory, hub id or builtin, with the student's vocabulary
    (required)."""
    beta: float = 1.0
    """The divergence: 1 = reverse KL(student‖teacher), 0 = forward KL(teacher‖student),
    between = the generalised Jensen–Shannon divergence of that β."""
    reward_coef: float = 0.0
    """Also train on the reward terms: this weight times the algorithm's clipped
    policy-gradient loss of their advantages (GRPO's group advantages by default), against
    the sampling policy's log-probs; 0 = the rewards are scored and logged only."""
    kl_coef: float | None = 0.0
    share_prompt: bool | None = False
    group_size: int = 4
    prompts_per_step: int = 16
    minibatch_size: int = 64
    micro_batch_size: int = 64
    lr: float = 1e-4

    @property
    def run_name(self) -> str:
        return "distill"

    def validate(self) -> None:
        super().validate()
        check(self.teacher is not None, "distill needs --teacher DIR (a model with the "
              "student's vocabulary)")
        check(0.0 <= self.beta <= 1.0, f"beta must be in [0, 1], got {self.beta}")
        check(self.reward_coef >= 0, f"reward_coef must be ≥ 0, got {self.reward_coef}")
        check(not self.episodic, "distill trains single-turn completions (no --env, --tools "
              "or --agent yet)")
        check(self.share_prompt is not True, "distill runs whole sequences (share_prompt "
              "false)")
        check(self.kl_coef in (None, 0.0), "distill has no reference policy: leave kl_coef 0")
