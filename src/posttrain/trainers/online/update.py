"""The update of one RL step: ``ppo_epochs`` passes of minibatch optimiser steps over the
step's samples (the experience buffer), each accumulated over micro-batches against the
normaliser of the whole minibatch, so the gradient does not depend on ``micro_batch_size``.
The critic, when there is one, takes its clipped value-loss step on the same minibatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain import data as data_mod
from posttrain import dist, sharding
from posttrain.core import aggregate_loss, masked_mean, step_normalizer, value_loss
from posttrain.core.algorithms import Algorithm, PolicyInputs, policy_objective
from posttrain.core.correction import Correction
from posttrain.trainers.loop.optim import Optim
from posttrain.trainers.online.batch import TokenBatch


@dataclass
class UpdateInputs:
    """What the update reads, all ``(N, Lc)`` but ``rows`` ``(N,)``: the rows that go
    through the forward and backward (without a critic, rows whose advantage is zero where
    that means zero gradient are left out)."""

    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    old_values: torch.Tensor | None
    returns: torch.Tensor | None
    rows: torch.Tensor
    local_of: torch.Tensor
    """(N,) each row's index in this rank's :class:`TokenBatch`, -1 for another rank's
    rows (each rank runs the forward and backward of its own samples only)."""
    recorded: tuple[torch.Tensor, torch.Tensor] | None = None
    """Without old log-probs: ``(N, Lc)`` and ``(N,)`` buffers the first pass fills with the
    policy's log-probs at the sampling weights and the rows it computed (the sampler-parity
    metric reads them)."""
    behaviour: torch.Tensor | None = None
    """``(N, Lc)`` the engine's log-probs of the sampled tokens (the behaviour policy)."""
    correction: Correction | None = None
    """Mismatch correction by π_old / π_behaviour (None: off, and no metrics)."""
    aux_coef: float = 0.0
    """The weight of a mixture-of-experts policy's auxiliary load-balancing loss (0: off)."""


def _own_live_rows(idx: torch.Tensor, live: torch.Tensor, local_of: torch.Tensor
                   ) -> torch.Tensor:
    rows = idx[live[idx]]
    return rows[local_of[rows] >= 0]


def micro_batches(rows: torch.Tensor, size: int, model, tokens: TokenBatch | None,
                  local_of: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``rows`` cut into micro-batches: ``size`` rows each, or where ``tokens`` runs
    token-budget forwards (:attr:`TokenBatch.forward_tokens`), runs of rows of at most its
    budget in all (``local_of`` maps ``rows`` to the batch's rows). For a sharded model as
    many as the rank with the most: the extra ones, last, are empty (see
    :func:`_keep_step`)."""
    if tokens is not None and tokens.forward_tokens is not None and len(rows):
        local = rows if local_of is None else local_of[rows]
        parts = [rows[torch.tensor(r, device=rows.device)] for r in data_mod.packed_rows(
            tokens.lengths(local).tolist(), tokens.forward_tokens)]
    else:
        parts = [rows[i:i + size] for i in range(0, len(rows), size)]
    return parts + [rows[:0]] * (sharding.lockstep(len(parts), model) - len(parts))


def _keep_step(forward) -> None:
    """A sharded model's forward and backward with zero weight, on one row (the batch holds
    every sample when sharded): this rank takes part in the collectives of a micro-batch
    another rank has and it has not, and adds nothing to the gradient."""
    (forward().float().nan_to_num(0.0, 0.0, 0.0) * 0).sum().backward()


def accumulate_policy_gradient(policy, algo: Algorithm, tokens: TokenBatch, mask: torch.Tensor,
                               idx: torch.Tensor, adv: torch.Tensor, old: torch.Tensor | None,
                               ref: torch.Tensor | None, live: torch.Tensor,
                               local_of: torch.Tensor, micro_batch_size: int,
                               max_new_tokens: int, recorded: tuple | None = None,
                               behaviour: torch.Tensor | None = None,
                               correction: Correction | None = None,
                               aux_coef: float = 0.0) -> dict[str, float]:
    """Backward this rank's share of the loss of the minibatch ``idx`` in micro-batches,
    each aggregated with the normaliser of the whole minibatch (so the summed gradient
    depends neither on ``micro_batch_size`` nor on the number of ranks). ``mask``, ``adv``,
    ``old``, ``ref`` are ``(N, Lc)``. Rows not ``live`` are skipped. Returns the loss and
    this rank's share of the token-weighted metric means (both add up over ranks)."""
    norm = step_normalizer(mask[idx], algo.aggregation)
    n_tokens = max(float(mask[idx].sum()), 1.0)
    rows = _own_live_rows(idx, live, local_of)
    sums: dict[str, float] = {"loss": 0.0}
    parts = micro_batches(rows, micro_batch_size, policy, tokens, local_of)
    n_real = sum(1 for mb in parts if len(mb))
    for j, mb in enumerate(parts):
        if not len(mb):
            _keep_step(lambda: tokens.logprobs(policy, idx[:1]))
            continue
        # the last micro-batch is the sampler cache's last use: the optimizer step that
        # follows changes the policy
        lp, ent = tokens.logprobs(policy, local_of[mb], with_entropy=True, reuse=True,
                                  last_use=j + 1 == n_real)
        old_mb = lp.detach() if old is None else old[mb]
        if recorded is not None:
            recorded[0][mb], recorded[1][mb] = old_mb.to(recorded[0].dtype), True
        loss_tok, m = policy_objective(algo, PolicyInputs(
            lp, old_mb, adv[mb], mask[mb], None if ref is None else ref[mb],
            None if behaviour is None else behaviour[mb]), correction)
        loss = aggregate_loss(loss_tok, mask[mb], algo.aggregation, norm,
                              constant=algo.loss_constant(max_new_tokens))
        weight = float(mask[mb].sum()) / n_tokens  # the micro-batch's share of the tokens
        aux = tokens.router_aux_loss() if aux_coef else None
        if aux is not None:  # MoE: the load-balancing term, token-weighted over micro-batches
            loss = loss + aux_coef * weight * aux
            m["router_aux_loss"] = aux.detach()
        loss.backward()
        sums["loss"] += float(loss.detach())
        m["entropy"] = masked_mean(ent, mask[mb])
        sums = combine([sums, {k: float(v) if k.endswith(EXTREMES) else float(v) * weight
                               for k, v in m.items()}])
    return sums


EXTREMES = ("_min", "_max")
"""Metrics whose parts combine by their least or greatest value, not by adding up."""


def combine(parts: list[dict[str, float]]) -> dict[str, float]:
    """Metric parts (micro-batches, ranks) as one: ``*_min`` / ``*_max`` by min / max, the
    rest (losses and token-weighted shares of means) by sum. A part may lack keys."""
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            if k not in out:
                out[k] = v
            elif k.endswith("_min"):
                out[k] = min(out[k], v)
            elif k.endswith("_max"):
                out[k] = max(out[k], v)
            else:
                out[k] += v
    return out

def accumulate_value_gradient(critic, algo: Algorithm, tokens: TokenBatch, mask: torch.Tensor,
                              idx: torch.Tensor, old_values: torch.Tensor,
                              returns: torch.Tensor, live: torch.Tensor,
                              local_of: torch.Tensor, micro_batch_size: int
                              ) -> dict[str, float]:
    """Backward ``c_v ·`` the clipped value loss of the minibatch ``idx`` in micro-batches, a
    token mean normalised over the whole minibatch (so the gradient does not depend on
    ``micro_batch_size``). Returns the loss sum and metric means over micro-batches."""
    norm = step_normalizer(mask[idx], "token_mean")
    rows = _own_live_rows(idx, live, local_of)
    sums: dict[str, float] = {"value_loss": 0.0, "value_clip_frac": 0.0}
    for mb in micro_batches(rows, micro_batch_size, critic, tokens, local_of):
        if not len(mb):
            _keep_step(lambda: tokens.values(critic, idx[:1]))
            continue
        v = tokens.values(critic, local_of[mb])
        loss_tok, m = value_loss(v, old_values[mb], returns[mb], mask[mb], algo.value_clip)
        loss = aggregate_loss(loss_tok, mask[mb], "token_mean", norm)
        (algo.value_coef * loss).backward()
        sums["value_loss"] += float(loss.detach())
        # token-weighted, so the metric does not depend on the micro-batch split either
        sums["value_clip_frac"] += float(m["value_clip_frac"] * mask[mb].sum() / norm)
    return sums


def run_updates(policy, critic, algo: Algorithm, tokens: TokenBatch, x: UpdateInputs,
                policy_opt: Optim | None, critic_opt: Optim | None, cfg,
                generator: torch.Generator) -> tuple[dict[str, float], int, int]:
    """``cfg.ppo_epochs`` shuffled passes of minibatches; returns the metric sums over
    optimiser steps (summed over ranks) and the counts of policy and critic steps.
    ``policy_opt`` None: the policy does not train this step (the critic warms up)."""
    shares: list[dict[str, float]] = []  # this rank's share of each optimiser step's metrics
    norms: dict[str, float] = {}  # the same on every rank
    n_steps = n_critic_steps = 0
    N = len(x.advantages)
    live = x.rows
    for _ in range(cfg.ppo_epochs):
        perm = torch.randperm(N, generator=generator).to(x.mask.device)
        for i in range(0, N, cfg.minibatch_size):
            # in row order: a minibatch of the whole batch is then a view of the saved
            # activations, not a copy
            idx = perm[i:i + cfg.minibatch_size].sort().values
            if not live[idx].any():
                continue
            m: dict[str, float] = {}
            norm: dict[str, float] = {}
            if policy_opt is not None:
                m.update(accumulate_policy_gradient(
                    policy, algo, tokens, x.mask, idx, x.advantages, x.old_logprobs,
                    x.ref_logprobs, live, x.local_of, cfg.micro_batch_size,
                    _token_budget(cfg), x.recorded, x.behaviour, x.correction,
                    x.aux_coef))
                norm["grad_norm"] = policy_opt.step()
                n_steps += 1
                if tokens is not None:  # the policy moved: the sampler's cache is stale
                    tokens.release_sampler_cache()
            if critic is not None:
                m.update(accumulate_value_gradient(critic, algo, tokens, x.mask, idx,
                                                   x.old_values, x.returns, live, x.local_of,
                                                   cfg.micro_batch_size))
                norm["critic_grad_norm"] = critic_opt.step()
                n_critic_steps += 1
            shares.append(m)
            for k, v in norm.items():
                norms[k] = norms.get(k, 0.0) + v
    # each optimiser step's metrics over ranks, then their sum over steps
    # (a context-parallel group's ranks hold the same shares: its first rank's count)
    every = dist.gather_objects(shares)[::dist.context_size()]
    steps = [combine(parts) for parts in zip(*every, strict=True)]
    sums = {}
    for m in steps:
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v
    return {**sums, **norms}, n_steps, n_critic_steps


def _token_budget(cfg) -> int:
    """The most tokens a sample trains: max_new_tokens, or an episode's (every turn's,
    within max_episode_tokens) — the constant of the ``seq_sum_const`` aggregation."""
    if getattr(cfg, "episodic", False):
        return min(cfg.max_turns * cfg.max_new_tokens, cfg.max_episode_tokens)
    return cfg.max_new_tokens
