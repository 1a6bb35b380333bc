"""Rewards for the online trainers: Python functions, a trained reward model, or several of
them with weights.

A reward function is ``f(prompts, completions, **columns) -> list[float]``: ``columns`` are
the data set's other columns, one value per sample. Name it as ``module:function`` or
``path/to/file.py:function``; ``builtin`` is the built-in task's exact-answer reward and
``rm:DIR`` a reward model trained with ``posttrain rm`` (or any sequence-classification
checkpoint). Several terms are written ``a,b`` with weights ``1.0,0.5``; each term is logged
on its own and the total is their weighted sum.

A function that raises, returns the wrong number of values, or returns NaN, inf or a
non-number stops training with an error naming the function and the sample — or, with
``on_error="skip"``, the sample is left out of the loss and counted (``"skip_nonfinite"``:
only a non-finite value is left out, as NaN; evaluation reports it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


def reward_columns(rows: list[dict]) -> dict[str, list]:
    """The columns a reward function gets by name: every field of the rows but the prompt
    (and the loader's row number)."""
    return {k: [r.get(k) for r in rows] for k in rows[0] if k not in ("prompt", "_row")}


class RewardError(ValueError):
    """A reward function failed on a sample."""


@dataclass
class RewardTerm:
    name: str
    fn: Callable
    weight: float = 1.0


class RewardModelReward:
    """Scores ``prompt + completion`` with a scalar-head model (``posttrain rm`` output)."""

    def __init__(self, path: str, device: str = "auto", batch_size: int = 64):
        from posttrain.models import load_reward_model, load_tokenizer

        self.tokenizer = load_tokenizer(path)
        self.model = load_reward_model(path, self.tokenizer, device=device).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, prompts, completions, **_):
        from posttrain.models import sequence_scores

        device = next(self.model.parameters()).device
        out: list[float] = []
        side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "right"
        try:
            for i in range(0, len(prompts), self.batch_size):
                texts = [p + c + (self.tokenizer.eos_token or "") for p, c in
                         zip(prompts[i:i + self.batch_size], completions[i:i + self.batch_size],
                             strict=True)]
                enc = self.tokenizer(texts, return_tensors="pt", padding=True).to(device)
                out.extend(sequence_scores(self.model, enc["input_ids"],
                                           enc["attention_mask"]).tolist())
        finally:
            self.tokenizer.padding_side = side
        return out


def load_reward_function(spec: str) -> Callable:
    """``module:function`` or ``path/to/file.py:function`` → the callable."""
    from posttrain.userfiles import load_object

    fn = load_object(spec, "reward", "function")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {spec.rsplit(':', 1)[0]} has no function "
                         f"{spec.rsplit(':', 1)[1]!r}")
    return fn


def load_reward(spec: str, device: str = "auto") -> RewardTerm:
    from posttrain.builtin import task

    spec = spec.strip()
    if spec == "builtin":
        return RewardTerm("builtin", task.reward)
    if spec.startswith("rm:"):
        return RewardTerm(spec, RewardModelReward(spec[3:], device))
    return RewardTerm(spec.rsplit(":", 1)[-1], load_reward_function(spec))


def parse_rewards(spec: str, weights: str | None = None, device: str = "auto"
                  ) -> list[RewardTerm]:
    """``"builtin,file.py:fmt"`` and ``"1.0,0.2"`` → reward terms."""
    terms = [load_reward(s, device) for s in spec.split(",") if s.strip()]
    if weights:
        try:
            ws = [float(w) for w in weights.split(",")]
        except ValueError:
            raise ValueError(f"reward_weights {weights!r}: expected numbers separated by "
                             "commas") from None
        if not all(math.isfinite(w) for w in ws):
            raise ValueError(f"reward_weights {weights!r}: every weight must be finite")
        if len(ws) != len(terms):
            raise ValueError(f"{len(terms)} rewards but {len(ws)} weights")
        for t, w in zip(terms, ws, strict=True):
            t.weight = w
    return terms


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _excerpt(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _call(term: RewardTerm, prompts, completions, columns, on_error: str):
    """Values of one term, ``(N,)`` float64 with NaN where a sample was skipped."""
    n = len(prompts)
    try:
        values = term.fn(prompts, completions, **columns)
    except Exception as batch_error:  # find the sample that breaks it
        values = []
        for i in range(n):
            try:
                values.extend(term.fn(prompts[i:i + 1], completions[i:i + 1],
                                      **{k: v[i:i + 1] for k, v in columns.items()}))
            except Exception as e:
                if on_error != "skip":
                    raise RewardError(f"reward {term.name!r} raised {type(e).__name__}: {e} "
                                      f"on sample {i} (prompt {_excerpt(prompts[i])}, "
                                      f"completion {_excerpt(completions[i])})") from e
                values.append(float("nan"))
        if len(values) != n:
            raise RewardError(f"reward {term.name!r} raised {batch_error!r} on the batch"
                              ) from batch_error
    if not hasattr(values, "__len__") or len(values) != n:
        got = len(values) if hasattr(values, "__len__") else type(values).__name__
        raise RewardError(f"reward {term.name!r} returned {got} values for {n} samples")
    out = []
    for i, v in enumerate(values):
        try:
            x = float(v)
        except (TypeError, ValueError):
            if on_error != "skip":
                raise RewardError(f"reward {term.name!r} returned {v!r} for sample {i}, not a "
                                  f"number (prompt {_excerpt(prompts[i])})") from None
            x = float("nan")
        if not math.isfinite(x) or abs(x) > FLOAT32_MAX:  # training reads it in float32
            if on_error == "raise":
                raise RewardError(f"reward {term.name!r} returned {v!r} for sample {i}, which "
                                  f"is not a finite float32 number (prompt {_excerpt(prompts[i])},"
                                  f" completion {_excerpt(completions[i])})")
            x = float("nan")
        out.append(x)
    return torch.tensor(out, dtype=torch.float64)


def score(terms: list[RewardTerm], prompts: list[str], completions: list[str],
          columns: dict[str, list], on_error: str = "raise"
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """``(total (N,), {name: values (N,)}, valid (N,) bool)``; skipped samples have total 0
    and ``valid`` False."""
    per = {t.name: _call(t, prompts, completions, columns, on_error) for t in terms}
    total = sum(t.weight * per[t.name] for t in terms)
    valid = torch.isfinite(total) & (total.abs() <= FLOAT32_MAX)
    overflow = valid.logical_not() & torch.stack([v.isfinite() for v in per.values()]).all(0)
    if overflow.any() and on_error == "raise":
        i = int(overflow.nonzero()[0])
        raise RewardError(f"the weighted reward of sample {i} is {float(total[i])}, not a finite "
                          f"float32 number (prompt {_excerpt(prompts[i])})")
    total = torch.where(valid, total, torch.zeros_like(total)).float()
    return total, {k: v.float() for k, v in per.items()}, valid
