"""Agents as clients: an OpenAI-compatible endpoint served by the run during rollouts, the
tool-call parsers it answers with, and the capture that turns an agent's requests into the
token-exact trajectories the trainers take (``--agent FILE.py:fn``; docs/agents.md)."""

from __future__ import annotations

import torch

from posttrain.agents.capture import Capture, RequestError, Trajectory, normalise
from posttrain.agents.runner import MODEL, AgentError, AgentSpec, Hub, client_for
from posttrain.rollout import SamplingParams

__all__ = ["MODEL", "AgentError", "AgentSpec", "Capture", "Hub", "RequestError",
           "Trajectory", "client_for", "greedy_agents", "normalise", "run_agents"]


def run_agents(hub: Hub, engine, tokenizer, rows: list[dict], n: int,
               seeds: list[int | None], params: SamplingParams, on_error: str = "raise",
               has_rewards: bool = False, extras: frozenset[str] = frozenset()):
    """``n`` agent episodes of each row through ``hub`` as
    :class:`~posttrain.episodes.Episodes` (one row per episode, samples of a row together):
    each episode's trajectory (the last, when its agent rewrote history), its reward as
    the return. An episode that failed raises an :class:`AgentError`
    (``on_error="raise"``) or is dropped and counted (``"skip"``)."""
    from posttrain.episodes.loop import _collect, _Live

    eps = hub.run(engine, rows, n, seeds, params, extras)
    live, terms = [], {}
    for ep in eps:
        if not ep.error and ep.reward is None and not has_rewards:
            ep.error = "returned None and the run has no --reward terms to score it"
        if not ep.error and not ep.capture.trajectories:
            ep.error = "made no request"
        if ep.error:
            why = f"agent {hub.spec.name} on row {ep.label}: {ep.error}"
            if on_error == "raise":
                raise AgentError(why)
            live.append(_Live(None, [tokenizer.eos_token_id], done=True, valid=False,
                              error=why))
            continue
        t = ep.capture.trajectories[-1]
        reward = ep.reward or 0.0
        if isinstance(reward, dict):
            for k, v in reward.items():
                terms.setdefault(k, {})[len(live)] = v
            reward = sum(reward.values())
        live.append(_Live(None, t.prompt, tokens=list(t.tokens), mask=list(t.mask),
                          logps=list(t.logps), messages=list(t.convo), ret=float(reward),
                          turns=t.requests, done=True, truncated=ep.finish == "length",
                          version=min(t.versions, default=0), versions=list(t.versions)))
    out = _collect(live, tokenizer, n)
    stats = out.rollout.stats
    splits = [max(0, len(ep.capture.trajectories) - 1) for ep in eps]
    stats["trajectory_splits"] = torch.tensor(splits, dtype=torch.float64)
    stats["requests"] = torch.tensor([float(ep.requests) for ep in eps], dtype=torch.float64)
    stats["refused_requests"] = torch.tensor([float(ep.refused) for ep in eps],
                                             dtype=torch.float64)
    for k, values in terms.items():
        stats[f"reward_{k}"] = torch.tensor([values.get(i, 0.0) for i in range(len(eps))],
                                            dtype=torch.float64)
    return out


def greedy_agents(hub: Hub, engine, tokenizer, rows: list[dict], rewards,
                  max_new_tokens: int, stop: tuple[str, ...] = (), batch_size: int = 64,
                  errors: list[str] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(correct, total, valid)`` per row: one greedy agent episode each (``batch_size``
    at once), scored as in training (an episode that failed is skipped; ``errors``, where
    given, gets its line)."""
    from posttrain.episodes import score_episodes

    params = SamplingParams(0.0, 1.0, 0, max_new_tokens, stop)
    out = ([], [], [])
    for i in range(0, len(rows), batch_size):
        part = rows[i:i + batch_size]
        eps = run_agents(hub, engine, tokenizer, part, 1, [None] * len(part), params, "skip",
                         bool(rewards))
        if errors is not None:
            errors += eps.errors
        total, _, valid, correct = score_episodes(eps, part, rewards, "skip")
        for acc, x in zip(out, (correct, total, valid), strict=True):
            acc.append(x)
    return tuple(torch.cat(x) for x in out)
