"""The pure algorithm layer: tensors and floats in, tensors out. Imports only ``torch``.

Nothing here reads a config object, calls ``.item()`` or talks to ``torch.distributed``; the
trainers do that. See ``docs/algorithms.md`` for the objectives and ``posttrain.core.algorithms``
for how each RL algorithm combines these pieces.
"""

from posttrain.core.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
)
from posttrain.core.aggregate import AGGREGATIONS, aggregate_loss, step_normalizer
from posttrain.core.algorithms import ALGORITHMS, Algorithm, get_algorithm
from posttrain.core.correction import CORRECTIONS, Correction, correction_weights
from posttrain.core.dapo import groups_with_signal, overlong_penalty
from posttrain.core.kl import AdaptiveKLController, FixedKLController, kl_penalty
from posttrain.core.logprobs import token_entropy, token_logprobs
from posttrain.core.masked import (
    RunningMoments,
    masked_count,
    masked_mean,
    masked_min_max,
    masked_sum,
    masked_var,
    masked_whiten,
)
from posttrain.core.policy import (
    explained_variance,
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
    value_loss,
)
from posttrain.core.preference import bradley_terry_loss, dpo_loss

__all__ = [
    "AGGREGATIONS", "ALGORITHMS", "CORRECTIONS", "AdaptiveKLController", "Algorithm",
    "Correction", "FixedKLController", "RunningMoments",
    "aggregate_loss", "bradley_terry_loss", "correction_weights", "discounted_returns", "dpo_loss",
    "explained_variance", "gae", "get_algorithm", "group_advantages", "groups_with_signal",
    "gspo_loss", "gspo_token_loss", "kl_penalty", "masked_count", "masked_mean",
    "masked_min_max", "masked_sum", "masked_var", "masked_whiten", "overlong_penalty",
    "ppo_clip_loss", "reinforce_pp_advantages", "rloo_advantages", "step_normalizer",
    "token_entropy", "token_level_rewards", "token_logprobs", "value_loss",
]
