"""Reward terms: what ``--reward`` names, loaded into callables with a weight each.

A term is ``f(prompts, completions, **columns) -> list[float]``. ``--reward`` lists terms,
comma-separated:

- ``builtin``: the built-in task's exact-answer reward;
- ``math``, ``code``, ``format``, ``length``: the verifiable terms of
  :mod:`posttrain.rewards.verifiable` and :mod:`posttrain.rewards.code` (docs/rewards.md);
- ``rm:DIR``: a reward model trained with ``posttrain rm`` (or any sequence-classification
  checkpoint);
- ``module:function`` or ``path/to/file.py:function``: a user's function.

Weights are ``--reward_weights 1.0,0.5``; each term is logged on its own and the total is
their weighted sum. How a term is called (workers, timeout, failures) is
:mod:`posttrain.rewards.scoring`'s business; the term only records its share of it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RewardOptions:
    """Settings of the built-in terms and of how every term is called (the run's keys of the
    same names, docs/rewards.md)."""

    workers: int = 1
    """Calls of one term on one batch run on this many threads, each on its share of the
    samples."""
    timeout: float = 0.0
    """Seconds a term may take on a batch; past it the call is abandoned (0 = no limit)."""
    format_pattern: str | None = None
    """``format``: the regular expression a whole completion must match; none = a
    ``<think>…</think>`` block then an answer."""
    length_target: int = 1024
    """``length``: characters a completion may have without penalty."""
    length_span: int = 1024
    """``length``: characters past the target at which the penalty reaches −1."""
    code_mode: str = "all"
    """``code``: all = 1 when every test passes, else 0; share = the share of tests passed."""
    sandbox: str = "auto"
    """``code``: the isolation level (auto, bwrap, namespaces, rlimits)."""
    code_timeout: float = 10.0
    """``code``: wall-clock seconds one program may run in the sandbox."""


@dataclass
class RewardTerm:
    name: str
    fn: Callable
    weight: float = 1.0
    workers: int = 1
    timeout: float = 0.0
    calls: dict = field(default_factory=dict)
    """(scoring's state: the term's worker pool)"""


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


def _builtin_terms(options: RewardOptions) -> dict[str, Callable[[], Callable]]:
    """The terms named by a word, each made on demand (``code`` opens a sandbox, ``math``
    needs the ``math`` extra)."""
    from posttrain.builtin import task
    from posttrain.rewards import code, verifiable

    return {
        "builtin": lambda: task.reward,
        "math": lambda: verifiable.math_reward,
        "format": lambda: functools.partial(verifiable.format_reward,
                                            pattern=options.format_pattern),
        "length": lambda: functools.partial(verifiable.length_penalty,
                                            target=options.length_target,
                                            span=options.length_span),
        "code": lambda: code.CodeReward(options.sandbox, options.code_mode,
                                        options.code_timeout),
    }


BUILTIN_NAMES = ("builtin", "math", "code", "format", "length")


def load_reward(spec: str, device: str = "auto",
                options: RewardOptions = RewardOptions()) -> RewardTerm:
    spec = spec.strip()
    if spec in BUILTIN_NAMES:
        term = RewardTerm(spec, _builtin_terms(options)[spec]())
    elif spec.startswith("rm:"):
        term = RewardTerm(spec, RewardModelReward(spec[3:], device))
    else:
        term = RewardTerm(spec.rsplit(":", 1)[-1], load_reward_function(spec))
    # (a reward model scores its batch in one forward: more threads would only contend)
    term.workers = 1 if spec.startswith("rm:") else options.workers
    term.timeout = options.timeout
    return term


def parse_rewards(spec: str, weights: str | None = None, device: str = "auto",
                  options: RewardOptions = RewardOptions()) -> list[RewardTerm]:
    """``"builtin,file.py:fmt"`` and ``"1.0,0.2"`` → reward terms."""
    terms = [load_reward(s, device, options) for s in spec.split(",") if s.strip()]
    names = [t.name for t in terms]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"reward {spec!r}: term {dupes[0]!r} is named twice (each term is "
                         "logged under its name)")
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
