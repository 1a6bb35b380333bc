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
               has_rewards: bool = False, extras: frozenset[str] = frozenset(),
               before_batch=None):
    """``n`` agent episodes of each row through ``hub`` as
    :class:`~posttrain.episodes.Episodes`: a row per trajectory (an episode whose agent
    rewrote its history is several, which share its sample id, its reward and its final
    conversation), samples of a row together. An episode that failed raises an
    :class:`AgentError` (``on_error="raise"``) or is one invalid row (``"skip"``); so is a
    request that came after its episode ended (``"skip"``: counted, ``late_requests``).
    ``before_batch``: as for :meth:`Hub.run`."""
    from posttrain.episodes.loop import _collect, _Live

    eps = hub.run(engine, rows, n, seeds, params, extras, before_batch)
    late = hub.take_late()  # (an agent's call after its episode ended: this run's, or before)
    if late and on_error == "raise":
        raise AgentError(late[0])
    live, samples, terms = [], [], {}
    for k, ep in enumerate(eps):
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
            samples.append(k)
            continue
        reward = ep.reward or 0.0
        if isinstance(reward, dict):
            for name, v in reward.items():
                terms.setdefault(name, {})[k] = v
            reward = sum(reward.values())
        final = ep.capture.trajectories[-1].convo
        for t in ep.capture.trajectories:
            live.append(_Live(None, t.prompt, tokens=list(t.tokens), mask=list(t.mask),
                              logps=list(t.logps), messages=list(final), ret=float(reward),
                              turns=t.requests, done=True,
                              truncated=ep.finish == "length" and t is ep.capture.current,
                              version=min(t.versions, default=0), versions=list(t.versions)))
            samples.append(k)
    out = _collect(live, tokenizer, n, samples)
    stats, last = out.rollout.stats, [i + 1 == len(samples) or samples[i + 1] != s
                                       for i, s in enumerate(samples)]
    counts = {  # (on each episode's last row, 0 on the others: sums are the episodes')
        "trajectory_splits": [max(0, len(ep.capture.trajectories) - 1) for ep in eps],
        "requests": [ep.requests for ep in eps], "refused_requests": [ep.refused for ep in eps],
        "late_requests": [len(late) if k == 0 else 0 for k in range(len(eps))]}
    for key, values in counts.items():
        stats[key] = torch.tensor([float(values[s]) if end else 0.0
                                   for s, end in zip(samples, last, strict=True)],
                                  dtype=torch.float64)
    for name, values in terms.items():  # (an episode's terms on each of its rows)
        stats[f"reward_{name}"] = torch.tensor([values.get(s, 0.0) for s in samples],
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
