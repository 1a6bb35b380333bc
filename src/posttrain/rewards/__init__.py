"""Rewards for the online trainers: Python functions, a trained reward model, the built-in
verifiable terms, or several of them with weights (docs/rewards.md).

A reward function is ``f(prompts, completions, **columns) -> list[float]``: ``columns`` are
the data set's other columns, one value per sample.

- :mod:`.terms`: what ``--reward`` names, loaded with weights;
- :mod:`.scoring`: calling the terms on a batch (workers, timeouts, failures) and the
  weighted total;
- :mod:`.verifiable`: ``math``, ``format``, ``length``; :mod:`.code`: ``code``, which runs
  model-written programs in :mod:`posttrain.sandbox`.
"""

from posttrain.rewards.code import CodeReward, code_reward
from posttrain.rewards.scoring import RewardError, reward_columns, score
from posttrain.rewards.terms import (
    RewardModelReward,
    RewardOptions,
    RewardTerm,
    load_reward,
    load_reward_function,
    parse_rewards,
)
from posttrain.rewards.verifiable import final_answer, format_reward, length_penalty, math_reward

__all__ = [
    "CodeReward", "RewardError", "RewardModelReward", "RewardOptions", "RewardTerm",
    "code_reward", "final_answer", "format_reward", "length_penalty", "load_reward",
    "load_reward_function", "math_reward", "parse_rewards", "reward_columns", "score",
]
