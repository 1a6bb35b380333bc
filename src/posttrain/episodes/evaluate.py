"""Greedy evaluation of episodes: one greedy episode per row, scored as in training."""

from __future__ import annotations

import torch

from posttrain.episodes.loop import EpisodeLimits, run_episodes, score_episodes
from posttrain.rollout import SamplingParams


def greedy_episodes(engine, tokenizer, spec, rows: list[dict], rewards, limits: EpisodeLimits,
                    max_new_tokens: int, stop: tuple[str, ...] = (), batch_size: int = 64,
                    renderer=None, on_error: str = "raise", max_length: int | None = None,
                    completion: str = "transcript"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(correct, total, valid)`` per row: one greedy episode each (``batch_size`` in
    flight), its total the return plus the reward terms (:func:`score_episodes`);
    correct: the total reaches 1."""
    params = SamplingParams(0.0, 1.0, 0, max_new_tokens, stop)
    out = ([], [], [])
    for i in range(0, len(rows), batch_size):
        part = rows[i:i + batch_size]
        eps = run_episodes(engine, tokenizer, spec, part, 1, [None] * len(part), params,
                           limits, on_error, renderer, max_length)
        total, _, valid, correct = score_episodes(eps, part, rewards, on_error, completion)
        for acc, x in zip(out, (correct, total, valid), strict=True):
            acc.append(x)
    return tuple(torch.cat(x) for x in out)


def evaluate_episodes(engine, tokenizer, spec, rows: list[dict], rewards, limits: EpisodeLimits,
                      max_new_tokens: int, batch_size: int = 64, renderer=None,
                      completion: str = "transcript") -> dict[str, float]:
    """``accuracy`` (share of episodes whose total reaches 1), ``mean_reward`` and ``n``
    (what ``posttrain eval --env`` prints)."""
    correct, total, valid = greedy_episodes(engine, tokenizer, spec, rows, rewards, limits,
                                            max_new_tokens, batch_size=batch_size,
                                            renderer=renderer, on_error="skip",
                                            completion=completion)
    n = len(rows)
    mean = float(total[valid].double().mean()) if valid.any() else float("nan")
    return {"accuracy": float(correct.sum()) / n, "mean_reward": mean, "n": n,
            **({"skipped": int((~valid).sum())} if not valid.all() else {})}
