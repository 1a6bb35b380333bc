"""Scoring a batch: every reward term called on the samples, checked, and weighted.

A term that raises, returns the wrong number of values, or returns NaN, inf or a non-number
is handled per ``on_error``:

- ``raise``: stop with an error naming the term and the sample;
- ``skip``: the sample is left out of the loss and counted (``reward/skipped``);
- ``zero``: the sample scores 0 on that term and is counted (``reward/<term>_failed``, the
  share of samples that failed);
- ``skip_nonfinite`` (evaluation): only a non-finite value is left out; errors raise.

A term runs where it cannot stall the run (docs/rewards.md): with ``workers`` > 1 its batch
is cut into that many parts called at once on daemon threads, and with a ``timeout`` the
call is abandoned past it (Python cannot stop a thread: the call finishes, or not, in the
background, and never keeps the process alive). A call past its timeout is a failure of
each of its samples, handled as above.
"""

from __future__ import annotations

import concurrent.futures
import math

import torch

from posttrain.calls import Workers
from posttrain.rewards.terms import RewardTerm


def reward_columns(rows: list[dict]) -> dict[str, list]:
    """The columns a reward function gets by name: every field of the rows but the prompt
    (and the loader's row number)."""
    return {k: [r.get(k) for r in rows] for k in rows[0] if k not in ("prompt", "_row")}


class RewardError(ValueError):
    """A reward function failed on a sample."""


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _excerpt(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _values(term: RewardTerm, prompts, completions, columns, on_error: str, offset: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of ``term`` on samples ``offset``…: ``(values (n,) float64, failed (n,)
    bool)``; a failed sample's value is NaN (skip) or 0 (zero)."""
    n = len(prompts)
    lenient = on_error in ("skip", "zero")
    failed = [False] * n
    try:
        values = term.fn(prompts, completions, **columns)
    except Exception as batch_error:  # find the sample that breaks it
        values = []
        for i in range(n):
            try:
                values.extend(term.fn(prompts[i:i + 1], completions[i:i + 1],
                                      **{k: v[i:i + 1] for k, v in columns.items()}))
            except Exception as e:
                if not lenient:
                    raise RewardError(f"reward {term.name!r} raised {type(e).__name__}: {e} "
                                      f"on sample {offset + i} (prompt {_excerpt(prompts[i])}"
                                      f", completion {_excerpt(completions[i])})") from e
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
            if not lenient:
                raise RewardError(f"reward {term.name!r} returned {v!r} for sample {offset + i}"
                                  f", not a number (prompt {_excerpt(prompts[i])})") from None
            x = float("nan")
        if not math.isfinite(x) or abs(x) > FLOAT32_MAX:  # training reads it in float32
            if on_error == "raise":
                raise RewardError(f"reward {term.name!r} returned {v!r} for sample {offset + i}"
                                  f", which is not a finite float32 number (prompt "
                                  f"{_excerpt(prompts[i])}, completion "
                                  f"{_excerpt(completions[i])})")
            x = float("nan")
        failed[i] = not math.isfinite(x)
        out.append(0.0 if failed[i] and on_error == "zero" else x)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(failed, dtype=torch.bool)


def _call(term: RewardTerm, prompts, completions, columns, on_error: str
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``term`` on the whole batch: on the caller's thread, or cut into ``term.workers``
    parts on daemon threads under ``term.timeout``."""
    n = len(prompts)
    if (term.workers <= 1 and not term.timeout) or n == 0:
        return _values(term, prompts, completions, columns, on_error, 0)
    k = max(1, min(term.workers, n))
    cuts = [(n * i // k, n * (i + 1) // k) for i in range(k)]
    pool = term.calls.get("pool")
    if pool is None:
        pool = term.calls["pool"] = Workers(max(1, term.workers), f"posttrain-reward-{term.name}")
    futures = [pool.submit(_values, term, prompts[a:b], completions[a:b],
                           {c: v[a:b] for c, v in columns.items()}, on_error, a)
               for a, b in cuts]
    _, late = concurrent.futures.wait(futures, timeout=term.timeout or None)
    if late:
        pool.abandon()  # (its calls run on, or not, as daemons; the next batch gets a new pool)
        term.calls.pop("pool", None)
        if on_error not in ("skip", "zero"):
            a, b = cuts[futures.index(next(f for f in futures if f in late))]
            raise RewardError(f"reward {term.name!r} did not return within {term.timeout:g} s "
                              f"(reward_timeout) on samples {a}-{b - 1} (prompt "
                              f"{_excerpt(prompts[a])}); on_reward_error skip or zero scores "
                              "such samples as failed and goes on")
    values, failed = [], []
    for f, (a, b) in zip(futures, cuts, strict=True):
        if f in late:
            values.append(torch.full((b - a,), 0.0 if on_error == "zero" else float("nan"),
                                     dtype=torch.float64))
            failed.append(torch.ones(b - a, dtype=torch.bool))
        else:
            v, x = f.result()
            values.append(v)
            failed.append(x)
    return torch.cat(values), torch.cat(failed)


def score(terms: list[RewardTerm], prompts: list[str], completions: list[str],
          columns: dict[str, list], on_error: str = "raise"
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """``(total (N,), {name: values (N,)}, valid (N,) bool)``; skipped samples have total 0
    and ``valid`` False. With ``on_error="zero"`` each term also reports
    ``{name}_failed``, 1 where the sample failed on it."""
    called = {t.name: _call(t, prompts, completions, columns, on_error) for t in terms}
    per = {name: v for name, (v, _) in called.items()}
    total = sum(t.weight * per[t.name] for t in terms)
    valid = torch.isfinite(total) & (total.abs() <= FLOAT32_MAX)
    overflow = valid.logical_not() & torch.stack([v.isfinite() for v in per.values()]).all(0)
    if overflow.any() and on_error == "raise":
        i = int(overflow.nonzero()[0])
        raise RewardError(f"the weighted reward of sample {i} is {float(total[i])}, not a finite "
                          f"float32 number (prompt {_excerpt(prompts[i])})")
    total = torch.where(valid, total, torch.zeros_like(total)).float()
    out = {k: v.float() for k, v in per.items()}
    if on_error == "zero":
        out.update({f"{name}_failed": x.float() for name, (_, x) in called.items()})
    return total, out, valid
