"""Experience: sample a step's groups through the rollout engine, score them with the reward
terms and refill with dynamic sampling (DAPO): the sampler side's work (:mod:`.sides`).

Dynamic sampling drops groups whose rewards are all equal and samples more prompts, up to
``dynamic_sampling_rounds`` rounds; DAPO's overlong shaping is added to the reward when the
algorithm asks. The learner shapes the scores (:mod:`.shaping`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from posttrain import dist
from posttrain.core import groups_with_signal, overlong_penalty
from posttrain.core.algorithms import Algorithm
from posttrain.rewards import reward_columns
from posttrain.rewards import score as score_rewards
from posttrain.rollout import Request, Rollout, RolloutEngine, SamplingParams, concat, select
from posttrain.rollout.engine import request_seed
from posttrain.rollout.types import portable


@dataclass
class Experience:
    """One step's scored samples, ready for updates."""

    rollout: Rollout
    scores: torch.Tensor  # (N,) total reward used for advantages
    terms: dict[str, torch.Tensor]  # per reward term (N,)
    valid: torch.Tensor  # (N,) False for samples skipped on a reward error
    correct: torch.Tensor  # (N,) bool: task accuracy (see ExperienceMaker.correct)
    rounds: int
    dropped_groups: int
    generate_s: float = 0.0
    """Seconds spent sampling (every round)."""
    reward_s: float = 0.0
    """Seconds spent scoring (every round)."""
    sampled_tokens: int = 0
    """Completion tokens sampled, every round's (those of dropped groups too)."""
    local: Rollout | None = None
    """This rank's samples (rows ``own`` of ``rollout``, with the projections' outputs
    when kept); ``rollout`` itself in a world of one."""
    own: torch.Tensor | None = None
    """(n,) the rows of ``rollout`` this rank sampled, ascending."""


class ExperienceMaker:
    """Draws prompts in a seeded order, samples and scores them; owns the data order
    (resumable)."""

    def __init__(self, cfg, algo: Algorithm, engine: RolloutEngine, tokenizer, rewards,
                 train_rows: list[dict], generator: torch.Generator, accuracy=None):
        self.cfg, self.algo, self.engine, self.tok = cfg, algo, engine, tokenizer
        self.rewards, self.train_rows, self.gen = rewards, train_rows, generator
        self.accuracy = accuracy
        """``f(prompts, completions, **columns) -> list[float]`` whose value ≥ 1 counts a
        sample correct (the task's own check, whatever the training reward), or None: the
        first reward term's."""
        stop = tuple(s for s in (cfg.stop or "").split(",") if s)
        self.params = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k,
                                     cfg.max_new_tokens, stop)
        self.order: list[int] = []
        self.extras: frozenset[str] = frozenset()
        """What the next rollouts keep for the update to reuse (the engine's ``extras``)."""
        self._ids: dict[str, tuple[int, ...]] = {}
        self.env = None
        """The run's episodes (``--env``): an :class:`~posttrain.episodes.env.EnvSpec`, or
        None for single-turn completions."""
        if cfg.episodic:
            from posttrain.episodes import EnvSpec, EpisodeLimits, Renderer, tool_spec

            if getattr(cfg, "agent", None):
                from posttrain.agents import AgentSpec

                self.env, tools = AgentSpec.parse(cfg.agent, cfg.agent_timeout,
                                                  cfg.agent_concurrency, cfg.tool_parser), None
            elif cfg.tools:
                self.env, tools = tool_spec(cfg.tools, tokenizer, cfg.tool_error_reward,
                                            cfg.env_timeout)
            else:
                self.env, tools = EnvSpec.parse(cfg.env, cfg.env_kwargs, cfg.env_timeout), None
            self.limits = EpisodeLimits(cfg.max_turns, cfg.max_episode_tokens)
            self.renderer = Renderer(tokenizer, tools)
        self.hub = None
        """The agents' endpoint (``--agent``), started with the first episodes."""
        self.before_turn = None
        """Called before each turn of an episode after its first (partial rollouts: the
        producer's chance to take newer weights), or None."""
        self.group = None
        """The process group of the round's gather (None: the default one; the producer
        of asynchronous rollouts gathers on a group of its own)."""
        self.completion = "answer" if getattr(cfg, "tools", None) else "transcript"
        """What the reward terms score of an episode: its last turn (tools), or the whole
        transcript."""

    @property
    def agents(self) -> bool:
        """Episodes are played by an agent program (``--agent``)."""
        return type(self.env).__name__ == "AgentSpec"

    def agent_hub(self):
        """The agents' endpoint, started once."""
        if self.hub is None:
            from posttrain.agents import Hub

            self.hub = Hub(self.env, self.tok, self.cfg.max_episode_tokens,
                           self.cfg.max_length)
        return self.hub

    def close(self) -> None:
        """Stop the agents' endpoint, where one was started."""
        if self.hub is not None:
            self.hub.close()
            self.hub = None

    def prompt_ids(self, row: dict) -> tuple[int, ...]:
        """The row's prompt as token ids, tokenised once per run (plain text)."""
        key = row["prompt"]
        if key not in self._ids:
            self._ids[key] = tuple(self.tok(key)["input_ids"])
        return self._ids[key]

    def first_prompt_ids(self, row: dict) -> tuple[int, ...]:
        """The prompt a row's first sample starts from: its prompt's ids, or with an
        environment the first message of an episode of it."""
        if self.env is None:
            return self.prompt_ids(row)
        if self.agents:  # (the agent writes the messages: the row itself stands for them)
            text = row["prompt"] if isinstance(row.get("prompt"), str) else json.dumps(
                {k: v for k, v in row.items() if k != "_row"}, sort_keys=True, default=str)
            return tuple(self.renderer.start([{"role": "user", "content": text}]))
        from posttrain.episodes import Episode

        first = Episode.of(self.env, row, 1).reset()
        return tuple(self.renderer.start([{"role": "user", "content": first}]))

    def next_rows(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if not self.order:
                self.order = torch.randperm(len(self.train_rows), generator=self.gen).tolist()
            out.append(self.train_rows[self.order.pop()])
        return out

    def sample(self, rows: list[dict], seeds: list[int | None], n: int,
               params: SamplingParams, extras: frozenset[str] = frozenset()):
        """``n`` samples of each row, scored: single-turn completions of their prompts, or
        (with an environment) episodes. Returns ``(rollout, (total, terms, valid,
        correct), seconds sampling, seconds scoring)``; the environments' seconds count as
        sampling (and are in the rollout's ``stats``)."""
        t0 = time.perf_counter()
        if self.env is None:
            requests = [Request(self.prompt_ids(r), s) for r, s in zip(rows, seeds, strict=True)]
            rollout = self.engine.generate(requests, n, params, extras=extras)
            eps = None
        elif self.agents:
            from posttrain.agents import run_agents

            eps = run_agents(self.agent_hub(), self.engine, self.tok, rows, n, seeds, params,
                             self.cfg.on_reward_error, bool(self.rewards), extras & {"routing"},
                             self.before_turn)
            rollout = eps.rollout
        else:
            from posttrain.episodes import run_episodes

            eps = run_episodes(self.engine, self.tok, self.env, rows, n, seeds, params,
                               self.limits, self.cfg.on_reward_error, self.renderer,
                               self.cfg.max_length, extras=extras & {"routing"},
                               workers=self.cfg.env_workers, before_turn=self.before_turn)
            rollout = eps.rollout
        t1 = time.perf_counter()
        scored = self.score(rows, rollout, eps)
        return rollout, scored, t1 - t0, time.perf_counter() - t1

    def score(self, rows: list[dict], rollout: Rollout, episodes=None):
        """``(total, terms, valid, correct)`` of ``rollout`` (its group ids index ``rows``).
        Episodes: the total is the return (the sum of the turn rewards, term ``env``) plus
        the reward terms, which read the first message as the prompt and the transcript
        after it as the completion; a sample is correct when its total reaches 1."""
        rep = [rows[g] for g in rollout.group_ids.tolist()]  # (a sample may be rows: agents)
        columns = reward_columns(rep)
        if episodes is None:
            prompts = [r["prompt"] for r in rep]
            total, terms, valid = score_rewards(self.rewards, prompts, rollout.texts, columns,
                                                self.cfg.on_reward_error)
            correct = self.correct(prompts, rollout.texts, columns, terms)
        else:
            from posttrain.episodes import score_episodes

            total, terms, valid, correct = score_episodes(episodes, rep, self.rewards,
                                                          self.cfg.on_reward_error,
                                                          self.completion)
        if self.algo.overlong_shaping:
            budget = self.cfg.max_episode_tokens if episodes is not None else \
                self.cfg.max_new_tokens
            shaping = overlong_penalty(rollout.lengths, budget,
                                       min(self.cfg.overlong_cache, budget))
            terms["overlong"] = shaping
            total = total + shaping
        return total, terms, valid, correct

    def correct(self, prompts, completions, columns, terms) -> torch.Tensor:
        """Task accuracy per sample: the ``accuracy`` check when there is one (whatever the
        training reward, e.g. a reward model); otherwise the first reward term ≥ 1."""
        if self.accuracy is not None:
            return torch.tensor(self.accuracy(prompts, completions, **columns)) >= 1
        return next(iter(terms.values())).nan_to_num() >= 1

    def evaluate(self, engine, rows: list[dict]) -> list[float]:
        """Greedy decoding of ``rows`` through ``engine``: ``[correct, summed reward of the
        valid ones, valid]`` (task accuracy as in :meth:`correct`; episodes: the total
        reaches 1)."""
        if not rows:
            return [0.0, 0.0, 0.0]
        cfg = self.cfg
        if self.agents:
            from posttrain.agents import greedy_agents

            correct, total, valid = greedy_agents(
                self.agent_hub(), engine, self.tok, rows, self.rewards, cfg.max_new_tokens,
                self.params.stop, cfg.eval_batch_size)
        elif self.env is not None:
            from posttrain.episodes.evaluate import greedy_episodes

            correct, total, valid = greedy_episodes(
                engine, self.tok, self.env, rows, self.rewards, self.limits,
                cfg.max_new_tokens, self.params.stop, cfg.eval_batch_size, self.renderer,
                "skip", cfg.max_length, self.completion)
        else:
            from posttrain.evaluate import greedy_completions

            prompts = [r["prompt"] for r in rows]
            completions = greedy_completions(engine, prompts, cfg.max_new_tokens,
                                             cfg.eval_batch_size)
            columns = reward_columns(rows)
            total, terms, valid = score_rewards(self.rewards, prompts, completions, columns,
                                                "skip")
            correct = self.correct(prompts, completions, columns, terms)
        return [float(correct.sum()), float(total[valid].double().sum()), float(valid.sum())]

    def collect(self, step: int) -> Experience:
        """Sample and score a step's groups (refilling with dynamic sampling). With several
        ranks each samples and scores its own prompt slots (every ``world``-th from its
        rank) and the round is gathered, so every rank decides on the same samples."""
        cfg, want, G = self.cfg, self.cfg.prompts_per_step, self.cfg.group_size
        parts, locals_, owns = [], [], []
        kept = dropped = rounds = offset = sampled = 0
        t_gen = t_reward = 0.0
        while kept < want and rounds < (cfg.dynamic_sampling_rounds
                                         if self.algo.dynamic_sampling else 1):
            rounds += 1
            rows = self.next_rows(want)
            slots = list(range(dist.rank(), want, dist.world_size()))
            local, scored, dt_gen, dt_reward = self.sample(
                [rows[j] for j in slots], [request_seed(cfg.seed, step, rounds, j)
                                           for j in slots], G, self.params, self.extras)
            t_gen, t_reward = t_gen + dt_gen, t_reward + dt_reward
            rollout, (total, terms, valid, correct), own = self._gather(local, scored)
            sampled += int(rollout.trained_mask.sum())
            if self.algo.dynamic_sampling:
                n_groups = len(rows)
                rollout, (total, terms, valid, correct), local, own, n_kept = self._with_signal(
                    rollout, (total, terms, valid, correct), local, own, want - kept)
                dropped += n_groups - n_kept[1]
                kept += n_kept[0]
            else:
                kept += len(rows)
            parts.append((rollout, total, terms, valid, correct))
            locals_.append(local)
            owns.append(own + offset)
            offset += len(total)
        if kept == 0:
            raise RuntimeError(
                f"dynamic sampling found no group with different rewards in {rounds} rounds of "
                f"{want} prompts: every group was all right or all wrong, so the data is too "
                "easy or too hard for this policy (or the reward is constant)")
        pad = self.tok.pad_token_id
        rollout = concat([p[0] for p in parts], pad)
        width = rollout.completion_ids.shape[1]
        mine = [r for r in locals_ if len(r.texts)]
        local = (rollout if dist.world_size() == 1
                 else concat(mine, pad, width=width) if mine
                 else select(rollout, torch.zeros(0, dtype=torch.long)))
        return Experience(rollout, torch.cat([p[1] for p in parts]),
                          {k: torch.cat([p[2][k] for p in parts]) for k in parts[0][2]},
                          torch.cat([p[3] for p in parts]), torch.cat([p[4] for p in parts]),
                          rounds, dropped, t_gen, t_reward, sampled, local, torch.cat(owns))

    def _with_signal(self, rollout: Rollout, scored: tuple, local: Rollout,
                     own: torch.Tensor, room: int):
        """Dynamic sampling's filter of one round: its groups whose rewards differ (at most
        ``room`` of them), with their scores, this rank's part of them and its rows; and
        ``(groups kept, groups with a signal)``."""
        total, terms, valid, correct = scored
        # a sample skipped on an error is a group of its own (as for the advantages), so its
        # placeholder score gives its group no signal
        ids = rollout.group_ids.clone()
        ids[~valid] = int(ids.max()) + 1 + torch.arange(int((~valid).sum()))
        signal = groups_with_signal(total, ids) & valid
        groups = rollout.group_ids[signal].unique()[:room]
        keep = torch.isin(rollout.group_ids, groups).nonzero().squeeze(-1)
        if dist.world_size() > 1:  # this rank's kept rows (one process: all of them)
            mine = torch.zeros(len(total), dtype=torch.bool)
            mine[own] = True
            position = torch.full((len(total),), -1, dtype=torch.long)
            position[own] = torch.arange(len(own))
            local = select(local, position[keep[mine[keep]]])
            own = mine[keep].nonzero().squeeze(-1)
        else:
            own = torch.arange(len(keep))
        scored = (total[keep], {k: v[keep] for k, v in terms.items()}, valid[keep],
                  correct[keep])
        with_signal = len(rollout.group_ids[signal].unique())
        return select(rollout, keep), scored, local, own, (len(groups), with_signal)

    def _gather(self, local: Rollout, scored: tuple):
        """The round's samples of every rank in slot order (the order one process samples
        them in), without the sampler's cache (it stays with ``local``); the scores
        ``(total, terms, valid, correct)``; and the rows of this rank's samples."""
        if dist.world_size() == 1:
            return local, scored, torch.arange(len(local.texts))
        gathered = dist.gather_objects((portable(local), scored), self.group)
        world, want = dist.world_size(), self.cfg.prompts_per_step
        # rank r's k-th group is slot k·world + r; a group's rows (G, or more where an
        # agent's episode is several trajectories) stay in the order they were sampled
        slot = torch.cat([torch.arange(rank, want, world)[r.group_ids]
                          for rank, (r, _) in enumerate(gathered)])
        rows = torch.sort(slot, stable=True).indices
        position = torch.empty_like(rows)
        position[rows] = torch.arange(len(rows))
        start = sum(len(r.texts) for r, _ in gathered[:dist.rank()])
        own = position[start:start + len(local.texts)]
        rollout = select(concat([r for r, _ in gathered if len(r.texts)],
                                self.tok.pad_token_id), rows)
        rollout.group_ids = slot[rows]
        total, terms, valid, correct = (
            torch.cat([s[0] for _, s in gathered])[rows],
            {k: torch.cat([s[1][k] for _, s in gathered])[rows] for k in gathered[0][1][1]},
            torch.cat([s[2] for _, s in gathered])[rows],
            torch.cat([s[3] for _, s in gathered])[rows])
        return rollout, (total, terms, valid, correct), own
