"""Agents as clients: ``--agent FILE.py:fn`` runs the user's program once per episode
against the run's own OpenAI-compatible endpoint, and trains on what it asked.

For every row and sample posttrain calls ``fn(client, row)`` (a function or a coroutine
function) on a pool of ``--agent_concurrency`` threads, each episode under
``--agent_timeout`` seconds of wall clock. ``client`` is an ``openai.OpenAI`` client (an
``openai.AsyncOpenAI`` one for a coroutine function) whose ``base_url`` is the endpoint and
whose ``api_key`` names the episode (answered in process by the endpoint, through the same
checks, not over a socket); any other framework takes the same two strings and speaks HTTP.
``fn`` returns the episode's reward: a number, a dict of named terms (summed; each logged),
or None to let the ``--reward`` terms score the final conversation.

The requests of all episodes in flight are answered in batches: a batch is sampled once
every running episode is waiting on a request, or when requests stop coming for a moment
(:data:`WINDOW_S`; at most :data:`MAX_WAIT_S` after the first).
Request ``r`` of sample ``j`` of a row samples with the seed
``stream_seed(sample_seed(row seed, j), "turn", r)`` — the episode loop's — so an agent that
asks what an environment would have said draws what the environment's episode draws, and
whichever batch a request lands in changes nothing on the engines that sample per seed.
Temperature, top-p, top-k and the token budgets are the run's; a request that asks for
others is refused (400) and counted.

Every request is recorded token for token (:mod:`.capture`). An episode whose agent
rewrote its history is several trajectories, each trained on its own tokens as one sample
(``Rollout.sample_ids``; counted: ``agent/trajectory_splits``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import secrets
import threading
import time
from dataclasses import dataclass, field

from posttrain.agents import parsers
from posttrain.agents.capture import Capture, RequestError, check_sampling, normalise
from posttrain.agents.endpoint import AnswerTimeout, Endpoint, client_for, error
from posttrain.calls import Workers
from posttrain.episodes.render import Renderer
from posttrain.rollout import Request, SamplingParams
from posttrain.rollout.types import sample_seed, stream_seed

WINDOW_S = 0.02
"""A batch is sampled once no request has come for this long (or every running episode is
waiting): episodes still working on their next request join it while requests keep coming."""

MAX_WAIT_S = 0.5
"""The longest the first request of a batch waits for others."""

MODEL = "posttrain-policy"
"""The model name the endpoint serves (``/v1/models``); a request must name it."""


class AgentError(ValueError):
    """An agent broke its episode (one line: the agent, the row, the request, what)."""


@dataclass
class AgentSpec:
    """How to run a run's agents: the function, its name, the tool-call parser (``auto``:
    from the chat template), the per-episode timeout (s) and how many run at once."""

    fn: object
    name: str
    parser: str = "auto"
    timeout: float = 300.0
    concurrency: int = 256

    @classmethod
    def parse(cls, spec: str, timeout: float = 300.0, concurrency: int = 256,
              parser: str = "auto") -> AgentSpec:
        if spec == "builtin":
            from posttrain.builtin.agent import lookup_agent

            return cls(lookup_agent, "builtin", "ask" if parser == "auto" else parser,
                       timeout, concurrency)
        from posttrain.userfiles import load_object

        fn = load_object(spec, "agent")
        if not callable(fn):
            raise ValueError(f"agent {spec!r} is a {type(fn).__name__}, not a function")
        return cls(fn, spec.rsplit(":", 1)[-1], parser, timeout, concurrency)


@dataclass
class _Episode:
    name: str
    row: dict
    label: object
    seed: int | None
    capture: Capture
    params: SamplingParams
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    started: float | None = None
    finished: bool = False
    error: str = ""
    reward: object = None
    finish: str = ""
    refused: int = 0
    tail: tuple[int, ...] = ()  # (its last answer's prompt and completion)


@dataclass
class _Pending:
    episode: _Episode
    ids: list[int]
    budget: int
    seed: int | None
    born: float
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple | None = None


class Hub:
    """The endpoint and the episodes it serves, kept for the whole run (one port, one
    key); :meth:`run` serves one batch of episodes."""

    def __init__(self, spec: AgentSpec, tokenizer, max_episode_tokens: int,
                 max_length: int | None = None):
        self.spec, self.tok, self.max_episode_tokens = spec, tokenizer, max_episode_tokens
        self._renderers: dict[str, Renderer] = {}
        self.max_length = max_length
        self.parser = parsers.resolve(tokenizer, spec.parser)
        self.key = secrets.token_hex(16)
        self.cond = threading.Condition()
        self.episodes: dict[str, _Episode] = {}
        self.pending: list[_Pending] = []
        self.labels: dict[str, object] = {}
        """Each episode's row, this run's and the last run's (to name a late request's)."""
        self.late: list[str] = []
        """Requests that came after their episode ended (one line each), not yet reported."""
        self.endpoint = Endpoint(self, self.key)
        self.url = self.endpoint.url
        self._runs = 0
        self._shared = None

    def renderer_for(self, tools: list | None) -> Renderer:
        """The renderer of a request's tools (one per distinct set, kept)."""
        key = json.dumps(tools, sort_keys=True) if tools else ""
        with self.cond:
            if key not in self._renderers:
                self._renderers[key] = Renderer(self.tok, tools)
            return self._renderers[key]

    def take_late(self) -> list[str]:
        """The late requests' lines since the last call (and forgets them)."""
        with self.cond:
            late, self.late = self.late, []
        return late

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
        self.endpoint.close()

    def _client(self):
        """The run's sync ``openai`` client, answered in process by the endpoint (made once;
        each episode gets a copy with its own key)."""
        with self.cond:
            if self._shared is None:
                self._shared = client_for(self.url, self.key, self.spec.timeout,
                                          endpoint=self.endpoint)
            return self._shared

    # --- HTTP -------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model",
                                            "owned_by": "posttrain"}]}

    def answer(self, route: str, name: str, body, wait: float | None = None
               ) -> tuple[int, dict]:
        """A request of episode ``name``: ``(status, json)``. ``wait``: the longest it may
        take, from now (AnswerTimeout past it; its sample is not drawn, or dropped)."""
        deadline = None if wait is None else time.monotonic() + wait
        with self.cond:
            ep = self.episodes.get(name)
            if ep is None or ep.finished:
                label = ep.label if ep is not None else self.labels.get(name)
                self.late.append(
                    f"agent {self.spec.name} on row {label}: a request after its episode "
                    "ended" if label is not None else
                    f"agent {self.spec.name}: a request for episode {name!r}, which never was")
                return 409, error(f"episode {name!r} is not running (it ended, or never "
                                  "was)", 409)
        if not ep.lock.acquire(timeout=-1 if wait is None else max(wait, 0.0)):
            raise AnswerTimeout("no answer within the client's timeout")
        try:  # (an episode's requests one at a time, in the order they came)
            return self._answer(route, ep, body, deadline)
        finally:
            ep.lock.release()

    def _answer(self, route: str, ep: _Episode, body, deadline: float | None):
        try:
            plan, tools, choice = self._plan(route, ep, body)
        except RequestError as e:
            self._fail(ep, f"request {ep.requests + 1}: {e}")
            return 400, error(str(e), 400)
        ep.requests += 1
        spent = ep.capture.spent + len(plan.added)
        budget = min(ep.params.max_new_tokens, self.max_episode_tokens - spent)
        if self.max_length:
            budget = min(budget, self.max_length - len(plan.ids))
        if budget <= 0:
            why = (f"request {ep.requests}: the episode ran past max_episode_tokens "
                   f"{self.max_episode_tokens}" if spent >= self.max_episode_tokens else
                   f"request {ep.requests}: its prompt of {len(plan.ids)} tokens leaves "
                   f"no room under max_length {self.max_length}")
            self._fail(ep, why)
            return 400, error(why, 400)
        seed = None if ep.seed is None else stream_seed(ep.seed, "turn", ep.requests - 1)
        job = _Pending(ep, plan.ids, budget, seed, time.monotonic())
        with self.cond:
            if ep.finished:
                return 409, error(f"episode {ep.name!r} ended", 409)
            self.pending.append(job)
            self.cond.notify_all()
        left = self.spec.timeout - (time.monotonic() - (ep.started or time.monotonic()))
        bound = max(left, 0.0) + 5.0
        if deadline is not None and deadline - time.monotonic() < bound and \
                not job.done.wait(max(deadline - time.monotonic(), 0.0)):
            with self.cond:  # (nobody waits for its sample now: not drawn)
                if job in self.pending:
                    self.pending.remove(job)
            raise AnswerTimeout("no answer within the client's timeout")
        if not job.done.wait(bound) or job.result is None:
            return 504, error("the episode timed out, or the run stopped", 504)
        ids, logps, text, version, ended = job.result
        if route == "/v1/completions":
            reasoning, content, calls = None, text, []
        elif tools and choice != "none":
            reasoning, content, calls = parsers.parse(text, self.parser, tools)
        else:
            reasoning, content, calls = (*parsers.split_reasoning(text), [])
        answer = {"role": "assistant", "content": content or ""}
        if calls:
            answer["tool_calls"] = normalise([{"role": "assistant",
                                               "tool_calls": calls}])[0]["tool_calls"]
        ep.capture.record(plan, ids, logps, version, ended, answer, reasoning is not None)
        finish = "tool_calls" if calls else "length" if len(ids) >= budget and \
            not ended else "stop"
        ep.finish = finish
        return 200, self._response(route, ep, plan.ids, ids, reasoning, content, calls,
                                   finish, version)

    def _plan(self, route: str, ep: _Episode, body):
        """The capture's plan of a request, its tools and tool_choice; RequestError for one
        it refuses."""
        if isinstance(body, Exception):
            raise RequestError(str(body))
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        if body.get("model") not in (MODEL, None):
            raise RequestError(f"unknown model {body.get('model')!r} (this endpoint serves "
                               f"{MODEL!r})")
        try:
            check_sampling(ep.params, body)
        except RequestError:
            ep.refused += 1
            raise
        if route == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids = list(self.tok(prompt)["input_ids"])
            elif isinstance(prompt, list) and prompt and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in prompt):
                ids = prompt
            else:
                raise RequestError("prompt must be a string or a list of token ids")
            return ep.capture.plan_ids(ids), None, "none"
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise RequestError("tools must be a list of objects")
            try:
                for t in tools:
                    parsers.tool_name(t)
            except ValueError as e:
                raise RequestError(str(e)) from None
        return ep.capture.plan(normalise(body.get("messages")), tools or None), tools, \
            body.get("tool_choice", "auto")

    def _response(self, route, ep, prompt_ids, ids, reasoning, content, calls, finish,
                  version) -> dict:
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                 "total_tokens": len(prompt_ids) + len(ids)}
        common = {"id": f"posttrain-{ep.name}-{ep.requests}", "created": int(time.time()),
                  "model": MODEL, "usage": usage, "prompt_token_ids": prompt_ids,
                  "system_fingerprint": f"posttrain-v{version}"}
        if route == "/v1/completions":
            return {**common, "object": "text_completion", "choices": [
                {"index": 0, "text": content, "finish_reason": finish, "logprobs": None,
                 "token_ids": ids}]}
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {**common, "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "finish_reason": finish, "logprobs": None,
             "token_ids": ids}]}

    def _fail(self, ep: _Episode, why: str) -> None:
        with self.cond:
            if not ep.error:
                ep.error = why

    # --- episodes ---------------------------------------------------------------------
    def run(self, engine, rows: list[dict], n: int, seeds: list[int | None],
            params: SamplingParams, extras: frozenset[str] = frozenset(),
            before_batch=None) -> list[_Episode]:
        """``n`` episodes of each row, every agent to its end (or its timeout); the
        episodes in row order, samples of a row together. ``before_batch(k)``: called
        before every batch after the first (partial rollouts: the chance to take newer
        weights; each answer records the version that sampled it)."""
        self._runs += 1
        eps = [_Episode(f"{self._runs}-{i}-{j}", dict(row), row.get("_row", i + 1),
                        None if seeds[i] is None else sample_seed(seeds[i], j),
                        Capture(self.renderer_for), params)
               for i, row in enumerate(rows) for j in range(n)]
        with self.cond:
            self.episodes = {e.name: e for e in eps}
            self.labels = {**{k: v for k, v in self.labels.items()
                              if k.startswith(f"{self._runs - 1}-")},
                           **{e.name: e.label for e in eps}}
        pool = Workers(max(1, min(self.spec.concurrency, len(eps))), "posttrain-agent")
        for ep in eps:
            pool.submit(self._agent, ep)
        try:
            with engine.reusing_prefixes(managed=True):  # (what a request extends)
                self._serve(engine, eps, params, extras, before_batch)
        finally:
            with self.cond:
                for ep in eps:
                    ep.finished = True
                for job in self.pending:
                    job.done.set()
                self.pending = []
                self.episodes = {}
            pool.abandon()
        return eps

    def _agent(self, ep: _Episode) -> None:
        with self.cond:
            if ep.finished:  # (the run stopped before this one started)
                return
            ep.started = time.monotonic()
        fn, asynchronous = self.spec.fn, inspect.iscoroutinefunction(self.spec.fn)
        key = f"{self.key}.{ep.name}"
        try:
            row = {k: v for k, v in ep.row.items() if k != "_row"}
            if asynchronous:  # (a client of its own: an async client belongs to one loop)
                async def go():
                    async with client_for(self.url, key, self.spec.timeout, True,
                                          self.endpoint) as client:
                        return await fn(client, row)
                got = asyncio.run(go())
            else:
                got = fn(self._client().with_options(api_key=key), row)
        except Exception as e:
            self._fail(ep, f"raised {type(e).__name__}: {e}")
        else:
            try:
                ep.reward = _reward(got)
            except ValueError as e:
                self._fail(ep, str(e))
        finally:
            with self.cond:
                ep.finished = True
                self.cond.notify_all()

    def _serve(self, engine, eps, params, extras, before_batch=None) -> None:
        """Batches of the episodes' requests until every episode has ended."""
        batches = 0
        while True:
            with self.cond:
                while True:
                    now = time.monotonic()
                    for ep in eps:
                        if ep.started is not None and not ep.finished and \
                                now - ep.started > self.spec.timeout:
                            ep.error = ep.error or \
                                f"did not finish within {self.spec.timeout:g} s"
                            ep.finished = True
                    for job in self.pending:
                        if job.episode.finished:  # (timed out: its request unanswered)
                            job.done.set()
                    self.pending = [j for j in self.pending if not j.episode.finished]
                    if not self.pending and all(e.finished for e in eps):
                        return
                    running = sum(e.started is not None and not e.finished for e in eps)
                    if self.pending and (len(self.pending) >= running or
                                         now - self.pending[-1].born >= WINDOW_S or
                                         now - self.pending[0].born >= MAX_WAIT_S):
                        batch, self.pending = self.pending, []
                        break
                    self.cond.wait(WINDOW_S if self.pending else 0.25)
            try:
                if before_batch is not None and batches:
                    before_batch(batches)
                batches += 1
                self._sample(engine, batch, params, extras)
                # (the engine keeps what a running episode's next request may extend)
                engine.retain_prefixes([e.tail for e in eps if e.tail and not e.finished])
            finally:  # (a failure: the batch's requests answered 504, not left waiting)
                for job in batch:
                    job.done.set()

    def _sample(self, engine, batch: list[_Pending], params: SamplingParams, extras) -> None:
        eos = self.tok.eos_token_id
        for b in sorted({j.budget for j in batch}, reverse=True):
            part = [j for j in batch if j.budget == b]
            out = engine.generate([Request(tuple(j.ids), j.seed) for j in part], 1,
                                  SamplingParams(params.temperature, params.top_p,
                                                 params.top_k, b, params.stop), extras=extras)
            for k, job in enumerate(part):
                m = out.completion_mask[k].bool()
                ids = out.completion_ids[k][m].tolist()
                job.result = (ids, out.logprobs[k][m].tolist(), out.texts[k],
                              out.policy_version, bool(ids) and ids[-1] == eos)
                job.episode.tail = (*job.ids, *ids)
                job.done.set()


def _reward(got):
    """An agent's return checked: None, a finite number, or a dict of finite numbers."""
    if got is None:
        return None
    values = got.values() if isinstance(got, dict) else [got]
    for v in values:
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"returned {got!r:.80}; expected a finite number, a dict of "
                             "them, or None")
    return {str(k): float(v) for k, v in got.items()} if isinstance(got, dict) else float(got)
