"""What the lean engine computed while sampling that the update may reuse, as one opaque,
version-checked object: :class:`SamplerCache`.

It holds, for the samples of a rollout, the outputs of the policy's projections
(:class:`posttrain.fast.replay.DecodeActivations`, for the update's forward to replay) and
the log-sum-exp and entropy of each distribution a token was drawn from (for the fused
head's forward to skip its matmul). Both are valid only for the weights that computed them:
the cache carries the sampling policy's *version* (:func:`policy_version`, moved by every
optimiser step that :func:`track_policy_version` watches) and :meth:`SamplerCache.take`
refuses it (:class:`StaleCache`) once the policy has moved. The check sits where the cache
is used, not in the loop's order.

The rollout carries it as ``Rollout.cache``, the trainer's token batch hands it to the
passes; nothing else looks inside. A pass may ignore it: the result is the same to float
rounding, only slower.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


class StaleCache(RuntimeError):
    """A sampler cache offered to a policy that has changed since sampling."""


def policy_version(model: torch.nn.Module) -> int:
    """How many watched optimiser steps have changed ``model`` (0 if none is watched)."""
    return getattr(model, "_posttrain_policy_version", 0)


def track_policy_version(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Move ``model``'s policy version after every step of ``optimizer``."""
    def bump(*_):
        model._posttrain_policy_version = policy_version(model) + 1
    optimizer.register_step_post_hook(bump)


@dataclass
class Reuse:
    """What a pass over some samples takes from the cache: a context in which the policy's
    projections return their saved outputs (None: compute them), and each completion
    token's log-sum-exp and entropy ``(2, n, Tc)`` (None: compute them)."""

    replay: contextlib.AbstractContextManager | None = None
    head: torch.Tensor | None = None


@dataclass
class SamplerCache:
    """The reusable part of one rollout's sampling (see the module docstring), rows aligned
    with the rollout's samples. ``activations``: the projections' outputs, or None;
    ``head``: ``(2, N, Tc)`` log-sum-exp and entropy of the tempered logits (zero past a
    sample's end), or None; ``version``: the sampling policy's version."""

    activations: object | None = None
    head: torch.Tensor | None = None
    version: int = 0

    def __bool__(self) -> bool:
        return self.activations is not None or self.head is not None

    def rows(self, rows: torch.Tensor) -> SamplerCache:
        return SamplerCache(None if self.activations is None else self.activations.rows(rows),
                            None if self.head is None else self.head[:, rows], self.version)

    @classmethod
    def concat(cls, parts: list[SamplerCache | None], T: int) -> SamplerCache | None:
        """Several rounds' caches as one, padded to ``T`` columns; None unless every round
        has one and all were sampled by the same policy version."""
        if not parts or any(p is None for p in parts) or len({p.version for p in parts}) > 1:
            return None
        acts = [p.activations for p in parts]
        heads = [p.head for p in parts]
        activations = (None if any(a is None for a in acts)
                       else type(acts[0]).concat(acts, T))
        head = (None if any(h is None for h in heads) else torch.cat(
            [torch.nn.functional.pad(h, (0, T - h.shape[-1])) for h in heads], 1))
        return cls(activations, head, parts[0].version)

    def to(self, device) -> SamplerCache:
        """The head statistics on ``device`` (the activations are already where the
        sampler ran)."""
        return SamplerCache(self.activations, None if self.head is None else
                            self.head.to(device), self.version)

    def without_projections(self) -> SamplerCache:
        return SamplerCache(None, self.head, self.version)

    def take(self, model, rows: torch.Tensor, columns: int, replay: bool = True) -> Reuse:
        """What a pass of ``model`` over the samples ``rows`` and the first ``columns``
        completion positions may reuse; ``replay`` False: not the projections (the pass
        takes a path that does not replay). Raises :class:`StaleCache` if ``model`` is not
        the policy version that sampled."""
        now = policy_version(model)
        if now != self.version:
            raise StaleCache(f"sampler cache of policy version {self.version} offered to "
                             f"version {now}: the policy changed since sampling, so what it "
                             "holds must be recomputed")
        ctx = None
        if replay and self.activations is not None:
            ctx = self.activations.rows(rows).replay(model, columns)
        return Reuse(ctx, None if self.head is None else self.head[:, rows])
