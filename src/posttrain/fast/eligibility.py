"""Which of the lean engine's reusable outputs a run keeps: decided once, here, from the
run's settings, the policy and the engine (:func:`plan`). The trainer asks for what the
plan says; the passes use what the cache holds (:mod:`.cache`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Plan:
    """What the engine is asked to keep while sampling: the projections' outputs (for the
    update's forward to replay) and the head's statistics (for the fused head)."""

    projections: bool = False
    head: bool = False

    def extras(self, packed: bool = False) -> frozenset[str]:
        """The engine's ``extras`` for the next rollouts: a batch that packed its passes
        into one call replays nothing, so after one the projections are not kept."""
        return frozenset(k for k, on in (("projections", self.projections and not packed),
                                         ("head_stats", self.head)) if on)


def has_dropout(model) -> bool:
    """Whether ``model``'s training forward drops anything (attention dropout, a dropout
    module, LoRA's among them), so it does not compute what its sampling computed."""
    return bool(getattr(model.config, "attention_dropout", 0.0) or any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()))


def can_replay(model) -> bool:
    """Whether the update's forward may take ``model``'s projections from its lean sampler:
    a model the lean decoder runs (plain ``nn.Linear`` projections, a bias-free SwiGLU MLP
    that :func:`posttrain.fast.replay.replay_forward` knows), whose training forward
    computes what sampling computed (no dropout, no gradient checkpointing)."""
    from posttrain.fast.lean import LeanLlamaDecoder

    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True
                        for m in model.modules())
    return (LeanLlamaDecoder.supports_dense(model) and not checkpointing
            and not has_dropout(model))


def plan(cfg, policy, engine, *, share_prompt: bool, compiled: bool, sharded: bool) -> Plan:
    """The one decision. Both outputs need ``fast``, the shared-prompt layout (their rows
    follow the sampler's, one prompt per group) and an engine that samples with the policy
    itself (a sharded run, or a rollout_dtype of its own, samples from a copy). The
    projections also need an engine that captures them, a policy it can replay and no
    compile (compiled blocks would not run the replayed functions); the head's statistics
    a training forward without dropout and a micro-batch of full-length completions that
    reaches the fused head (below it the head is unfused and the statistics would cost
    time for nothing)."""
    from posttrain.models.logprobs import fusable_head

    common = bool(cfg.fast and share_prompt and engine.shares_weights and not sharded)
    projections = (common and cfg.replay_projections and "projections" in engine.extras
                   and not compiled and can_replay(policy))
    rows = min(cfg.micro_batch_size, cfg.prompts_per_step * cfg.group_size)
    head = (common and cfg.reuse_sampler_head and "head_stats" in engine.extras
            and not has_dropout(policy)
            and fusable_head(policy, rows * cfg.max_new_tokens) is not None)
    return Plan(projections, head)
