"""The RL algorithms as records: which advantage estimator, which policy loss, which
aggregation, which clip range and KL terms. One on-policy loop reads these records; adding an
algorithm means one table entry (and, if it brings a new piece, one function in the maps
below) — never an ``if algo == ...`` branch in a trainer.

name                  advantage           loss        aggregation    ε_low/high  KL term
ppo                   gae (critic)        ppo_clip    token_mean     0.2/0.2     reward, k1 0.05
grpo                  group               ppo_clip    seq_mean       0.2/0.2     loss, k3 0.04
dapo                  group               ppo_clip    token_mean     0.2/0.28    —
gspo                  group               gspo        seq_mean       3e-4/4e-4   —
gspo_token            group               gspo_token  seq_mean       3e-4/4e-4   —
dr_grpo               group_no_std        ppo_clip    seq_sum_const  0.2/0.2     —
rloo                  rloo                ppo_clip    seq_mean       0.2/0.2     loss, k3 0.04
reinforce_pp          reinforce_pp        ppo_clip    token_mean     0.2/0.2     reward, k1 0.01
reinforce_pp_baseline ..._baseline          ppo_clip    token_mean     0.2/0.2     reward, k1 0.01

DAPO also turns on dynamic sampling and overlong reward shaping.
Variants and what they leave out: ``rloo`` uses the leave-one-out baseline inside GRPO's
clipped, KL-regularised objective (the paper's KL-in-reward form is ``reinforce_pp`` with a
leave-one-out baseline, not provided). ``dr_grpo``'s constant ``C`` is the maximum number of
new tokens (:meth:`Algorithm.loss_constant`). Besides the math, the record says what the
loop needs: whether zero advantage means zero gradient, whether rewards are per token.
The commands take their algorithms from this table: ``posttrain grpo`` those without a
critic, ``posttrain ppo`` those with per-token rewards (:func:`algorithm_names`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.core.advantages import (
    gae,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
)
from posttrain.core.aggregate import AGGREGATIONS
from posttrain.core.kl import KL_ESTIMATORS, kl_penalty
from posttrain.core.masked import masked_mean, masked_whiten
from posttrain.core.policy import gspo_loss, gspo_token_loss, ppo_clip_loss


@dataclass(frozen=True)
class Algorithm:
    """One RL algorithm as a combination of the pure pieces, with its default
    hyper-parameters. Trainers override fields with :meth:`replace`."""

    name: str
    advantage: str
    """Key of :data:`ADVANTAGE_ESTIMATORS`."""
    policy_loss: str
    """Key of :data:`POLICY_LOSSES`."""
    aggregation: str
    """One of :data:`posttrain.core.aggregate.AGGREGATIONS`."""
    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at ``1 - clip_low``."""
    clip_high: float = 0.2
    """ε_high: the ratio is clipped above at ``1 + clip_high`` (clip-higher when > clip_low)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages, or None."""
    kl_coef: float = 0.0
    """β of the KL-to-reference term added to the per-token loss (0: no term)."""
    kl_estimator: str = "k3"
    """Estimator of the loss KL term."""
    reward_kl_coef: float = 0.0
    """k of the KL penalty folded into per-token rewards (PPO, REINFORCE++)."""
    reward_kl_estimator: str = "k1"
    """Estimator of the reward KL penalty."""
    gamma: float = 1.0
    """Discount for token-level returns (GAE, REINFORCE++)."""
    lam: float = 0.95
    """GAE λ."""
    critic: bool = False
    """Whether a value model is trained alongside the policy."""
    value_clip: float | None = 0.2
    """ε_v of the clipped value loss (critic only)."""
    value_coef: float = 0.5
    """c_v, the weight of the value loss (critic only)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and sample more (DAPO)."""
    overlong_shaping: bool = False
    """Add DAPO's soft overlong penalty to the reward."""

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"{self.name}: unknown advantage estimator {self.advantage!r}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"{self.name}: unknown policy loss {self.policy_loss!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"{self.name}: unknown aggregation {self.aggregation!r}")
        for est in (self.kl_estimator, self.reward_kl_estimator):
            if est not in KL_ESTIMATORS:
                raise ValueError(f"{self.name}: unknown KL estimator {est!r}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"{self.name}: need 0 ≤ clip_low < 1 and clip_high ≥ 0")
        if self.advantage == "gae" and not self.critic:
            raise ValueError(f"{self.name}: GAE needs a critic")

    @property
    def needs_reference(self) -> bool:
        """Whether reference log-probabilities must be computed."""
        return self.kl_coef > 0 or self.reward_kl_coef > 0

    @property
    def needs_groups(self) -> bool:
        """Whether the advantage compares samples of the same prompt (G > 1 needed)."""
        return self.advantage in GROUP_ESTIMATORS

    @property
    def token_rewards(self) -> bool:
        """Whether rewards are per token (a KL penalty folded into each token's reward, then
        returns over the completion): the RLHF family, ``posttrain ppo``'s algorithms."""
        return self.advantage in TOKEN_REWARD_ESTIMATORS

    @property
    def zero_advantage_zero_gradient(self) -> bool:
        """Whether a sample whose advantage is 0 on every token adds nothing to the policy
        gradient, so the update may skip its forward and backward pass. Every policy loss of
        the table is ``-A · f(ratio)``; only a KL term in the loss (β > 0) gives such a
        sample a gradient. (A critic still trains on it.)"""
        return self.kl_coef == 0

    def loss_constant(self, max_new_tokens: int) -> float:
        """The constant ``C`` the aggregation divides by: Dr. GRPO's ``seq_sum_const`` uses
        the token budget, so the loss of a sequence does not depend on its length; 1 for
        every other aggregation (which ignores it)."""
        return float(max_new_tokens) if self.aggregation == "seq_sum_const" else 1.0

    def replace(self, **changes) -> Algorithm:
        return dataclasses.replace(self, **changes)


# --- advantage estimators: one uniform signature --------------------------------------------
# (algo, scores (B,), group_ids (B,), response_mask (B,T), old_logprobs, ref_logprobs, values)
#   -> (advantages (B,T), returns (B,T) or None)

def _broadcast(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), seq_adv.unsqueeze(-1).to(torch.float32), 0.0)


def _reward_kl(algo, mask, old_logprobs, ref_logprobs):
    if algo.reward_kl_coef == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if old_logprobs is None or ref_logprobs is None:
        raise ValueError(f"{algo.name}: reward_kl_coef > 0 needs old_logprobs and ref_logprobs")
    return kl_penalty(old_logprobs, ref_logprobs, algo.reward_kl_estimator)


def _adv_group(algo, scores, group_ids, mask, old_logprobs, ref_logprobs, values):
    return _broadcast(group_advantages(scores, group_ids, scale_by_std=True), mask), None


def _adv_group_no_std(algo, scores, group_ids, mask, old_logprobs, ref_logprobs, values):
    return _broadcast(group_advantages(scores, group_ids, scale_by_std=False), mask), None


def _adv_rloo(algo, scores, group_ids, mask, old_logprobs, ref_logprobs, values):
    return _broadcast(rloo_advantages(scores, group_ids), mask), None


def _adv_gae(algo, scores, group_ids, mask, old_logprobs, ref_logprobs, values):
    if values is None:
        raise ValueError("GAE needs critic values")
    kl = _reward_kl(algo, mask, old_logprobs, ref_logprobs)
    rewards = token_level_rewards(scores, kl, mask, algo.reward_kl_coef)
    adv, returns = gae(rewards, values.detach().float(), mask, algo.gamma, algo.lam)
    return masked_whiten(adv, mask), returns


def _adv_reinforce_pp(algo, scores, group_ids, mask, old_logprobs, ref_logprobs, values):
    kl = _reward_kl(algo, mask, old_logprobs, ref_logprobs)
    rewards = token_level_rewards(scores, kl, mask, algo.reward_kl_coef)
    return reinforce_pp_advantages(rewards, mask, algo.gamma)


def _adv_reinforce_pp_baseline(algo, scores, group_ids, mask, old_logprobs, ref_logprobs,
                               values):
    centred = group_advantages(scores, group_ids, scale_by_std=False)
    return _adv_reinforce_pp(algo, centred, group_ids, mask, old_logprobs, ref_logprobs, values)


ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "group": _adv_group,
    "group_no_std": _adv_group_no_std,
    "rloo": _adv_rloo,
    "gae": _adv_gae,
    "reinforce_pp": _adv_reinforce_pp,
    "reinforce_pp_baseline": _adv_reinforce_pp_baseline,
}
GROUP_ESTIMATORS = frozenset({"group", "group_no_std", "rloo", "reinforce_pp_baseline"})
TOKEN_REWARD_ESTIMATORS = frozenset({"gae", "reinforce_pp", "reinforce_pp_baseline"})

POLICY_LOSSES: dict[str, Callable] = {
    "ppo_clip": lambda algo, lp, old, adv, mask: ppo_clip_loss(
        lp, old, adv, mask, algo.clip_low, algo.clip_high, algo.dual_clip),
    "gspo": lambda algo, lp, old, adv, mask: gspo_loss(
        lp, old, adv, mask, algo.clip_low, algo.clip_high),
    "gspo_token": lambda algo, lp, old, adv, mask: gspo_token_loss(
        lp, old, adv, mask, algo.clip_low, algo.clip_high),
}


@torch.no_grad()
def compute_advantages(
    algo: Algorithm,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages ``(B, T)`` (and returns for the critic, else None) for ``algo``.

    ``scores`` ``(B,)`` are sequence rewards; ``group_ids`` ``(B,)`` say which prompt each
    sample came from. Token-level estimators use ``old_logprobs``/``ref_logprobs`` ``(B, T)``
    for the reward KL penalty and ``values`` ``(B, T)`` for GAE.
    """
    fn = ADVANTAGE_ESTIMATORS[algo.advantage]
    return fn(algo, scores.float(), group_ids, response_mask, old_logprobs, ref_logprobs, values)


def policy_objective(
    algo: Algorithm,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss ``(B, T)`` of ``algo``: its policy loss plus ``β · KL`` to the reference
    when ``kl_coef > 0``; aggregate it with ``aggregate_loss(..., algo.aggregation, ...)``."""
    loss, metrics = POLICY_LOSSES[algo.policy_loss](algo, logprobs, old_logprobs, advantages,
                                                    response_mask)
    if algo.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"{algo.name}: kl_coef > 0 needs ref_logprobs")
        kl = kl_penalty(logprobs, ref_logprobs, algo.kl_estimator)
        loss = loss + algo.kl_coef * torch.where(response_mask.bool(), kl, 0.0)
        metrics["kl"] = masked_mean(kl.detach(), response_mask)
    return loss, metrics


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in [
        Algorithm("ppo", "gae", "ppo_clip", "token_mean", critic=True, reward_kl_coef=0.05),
        Algorithm("grpo", "group", "ppo_clip", "seq_mean", kl_coef=0.04),
        Algorithm("dapo", "group", "ppo_clip", "token_mean", clip_high=0.28,
                  dynamic_sampling=True, overlong_shaping=True),
        Algorithm("gspo", "group", "gspo", "seq_mean", clip_low=3e-4, clip_high=4e-4),
        Algorithm("gspo_token", "group", "gspo_token", "seq_mean", clip_low=3e-4,
                  clip_high=4e-4),
        Algorithm("dr_grpo", "group_no_std", "ppo_clip", "seq_sum_const"),
        Algorithm("rloo", "rloo", "ppo_clip", "seq_mean", kl_coef=0.04),
        Algorithm("reinforce_pp", "reinforce_pp", "ppo_clip", "token_mean",
                  reward_kl_coef=0.01),
        Algorithm("reinforce_pp_baseline", "reinforce_pp_baseline", "ppo_clip", "token_mean",
                  reward_kl_coef=0.01),
    ]
}


def algorithm_names(*, critic: bool | None = None, token_rewards: bool | None = None
                    ) -> list[str]:
    """Names of the table's algorithms, in table order, filtered by whether they train a
    critic and whether their rewards are per token (None: either)."""
    return [name for name, a in ALGORITHMS.items()
            if (critic is None or a.critic == critic)
            and (token_rewards is None or a.token_rewards == token_rewards)]


def get_algorithm(name: str, **overrides) -> Algorithm:
    """The table entry ``name``, with field overrides applied (and validated)."""
    try:
        algo = ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose from {sorted(ALGORITHMS)}") from None
    return algo.replace(**overrides) if overrides else algo
