"""Rollout engines: objects with a lifecycle that the trainer holds for the whole run
(``generate`` / ``update_weights`` / ``close``, see :mod:`.engine`). ``hf`` decodes with the
model's own forward (:mod:`.hf`), ``lean`` with ``posttrain.fast``'s Llama-family decoder
(:mod:`.lean`). A new backend (vLLM, say) is one module with a :class:`RolloutEngine`
subclass and one entry in :func:`make_engine`."""

from __future__ import annotations

import torch

from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.types import Rollout, SamplingParams, concat, select

BACKENDS = ("auto", "hf", "lean")


def make_engine(backend: str, model, tokenizer, fast: bool = True) -> RolloutEngine:
    """The engine ``backend`` names for ``model``: ``auto`` is ``lean`` where the lean
    decoder runs the model and ``fast`` is on, else ``hf``."""
    from posttrain.rollout.hf import HFEngine

    if backend not in BACKENDS:
        raise ValueError(f"unknown rollout backend {backend!r}; choose from {BACKENDS}")
    if backend == "auto":
        if fast:
            from posttrain.rollout.lean import LeanEngine

            if LeanEngine.supports(model):
                return LeanEngine(model, tokenizer)
        return HFEngine(model, tokenizer)
    if backend == "lean":
        from posttrain.rollout.lean import LeanEngine

        return LeanEngine(model, tokenizer)
    return HFEngine(model, tokenizer)


def generate(model, tokenizer, prompts: list[str], n: int = 1,
             params: SamplingParams | None = None, generator: torch.Generator | None = None,
             engine: str = "auto", extras: frozenset[str] = frozenset()) -> Rollout:
    """One-off sampling: ``make_engine(engine, model, tokenizer).generate(...)``."""
    return make_engine(engine, model, tokenizer).generate(prompts, n, params, generator,
                                                          extras=extras)


__all__ = ["BACKENDS", "Rollout", "RolloutEngine", "SamplingParams", "concat", "generate",
           "make_engine", "select"]
