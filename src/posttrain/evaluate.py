"""Greedy evaluation: accuracy and mean reward of a policy's completions.

``accuracy`` is the share of completions whose reward reaches ``threshold`` (1.0: a
verifiable 0/1 reward counts exact answers); ``mean_reward`` is the plain mean.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path


def load_reward_function(spec: str) -> Callable:
    """``module:function`` or ``path/to/file.py:function`` → the callable."""
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: expected module:function or file.py:function")
    target, func = spec.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target)
        if not path.exists():
            raise FileNotFoundError(f"reward {spec!r}: no file {target}")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {target} has no function {func!r}")
    return fn


def greedy_completions(engine, prompts: list[str], max_new_tokens: int = 16,
                       batch_size: int = 64) -> list[str]:
    """Greedy completions (text up to eos) of ``prompts`` from a rollout ``engine``
    (``posttrain.rollout``; tested token-for-token equal to
    ``model.generate(do_sample=False)``)."""
    from posttrain.rollout import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    out: list[str] = []
    for i in range(0, len(prompts), batch_size):
        out.extend(engine.generate(prompts[i:i + batch_size], 1, params).texts)
    return out


def evaluate_policy(model, tokenizer, rows: list[dict], reward_fn: Callable,
                    max_new_tokens: int = 16, batch_size: int = 64, threshold: float = 1.0,
                    engine=None) -> dict[str, float]:
    """Greedy-decode every row's prompt (through ``engine``, default the ``auto`` engine of
    ``model``), score with ``reward_fn(prompts, completions, **columns)``; return accuracy,
    mean reward and the count."""
    from posttrain.rewards import reward_columns
    from posttrain.rollout import make_engine

    engine = engine or make_engine("auto", model, tokenizer)
    prompts = [r["prompt"] for r in rows]
    completions = greedy_completions(engine, prompts, max_new_tokens, batch_size)
    columns = reward_columns(rows)
    from posttrain.rewards import RewardTerm, score

    # through the training path's checks: a reward that raises, returns the wrong count or
    # type is an error naming the function and sample; a non-finite value stays NaN (skip)
    name = getattr(reward_fn, "__name__", "reward")
    total, _, valid = score([RewardTerm(name, reward_fn)], prompts, completions, columns,
                            "skip_nonfinite")
    rewards = [float(x) if ok else float("nan") for x, ok in zip(total, valid, strict=True)]
    n = len(rewards)
    return {"accuracy": sum(r >= threshold for r in rewards) / n,
            "mean_reward": sum(rewards) / n, "n": n}
