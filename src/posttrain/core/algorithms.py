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
new tokens (:meth:`Algorithm.loss_constant`). Besides the math, each piece declares what the
loop needs: an estimator (:class:`Estimator`) which inputs it reads, whether it compares a
group's samples and whether its rewards are per token; a policy loss (:class:`PolicyLoss`)
its inputs and whether a zero advantage gives a zero gradient. The record's properties are
read off those declarations, never kept by hand beside them.
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
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"{self.name}: dual_clip must be > 1 (or none), got "
                             f"{self.dual_clip}")
        if self.advantage == "gae" and not self.critic:
            raise ValueError(f"{self.name}: GAE needs a critic")

    @property
    def estimator(self) -> Estimator:
        return ADVANTAGE_ESTIMATORS[self.advantage]

    @property
    def loss(self) -> PolicyLoss:
        return POLICY_LOSSES[self.policy_loss]

    @property
    def advantage_inputs(self) -> frozenset[str]:
        """The inputs of :class:`AdvantageInputs` this algorithm's estimator reads: the
        estimator's own, plus the old and reference log-probs when a reward KL penalty is on."""
        extra = {"old_logprobs", "ref_logprobs"} if self.reward_kl_coef else set()
        return self.estimator.inputs | extra

    @property
    def loss_inputs(self) -> frozenset[str]:
        """The inputs of :class:`PolicyInputs` the loss reads (the reference's with β > 0)."""
        return self.loss.inputs | ({"ref_logprobs"} if self.kl_coef > 0 else set())

    @property
    def needs_reference(self) -> bool:
        """Whether reference log-probabilities must be computed."""
        return "ref_logprobs" in self.advantage_inputs | self.loss_inputs

    @property
    def needs_groups(self) -> bool:
        """Whether the advantage compares samples of the same prompt (G > 1 needed)."""
        return self.estimator.groups

    @property
    def token_rewards(self) -> bool:
        """Whether rewards are per token (a KL penalty folded into each token's reward, then
        returns over the completion): the RLHF family, ``posttrain ppo``'s algorithms."""
        return self.estimator.token_rewards

    @property
    def zero_advantage_zero_gradient(self) -> bool:
        """Whether a sample whose advantage is 0 on every token adds nothing to the policy
        gradient, so the update may skip its forward and backward pass: the policy loss
        declares it (:attr:`PolicyLoss.zero_advantage_zero_gradient`) and no other term of
        the per-token loss is on (the KL term, β > 0, gives such a sample a gradient). A
        critic still trains on it."""
        return self.loss.zero_advantage_zero_gradient and self.kl_coef == 0

    def loss_constant(self, max_new_tokens: int) -> float:
        """The constant ``C`` the aggregation divides by: Dr. GRPO's ``seq_sum_const`` uses
        the token budget, so the loss of a sequence does not depend on its length; 1 for
        every other aggregation (which ignores it)."""
        return float(max_new_tokens) if self.aggregation == "seq_sum_const" else 1.0

    def replace(self, **changes) -> Algorithm:
        return dataclasses.replace(self, **changes)


# --- the pieces an algorithm combines, each a function with what it declares -----------------

@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator may read. ``scores`` ``(B,)`` sequence rewards,
    ``group_ids`` ``(B,)`` the prompt each sample came from, ``response_mask`` ``(B, T)``;
    ``old_logprobs``, ``ref_logprobs``, ``values`` ``(B, T)`` or None when not computed;
    ``sample_ids`` ``(B,)`` or None."""

    scores: torch.Tensor
    group_ids: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    sample_ids: torch.Tensor | None = None
    """``(B,)`` rows of one sample share an id (a split agent episode's trajectories);
    group statistics are over samples. None: a row per sample."""


@dataclass(frozen=True)
class PolicyInputs:
    """What a policy loss may read, all ``(B, T)`` (``advantages`` may be ``(B,)``):
    ``logprobs`` (with gradient), ``old_logprobs`` (the trainer's at the sampling
    weights), ``advantages``, ``response_mask``, ``ref_logprobs``, ``behaviour_logprobs``
    (the engine's, of the distribution actually sampled) and ``weights`` (per-token
    importance weights of the mismatch correction, detached; they scale the policy loss),
    each None when not computed."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    weights: torch.Tensor | None = None


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: ``fn(algo, x: AdvantageInputs) -> (advantages (B, T),
    returns (B, T) or None)`` and what it declares."""

    fn: Callable[[Algorithm, AdvantageInputs], tuple[torch.Tensor, torch.Tensor | None]]
    inputs: frozenset[str]
    """Fields of :class:`AdvantageInputs` it reads (beyond the reward KL's, which
    :attr:`Algorithm.advantage_inputs` adds)."""
    groups: bool = False
    """It compares samples of one prompt (needs group_size ≥ 2)."""
    token_rewards: bool = False
    """Its rewards are per token (a KL penalty folded in, returns over the completion)."""


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss: ``fn(algo, x: PolicyInputs) -> (per-token loss (B, T), metrics)`` and
    what it declares."""

    fn: Callable[[Algorithm, PolicyInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    inputs: frozenset[str] = frozenset({"logprobs", "old_logprobs", "advantages",
                                        "response_mask"})
    """Fields of :class:`PolicyInputs` it reads."""
    zero_advantage_zero_gradient: bool = True
    """A sample whose advantage is 0 on every token gets no gradient from it (true of any
    loss of the form −A·f(ratio)); false for a loss with a term that does not vanish with A
    (an entropy bonus, say), so the update never skips such samples."""
    reads: frozenset[str] = frozenset({"clip_low", "clip_high"})
    """The record's fields it reads (a config key for one it does not read is refused)."""


_BASE = frozenset({"scores", "group_ids", "response_mask"})


def _broadcast(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), seq_adv.unsqueeze(-1).to(torch.float32), 0.0)


def _reward_kl(algo: Algorithm, x: AdvantageInputs) -> torch.Tensor:
    if algo.reward_kl_coef == 0:
        return torch.zeros(x.response_mask.shape, dtype=torch.float32,
                           device=x.response_mask.device)
    return kl_penalty(x.old_logprobs, x.ref_logprobs, algo.reward_kl_estimator)


def _adv_group(algo, x):
    return _broadcast(group_advantages(x.scores, x.group_ids, scale_by_std=True,
                                       sample_ids=x.sample_ids),
                      x.response_mask), None


def _adv_group_no_std(algo, x):
    return _broadcast(group_advantages(x.scores, x.group_ids, scale_by_std=False,
                                       sample_ids=x.sample_ids),
                      x.response_mask), None


def _adv_rloo(algo, x):
    return _broadcast(rloo_advantages(x.scores, x.group_ids, x.sample_ids),
                      x.response_mask), None


def _adv_gae(algo, x):
    rewards = token_level_rewards(x.scores, _reward_kl(algo, x), x.response_mask,
                                  algo.reward_kl_coef)
    adv, returns = gae(rewards, x.values.detach().float(), x.response_mask, algo.gamma,
                       algo.lam)
    return masked_whiten(adv, x.response_mask), returns


def _adv_reinforce_pp(algo, x):
    rewards = token_level_rewards(x.scores, _reward_kl(algo, x), x.response_mask,
                                  algo.reward_kl_coef)
    return reinforce_pp_advantages(rewards, x.response_mask, algo.gamma)


def _adv_reinforce_pp_baseline(algo, x):
    centred = group_advantages(x.scores, x.group_ids, scale_by_std=False,
                               sample_ids=x.sample_ids)
    return _adv_reinforce_pp(algo, dataclasses.replace(x, scores=centred))


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "group": Estimator(_adv_group, _BASE, groups=True),
    "group_no_std": Estimator(_adv_group_no_std, _BASE, groups=True),
    "rloo": Estimator(_adv_rloo, _BASE, groups=True),
    "gae": Estimator(_adv_gae, _BASE | {"values"}, token_rewards=True),
    "reinforce_pp": Estimator(_adv_reinforce_pp, _BASE, token_rewards=True),
    "reinforce_pp_baseline": Estimator(_adv_reinforce_pp_baseline, _BASE, groups=True,
                                       token_rewards=True),
}

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": PolicyLoss(lambda algo, x: ppo_clip_loss(
        x.logprobs, x.old_logprobs, x.advantages, x.response_mask, algo.clip_low,
        algo.clip_high, algo.dual_clip), reads=frozenset({"clip_low", "clip_high",
                                                         "dual_clip"})),
    "gspo": PolicyLoss(lambda algo, x: gspo_loss(
        x.logprobs, x.old_logprobs, x.advantages, x.response_mask, algo.clip_low,
        algo.clip_high)),
    "gspo_token": PolicyLoss(lambda algo, x: gspo_token_loss(
        x.logprobs, x.old_logprobs, x.advantages, x.response_mask, algo.clip_low,
        algo.clip_high)),
}


def _missing(inputs: frozenset[str], x, what: str, algo: Algorithm) -> None:
    """One clear error for a declared input that was not given."""
    absent = sorted(k for k in inputs if getattr(x, k) is None)
    if absent:
        raise ValueError(f"{algo.name}: its {what} needs {', '.join(absent)}")


@torch.no_grad()
def compute_advantages(
    algo: Algorithm,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    sample_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages ``(B, T)`` (and returns for the critic, else None) for ``algo``.

    ``scores`` ``(B,)`` are sequence rewards; ``group_ids`` ``(B,)`` say which prompt each
    sample came from. Token-level estimators use ``old_logprobs``/``ref_logprobs`` ``(B, T)``
    for the reward KL penalty and ``values`` ``(B, T)`` for GAE; an input the algorithm
    declares (:attr:`Algorithm.advantage_inputs`) and that is None is an error.
    ``sample_ids`` ``(B,)``: rows of one sample share an id and its score (a split agent
    episode's trajectories), so that group statistics are over samples; None: a row each.
    """
    x = AdvantageInputs(scores.float(), group_ids, response_mask, old_logprobs, ref_logprobs,
                        values, sample_ids)
    _missing(algo.advantage_inputs, x, f"advantage estimator {algo.advantage!r}", algo)
    return algo.estimator.fn(algo, x)


def policy_objective(algo: Algorithm, x: PolicyInputs, correction=None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss ``(B, T)`` of ``algo`` on the inputs ``x``: its policy loss, scaled
    per token by ``x.weights`` (or by the weights of ``correction``, a
    :class:`posttrain.core.correction.Correction`, from the old and behaviour log-probs,
    whose metrics join the loss's), plus ``β · KL`` to the reference when ``kl_coef > 0``
    (not scaled: the KL term is to the reference, not to the sampler). Aggregate it with
    ``aggregate_loss(..., algo.aggregation, ...)``."""
    _missing(algo.loss_inputs, x, f"policy loss {algo.policy_loss!r} (with kl_coef > 0)"
             if algo.kl_coef > 0 else f"policy loss {algo.policy_loss!r}", algo)
    metrics: dict[str, torch.Tensor] = {}
    if correction is not None and x.behaviour_logprobs is not None:
        from posttrain.core.correction import correction_weights

        w, metrics = correction_weights(x.old_logprobs, x.behaviour_logprobs,
                                        x.response_mask, correction)
        x = dataclasses.replace(x, weights=w)
    loss, m = algo.loss.fn(algo, x)
    metrics.update(m)
    if x.weights is not None:
        loss = loss * x.weights.detach().to(loss.dtype)
    if algo.kl_coef > 0:
        kl = kl_penalty(x.logprobs, x.ref_logprobs, algo.kl_estimator)
        loss = loss + algo.kl_coef * torch.where(x.response_mask.bool(), kl, 0.0)
        metrics["kl"] = masked_mean(kl.detach(), x.response_mask)
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
