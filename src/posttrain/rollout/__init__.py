"""Rollout engines: objects with a lifecycle that the trainer holds for the whole run
(``generate`` / ``sync`` / ``score`` / ``sleep`` / ``wake`` / ``close``, see :mod:`.engine`).
``hf`` decodes with the model's own forward (:mod:`.hf`), ``lean`` with ``posttrain.fast``'s
Llama-family decoder (:mod:`.lean`), ``vllm`` through a vLLM engine in this process
(:mod:`.vllm`, an optional extra). A new backend is one module with a
:class:`RolloutEngine` subclass and one entry in :func:`make_engine`."""

from __future__ import annotations

import torch

from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.types import Request, Rollout, SamplingParams, concat, requests_for, select

BACKENDS = ("auto", "hf", "lean", "vllm", "vllm_server")


def make_engine(backend: str, model, tokenizer, fast: bool = True,
                shares_weights: bool = True, options=None) -> RolloutEngine:
    """The engine ``backend`` names for ``model``: ``auto`` is ``lean`` where the lean
    decoder runs the model and ``fast`` is on, else ``hf``. ``shares_weights``: ``model``
    is the trainer's own policy (else a copy the engine owns, which a sync overwrites).
    ``options``: the vLLM engine's :class:`~posttrain.rollout.vllm.VLLMOptions`."""
    from posttrain.rollout.hf import HFEngine

    if backend not in BACKENDS:
        raise ValueError(f"unknown rollout backend {backend!r}; choose from {BACKENDS}")
    if backend == "vllm_server":
        from posttrain.rollout.vllm_server import ServerOptions, VLLMServerEngine

        if not isinstance(options, ServerOptions):
            raise ValueError("rollout backend vllm_server needs ServerOptions (the URLs)")
        return VLLMServerEngine(model, tokenizer, options)
    if backend == "vllm":
        from posttrain.rollout.vllm import VLLMEngine, VLLMOptions

        return VLLMEngine(model, tokenizer, options or VLLMOptions())
    if backend == "auto":
        if fast:
            from posttrain.rollout.lean import LeanEngine

            if LeanEngine.supports(model):
                return LeanEngine(model, tokenizer, shares_weights)
        return HFEngine(model, tokenizer, shares_weights)
    if backend == "lean":
        from posttrain.rollout.lean import LeanEngine

        return LeanEngine(model, tokenizer, shares_weights)
    return HFEngine(model, tokenizer, shares_weights)


def generate(model, tokenizer, prompts: list[str], n: int = 1,
             params: SamplingParams | None = None, generator: torch.Generator | None = None,
             engine: str = "auto", extras: frozenset[str] = frozenset()) -> Rollout:
    """One-off sampling of text prompts (tokenised as plain text, no seeds: ``generator``
    draws) through ``make_engine(engine, model, tokenizer)``."""
    return make_engine(engine, model, tokenizer).generate(
        requests_for(tokenizer, prompts), n, params, generator, extras=extras)


__all__ = ["BACKENDS", "Request", "Rollout", "RolloutEngine", "SamplingParams", "concat",
           "generate", "make_engine", "requests_for", "select"]
