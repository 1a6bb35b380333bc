"""Greedy evaluation: accuracy and mean reward of a policy's completions.

``accuracy`` is the share of completions whose reward reaches ``threshold`` (1.0: a
verifiable 0/1 reward counts exact answers); ``mean_reward`` is the plain mean.
"""

from __future__ import annotations

from collections.abc import Callable

from posttrain.rewards import RewardTerm, reward_columns, score


def greedy_completions(engine, prompts: list[str], max_new_tokens: int = 16,
                       batch_size: int = 64) -> list[str]:
    """Greedy completions (text up to eos) of ``prompts`` from a rollout ``engine``
    (``posttrain.rollout``; tested token-for-token equal to
    ``model.generate(do_sample=False)``)."""
    from posttrain.rollout import SamplingParams, requests_for

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    out: list[str] = []
    for i in range(0, len(prompts), batch_size):
        requests = requests_for(engine.tokenizer, prompts[i:i + batch_size])
        out.extend(engine.generate(requests, 1, params).texts)
    return out


def evaluate_policy(model, tokenizer, rows: list[dict], reward_fn: Callable,
                    max_new_tokens: int = 16, batch_size: int = 64, threshold: float = 1.0,
                    engine=None) -> dict[str, float]:
    """Greedy-decode every row's prompt (through ``engine``, default the ``auto`` engine of
    ``model``), score with ``reward_fn(prompts, completions, **columns)``; return accuracy,
    mean reward and the count."""
    from posttrain.rollout import make_engine

    engine = engine or make_engine("auto", model, tokenizer)
    prompts = [r["prompt"] for r in rows]
    completions = greedy_completions(engine, prompts, max_new_tokens, batch_size)
    columns = reward_columns(rows)
    # through the training path's checks: a reward that raises, returns the wrong count or
    # type is an error naming the function and sample; a non-finite value stays NaN (skip)
    name = getattr(reward_fn, "__name__", "reward")
    total, _, valid = score([RewardTerm(name, reward_fn)], prompts, completions, columns,
                            "skip_nonfinite")
    rewards = [float(x) if ok else float("nan") for x, ok in zip(total, valid, strict=True)]
    n = len(rewards)
    return {"accuracy": sum(r >= threshold for r in rewards) / n,
            "mean_reward": sum(rewards) / n, "n": n}
