"""The episode loop: many episodes in flight over one rollout engine.

Each turn, every episode still running is one request (its whole sequence so far as the
prompt, its own seed for the turn) in one ``engine.generate`` call; the engine batches them
(the lean and hf engines decode them together; vLLM schedules them and reuses the cached
prefix of earlier turns). Each episode's environment then reads its turn, and what it
returns is appended as tokens (:class:`~posttrain.episodes.render.Renderer`) that the loss
never sees. An episode ends when its environment says ``done``, at ``max_turns``, or when
its tokens after the first prompt reach ``max_episode_tokens`` (truncated; the last turn's
reward kept).

The result is a :class:`~posttrain.rollout.Rollout` whose "completion" is everything after
the first prompt — assistant turns and environment messages — with ``loss_mask`` 1 on the
sampled tokens only and their behaviour log-probs; the trainers take it as they take a
single-turn rollout (a single turn is the one-turn episode).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from posttrain.episodes.env import EnvError, EnvSpec, Episode, step_all
from posttrain.episodes.render import Renderer
from posttrain.rollout import Request, Rollout, SamplingParams
from posttrain.rollout.types import sample_seed, stream_seed


@dataclass
class EpisodeLimits:
    max_turns: int = 4
    max_episode_tokens: int = 64
    """Tokens after the first prompt: every turn's and every message's."""


@dataclass
class Episodes:
    """A batch of finished episodes, one row per trajectory."""

    rollout: Rollout
    returns: torch.Tensor
    """(N,) float64: the sum of each episode's turn rewards."""
    valid: torch.Tensor
    """(N,) False for an episode dropped on an environment error (``on_error="skip"``)."""
    messages: list[list[dict]]
    """Each episode's conversation as messages (the first one included)."""
    errors: list[str] = field(default_factory=list)
    """One line per episode dropped on an error, in episode order."""

    @property
    def first(self) -> list[str]:
        """Each episode's first user message (the "prompt" reward functions receive)."""
        return [m[0]["content"] if m else "" for m in self.messages]

    @property
    def answers(self) -> list[str]:
        """Each episode's last assistant turn."""
        return [next((x["content"] for x in reversed(m) if x["role"] == "assistant"), "")
                for m in self.messages]

    @property
    def turns(self) -> torch.Tensor:
        """(N,) assistant turns taken."""
        return self.rollout.stats["turns"].long()

    @property
    def env_s(self) -> float:
        """Seconds spent in the environments' reset and step calls."""
        return float(self.rollout.stats["env_s"].sum())


@dataclass
class _Live:
    episode: Episode | None
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    ret: float = 0.0
    turns: int = 0
    done: bool = False
    truncated: bool = False
    valid: bool = True
    error: str = ""
    """Why the episode was dropped (``on_error="skip"``)."""
    env_s: float = 0.0
    version: int = 0
    versions: list[int] = field(default_factory=list)
    """The policy version of each token (an environment message's: its turn's)."""
    routing: torch.Tensor | None = None
    """(routers, positions, k): the experts each fed token went to, over the turns (-1
    where none: a token never fed)."""


def run_episodes(engine, tokenizer, spec: EnvSpec, rows: list[dict], n: int,
                 seeds: list[int | None], params: SamplingParams, limits: EpisodeLimits,
                 on_error: str = "raise", renderer: Renderer | None = None,
                 max_length: int | None = None, reuse: bool = True,
                 extras: frozenset[str] = frozenset(), workers: int = 1,
                 before_turn=None) -> Episodes:
    """``n`` episodes of each row (rows of one row contiguous, as a rollout's groups): row
    ``i``'s episode ``j`` samples turn ``t`` from ``stream_seed(sample_seed(seeds[i], j),
    "turn", t)`` (None: the engine's own randomness). ``on_error``: ``raise`` an
    :class:`EnvError`, or ``skip`` (the episode is dropped: ``valid`` False, its line in
    ``errors``). ``reuse``: a turn reuses the engine's keys and values of the earlier ones
    (:meth:`~posttrain.rollout.RolloutEngine.reusing_prefixes`); False re-encodes them.
    ``extras``: ``routing`` keeps, for a mixture-of-experts sampler, the experts every fed
    token of the transcript went to (each turn's call records the tokens it runs), as the
    rollout's ``routing``. ``workers``: the environments' calls of one turn run on this
    many threads at once (their results taken in episode order). ``before_turn(turn)``:
    called before every turn after the first (partial rollouts: the engine may take newer
    weights there; each token keeps the version that sampled it, ``Rollout.versions``)."""
    renderer = renderer or Renderer(tokenizer)
    live: list[_Live] = []
    for i, row in enumerate(rows):
        for _ in range(n):  # each episode its own copy of the row
            t0 = time.perf_counter()
            try:
                ep = Episode.of(spec, row, i + 1)
                first = ep.reset()
            except EnvError as e:
                if on_error == "raise":
                    raise
                live.append(_Live(None, [tokenizer.eos_token_id], done=True, valid=False,
                                  error=str(e), env_s=time.perf_counter() - t0))
                continue
            msg = {"role": "user", "content": first}
            prompt = renderer.start([msg])
            if max_length and len(prompt) + limits.max_episode_tokens > max_length:
                raise EnvError(f"env {spec.name} on row {ep.row}: the first message is "
                               f"{len(prompt)} tokens; with max_episode_tokens "
                               f"{limits.max_episode_tokens} that is over max_length "
                               f"{max_length}")
            live.append(_Live(ep, prompt, messages=[msg], env_s=time.perf_counter() - t0))
    with engine.reusing_prefixes() if reuse else contextlib.nullcontext():
        _turns(engine, tokenizer, live, n, seeds, params, limits, on_error, renderer, extras,
               workers, before_turn)
    return _collect(live, tokenizer, n)


def _turns(engine, tokenizer, live, n, seeds, params, limits, on_error, renderer,
           extras=frozenset(), workers=1, before_turn=None):
    """Every episode of ``live`` to its end, one engine call per turn."""
    for turn in range(limits.max_turns):
        running = [k for k, e in enumerate(live) if not e.done]
        if not running:
            break
        if before_turn is not None and turn:
            before_turn(turn)
        # each episode's turn budget: max_new_tokens, or what its episode has left (one
        # call per distinct budget; a sample's draws depend on its seed alone)
        budget = {k: min(params.max_new_tokens, limits.max_episode_tokens - len(live[k].tokens))
                  for k in running}
        outs: dict[int, tuple] = {}
        for b in sorted(set(budget.values()), reverse=True):
            part = [k for k in running if budget[k] == b]
            requests = [Request(tuple(live[k].prompt + live[k].tokens),
                                None if seeds[k // n] is None else
                                stream_seed(sample_seed(seeds[k // n], k % n), "turn", turn))
                        for k in part]
            out = engine.generate(requests, 1, SamplingParams(
                params.temperature, params.top_p, params.top_k, b, params.stop),
                extras=extras)
            for j, k in enumerate(part):
                if out.routing is not None:
                    _record(live[k], out.routing[j])
                m = out.completion_mask[j].bool()
                outs[k] = (out.completion_ids[j][m].tolist(), out.logprobs[j][m].tolist(),
                           out.texts[j], out.policy_version)
        t0 = time.perf_counter()
        stepped = dict(zip(running, step_all([live[k].episode for k in running],
                                             [outs[k][2] for k in running], workers),
                           strict=True))
        env_s = (time.perf_counter() - t0) / len(running)  # (each episode its share)
        for k in running:
            e = live[k]
            ids, lps, text, version = outs[k]
            e.version = min(e.version, version) if e.turns else version
            # the turn ended with eos (not at its budget, nor at a stop string, after which
            # the template's closing, eos included, is appended untrained)
            ended = bool(ids) and ids[-1] == tokenizer.eos_token_id
            e.tokens += ids
            e.mask += [1] * len(ids)
            e.logps += lps
            e.versions += [version] * len(ids)
            e.turns += 1
            e.messages.append({"role": "assistant", "content": text})
            e.env_s += env_s
            got = stepped[k]
            if isinstance(got, EnvError):
                if on_error == "raise":
                    raise got
                e.done, e.valid, e.error = True, False, str(got)
                continue
            message, reward, done = got
            e.ret += reward
            if done:
                e.done = True
                continue
            if turn + 1 == limits.max_turns:
                e.done = e.truncated = True
                continue
            if message is not None:
                e.messages.append(message)
            nxt = renderer.between(ended, [message] if message is not None else [])
            if len(e.tokens) >= limits.max_episode_tokens or \
                    len(e.tokens) + len(nxt) >= limits.max_episode_tokens:
                e.done = e.truncated = True  # no room for another turn
                continue
            e.tokens += nxt
            e.mask += [0] * len(nxt)
            e.logps += [0.0] * len(nxt)
            e.versions += [version] * len(nxt)


def _record(e: _Live, got: torch.Tensor) -> None:
    """Merge a turn's recording ``(routers, positions, k)`` (sequence positions; -1 where the
    call fed no token) into the episode's."""
    if e.routing is None or e.routing.shape[1] < got.shape[1]:
        grown = torch.full((*got.shape[:1], got.shape[1], got.shape[2]), -1, dtype=got.dtype)
        if e.routing is not None:
            grown[:, :e.routing.shape[1]] = e.routing
        e.routing = grown
    fed = (got >= 0).all(-1)  # (routers, positions)
    e.routing[:, :got.shape[1]][fed] = got[fed]


def score_episodes(eps: Episodes, rows: list[dict], rewards, on_error: str = "raise",
                   completion: str = "transcript"):
    """``(total, terms, valid, correct)`` of episodes (``rows``: each episode's row): the
    total is the return (term ``env``) plus the reward terms, which read each episode's
    first message as the prompt, as the completion its transcript after it
    (``completion="transcript"``, ``--env``) or its last assistant turn (``"answer"``,
    ``--tools``), its row's columns and ``messages`` (the conversation); correct: the
    total reaches 1."""
    from posttrain.rewards import score

    total, terms, valid = eps.returns, {"env": eps.returns}, eps.valid
    if rewards:
        extra, more, ok = score(rewards, *reward_inputs(eps, rows, completion), on_error)
        total, valid = total + extra, valid & ok
        terms.update(more)
    total = torch.where(valid, total, 0.0)
    return total, terms, valid, total >= 1


def reward_inputs(eps: Episodes, rows: list[dict], completion: str = "transcript"
                  ) -> tuple[list[str], list[str], dict[str, list]]:
    """What the reward terms read (:func:`score_episodes`): ``(prompts, completions,
    columns)``."""
    from posttrain.rewards import reward_columns

    texts = eps.answers if completion == "answer" else eps.rollout.texts
    return eps.first, texts, {**reward_columns(rows), "messages": eps.messages}


def _collect(live: list[_Live], tokenizer, n: int,
             samples: list[int] | None = None) -> Episodes:
    """The finished episodes as a batch: ``n`` samples of each row, in order; ``samples``:
    each row's sample where a sample may be several rows (a split agent episode's
    trajectories, :attr:`Rollout.sample_ids`), None for one row each."""
    pad = tokenizer.pad_token_id
    T = max(1, *(len(e.tokens) for e in live)) if live else 1
    N = len(live)
    ids = torch.full((N, T), pad, dtype=torch.long)
    present = torch.zeros(N, T, dtype=torch.long)
    loss = torch.zeros(N, T, dtype=torch.long)
    logps = torch.zeros(N, T)
    versions = torch.zeros(N, T, dtype=torch.long)
    for k, e in enumerate(live):
        L = len(e.tokens)
        if L:
            ids[k, :L] = torch.tensor(e.tokens)
            present[k, :L] = 1
            loss[k, :L] = torch.tensor(e.mask)
            logps[k, :L] = torch.tensor(e.logps)
            versions[k, :L] = torch.tensor(e.versions)
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)  # (pad past each one)
    stats = {"turns": torch.tensor([float(e.turns) for e in live], dtype=torch.float64),
             "env_s": torch.tensor([e.env_s for e in live], dtype=torch.float64)}
    for key in sorted({k for e in live for k in _counters(e)}):
        stats[key] = torch.tensor([float(_counters(e).get(key, 0)) for e in live],
                                  dtype=torch.float64)
    rollout = Rollout(prompt_ids=[e.prompt for e in live], completion_ids=ids,
                      completion_mask=present, logprobs=logps,
                      truncated=torch.tensor([e.truncated for e in live], dtype=torch.bool),
                      group_ids=(torch.arange(N) if samples is None
                                 else torch.tensor(samples, dtype=torch.long)) // n,
                      texts=texts,
                      loss_mask=loss, stats=stats,
                      policy_version=min((e.version for e in live), default=0))
    if samples is not None and len(set(samples)) < N:
        rollout.sample_ids = torch.tensor(samples, dtype=torch.long)
    if len({v for e in live for v in e.versions}) > 1:  # (partial rollouts)
        rollout.versions = versions
    if any(e.routing is not None for e in live):
        rollout.routing = _routing(live, max(len(e.prompt) for e in live) + T)
    return Episodes(rollout, torch.tensor([e.ret for e in live], dtype=torch.float64),
                    torch.tensor([e.valid for e in live], dtype=torch.bool),
                    [e.messages for e in live], [e.error for e in live if not e.valid])


def _routing(live: list[_Live], width: int) -> torch.Tensor:
    """The episodes' recordings as one ``(N, routers, width, k)`` (-1 where none)."""
    like = next(e.routing for e in live if e.routing is not None)
    out = torch.full((len(live), like.shape[0], width, like.shape[2]), -1, dtype=like.dtype)
    for k, e in enumerate(live):
        if e.routing is not None:
            w = min(width, e.routing.shape[1])
            out[k, :, :w] = e.routing[:, :w]
    return out


def _counters(e: _Live) -> dict:
    """The environment's own counters (an optional ``metrics`` dict of numbers on the
    environment object, e.g. the tool environment's ``tool_calls``)."""
    got = getattr(e.episode.env, "metrics", None) if e.episode is not None else None
    if not isinstance(got, dict):
        return {}
    return {k: v for k, v in got.items() if isinstance(k, str) and isinstance(v, (int, float))}
