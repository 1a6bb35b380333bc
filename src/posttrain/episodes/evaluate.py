"""Greedy evaluation of episodes: one greedy episode per row, scored as in training."""

from __future__ import annotations

import torch

from posttrain.rollout import SamplingParams


def greedy_episodes(experience, rows: list[dict], batch_size: int = 64
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(correct, total, valid)`` per row of one greedy episode each through
    ``experience``'s engine, environment and reward terms (an
    :class:`~posttrain.trainers.online.experience.ExperienceMaker`); correct: the
    episode's total reaches 1."""
    p = experience.params
    params = SamplingParams(0.0, 1.0, 0, p.max_new_tokens, p.stop)
    out = ([], [], [])
    for i in range(0, len(rows), batch_size):
        part = rows[i:i + batch_size]
        _, (total, _, valid, correct), _, _ = experience.sample(
            part, [None] * len(part), 1, params, shaping=False)
        for acc, x in zip(out, (correct, total, valid), strict=True):
            acc.append(x)
    return tuple(torch.cat(x) for x in out)
