"""Greedy evaluation of episodes: one greedy episode per row, scored as in training."""

from __future__ import annotations

import torch

from posttrain.episodes.loop import (
    EpisodeLimits,
    Episodes,
    reward_inputs,
    run_episodes,
    score_episodes,
)
from posttrain.rollout import SamplingParams


def greedy_episodes(engine, tokenizer, spec, rows: list[dict], rewards, limits: EpisodeLimits,
                    max_new_tokens: int, stop: tuple[str, ...] = (), batch_size: int = 64,
                    renderer=None, on_error: str = "raise", max_length: int | None = None,
                    completion: str = "transcript", errors: list[str] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(correct, total, valid)`` per row: one greedy episode each (``batch_size`` in
    flight), its total the return plus the reward terms (:func:`score_episodes`);
    correct: the total reaches 1. ``errors``: where given, one line per skipped row is
    appended to it, in row order (:func:`why_skipped`)."""
    params = SamplingParams(0.0, 1.0, 0, max_new_tokens, stop)
    out = ([], [], [])
    for i in range(0, len(rows), batch_size):
        part = rows[i:i + batch_size]
        eps = run_episodes(engine, tokenizer, spec, part, 1, [None] * len(part), params,
                           limits, on_error, renderer, max_length)
        total, _, valid, correct = score_episodes(eps, part, rewards, on_error, completion)
        if errors is not None:
            errors += why_skipped(eps, part, rewards, valid, completion, i)
        for acc, x in zip(out, (correct, total, valid), strict=True):
            acc.append(x)
    return tuple(torch.cat(x) for x in out)


def why_skipped(eps: Episodes, rows: list[dict], rewards, valid: torch.Tensor,
                completion: str = "transcript", offset: int = 0) -> list[str]:
    """A line for each skipped episode of ``rows`` (one episode per row), in row order: its
    environment's error (which names the row), else its reward's, found by scoring the
    episode again alone and raising (named by the row's ``_row``, else ``offset`` + its
    number)."""
    from posttrain.rewards import score

    env_errors = iter(eps.errors)
    prompts, texts, columns = reward_inputs(eps, rows, completion)
    out = []
    for k in (~valid).nonzero().flatten().tolist():
        if not eps.valid[k]:
            out.append(next(env_errors))
            continue
        why = "a reward term failed"
        try:
            score(rewards, prompts[k:k + 1], texts[k:k + 1],
                  {c: v[k:k + 1] for c, v in columns.items()}, "raise")
        except Exception as e:
            why = str(e)
        out.append(f"row {rows[k].get('_row', offset + k + 1)}: {why}")
    return out


def evaluate_episodes(engine, tokenizer, spec, rows: list[dict], rewards, limits: EpisodeLimits,
                      max_new_tokens: int, batch_size: int = 64, renderer=None,
                      completion: str = "transcript", errors: list[str] | None = None
                      ) -> dict[str, float]:
    """``accuracy`` (share of episodes whose total reaches 1), ``mean_reward`` and ``n``
    (what ``posttrain eval --env`` prints), and ``skipped`` where rows were skipped (why:
    a line each in ``errors``, where given)."""
    correct, total, valid = greedy_episodes(engine, tokenizer, spec, rows, rewards, limits,
                                            max_new_tokens, batch_size=batch_size,
                                            renderer=renderer, on_error="skip",
                                            completion=completion, errors=errors)
    return summary(correct, total, valid)


def summary(correct: torch.Tensor, total: torch.Tensor, valid: torch.Tensor) -> dict:
    """What ``posttrain eval`` prints of greedy episodes' per-row ``(correct, total,
    valid)``: ``accuracy`` over every row (a skipped one is wrong), ``mean_reward`` over the
    valid ones, ``n``, and ``skipped`` where any were."""
    n = len(correct)
    mean = float(total[valid].double().mean()) if valid.any() else float("nan")
    return {"accuracy": float(correct.sum()) / n if n else float("nan"), "mean_reward": mean,
            "n": n, **({"skipped": int((~valid).sum())} if not valid.all() else {})}
