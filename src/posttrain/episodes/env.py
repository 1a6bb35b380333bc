"""The environment protocol: what a user writes to train on episodes.

An environment is a class, named as ``path/to/file.py:Name`` or ``module:Name``
(``--env``), constructed once per sampled trajectory as ``Name(row, **env_kwargs)``:
``row`` is the data row as a dict (the G samples of a group get G episodes of the same
row). It has two methods:

- ``reset() -> str``: the first user message;
- ``step(text) -> (message, reward, done)``: given the assistant's turn as text (without
  its end-of-turn token), the next message (a string is a ``user`` turn, a ``{"role": ...,
  "content": ...}`` dict picks the role, e.g. ``tool``; None when there is none), this
  turn's reward (a finite number) and whether the episode is over.

A ``reset`` or ``step`` that raises, returns the wrong types or a non-finite reward, or runs
past the timeout is an :class:`EnvError` naming the class, the row and the turn. A call
past the timeout is left running on a daemon thread (:mod:`.calls`): it cannot keep the
process alive.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import json
import math
import numbers
import time
from dataclasses import dataclass, field

from posttrain.calls import Workers, timed
from posttrain.userfiles import load_object


class EnvError(ValueError):
    """An environment broke the protocol (one line: class, row, turn, what)."""


def parse_kwargs(text: str | None, what: str = "env_kwargs") -> dict:
    if not text:
        return {}
    try:
        out = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(out, dict):
        raise ValueError(f"{what}: expected a JSON object, got {type(out).__name__}")
    return out


@dataclass
class EnvSpec:
    """How to make a run's episodes: the class, its keyword arguments, the per-call
    timeout in seconds (0 = none)."""

    cls: type
    kwargs: dict = field(default_factory=dict)
    timeout: float = 0.0
    name: str = ""

    @classmethod
    def parse(cls, spec: str, kwargs: str | None = None, timeout: float = 0.0) -> EnvSpec:
        if spec == "builtin":
            from posttrain.builtin.episodes import LookupEnv

            env = LookupEnv
        else:
            env = load_object(spec, "env")
        if not isinstance(env, type):
            raise ValueError(f"env {spec!r} is a {type(env).__name__}, not a class")
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise ValueError(f"env {spec!r}: the class has no {method}() method")
        return cls(env, parse_kwargs(kwargs), timeout, env.__name__)


_WORKERS: tuple[int, Workers] | None = None

waiting = contextlib.nullcontext
"""What :func:`step_all` waits for its workers' replies under: a context-manager factory
that the process's owner may replace (an asynchronous producer process marks its waits,
so that the learner can take its cores: ``async_cores adaptive``)."""


def step_all(episodes: list[Episode], texts: list[str], workers: int
             ) -> list[tuple[dict | None, float, bool] | EnvError]:
    """Each episode's :meth:`Episode.step` on its text, on a pool of ``workers`` daemon
    threads at once (kept for the next turn); the results in order, an :class:`EnvError` in
    place of a step that failed. The timeout counts from the submission of the turn's calls;
    a call still running past it is abandoned with its pool (:mod:`.calls`)."""
    global _WORKERS
    if workers <= 1 or len(episodes) <= 1:
        out: list = []
        for ep, text in zip(episodes, texts, strict=True):
            try:
                out.append(ep.step(text))
            except EnvError as e:
                out.append(e)
        return out
    if _WORKERS is None or _WORKERS[0] != workers:
        if _WORKERS is not None:
            _WORKERS[1].abandon()
        _WORKERS = (workers, Workers(workers))
    pool = _WORKERS[1]
    futures = [pool.submit(ep.env.step, text) for ep, text in zip(episodes, texts,
                                                                   strict=True)]
    timeout = episodes[0].spec.timeout or None
    deadline = None if timeout is None else time.monotonic() + timeout
    with waiting():
        return [_result(ep, future, pool, timeout, deadline)
                for ep, future in zip(episodes, futures, strict=True)]


def _result(ep: Episode, future, pool, timeout: float | None, deadline: float | None):
    """One episode's step from its worker (:func:`step_all`): the checked result, or an
    :class:`EnvError`. Past the deadline the pool is abandoned."""
    global _WORKERS
    ep.turn += 1
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not concurrent.futures.wait([future], left).done:
        pool.abandon()
        if _WORKERS is not None and _WORKERS[1] is pool:
            _WORKERS = None
        got = TimeoutError(f"did not return within {timeout:g} s")
    else:
        try:
            got = future.result()
        except Exception as e:
            got = e
    if isinstance(got, Exception):
        return ep._error(f"step() raised {type(got).__name__}: {got}")
    try:
        return ep._checked(got)
    except EnvError as e:
        return e


class Episode:
    """One environment instance and the protocol checks around its calls."""

    def __init__(self, spec: EnvSpec, row: dict, row_number):
        self.spec, self.row = spec, row_number
        self.turn = 0
        try:
            self.env = timed(lambda: spec.cls(row, **spec.kwargs), spec.timeout)
        except Exception as e:
            raise self._error(f"could not be made: {type(e).__name__}: {e}") from e

    @classmethod
    def of(cls, spec: EnvSpec, row: dict, number: int) -> Episode:
        """An episode of the data ``row`` (its own deep copy, without the loader's ``_row``;
        named by ``_row``, else ``number``)."""
        data = copy.deepcopy({k: v for k, v in row.items() if k != "_row"})
        return cls(spec, data, row.get("_row", number))

    def _error(self, what: str) -> EnvError:
        return EnvError(f"env {self.spec.name} on row {self.row}, turn {self.turn}: {what}")

    def reset(self) -> str:
        try:
            first = timed(self.env.reset, self.spec.timeout)
        except Exception as e:
            raise self._error(f"reset() raised {type(e).__name__}: {e}") from e
        if not isinstance(first, str):
            raise self._error(f"reset() returned {type(first).__name__}, expected str")
        return first

    def step(self, text: str) -> tuple[dict | None, float, bool]:
        self.turn += 1
        try:
            out = timed(self.env.step, self.spec.timeout, text)
        except Exception as e:
            raise self._error(f"step() raised {type(e).__name__}: {e}") from e
        return self._checked(out)

    def _checked(self, out) -> tuple[dict | None, float, bool]:
        """A step's return, checked against the protocol."""
        if not isinstance(out, tuple) or len(out) != 3:
            raise self._error(f"step() returned {_kind(out)}, expected a tuple "
                              "(message, reward, done)")
        message, reward, done = out
        if isinstance(message, str):
            message = {"role": "user", "content": message}
        elif isinstance(message, dict):
            if not isinstance(message.get("role"), str) or not isinstance(
                    message.get("content"), str):
                raise self._error("step()'s message dict needs 'role' and 'content' strings, "
                                  f"got {message!r:.80}")
            message = {"role": message["role"], "content": message["content"]}
        elif message is not None:
            raise self._error(f"step()'s message is {type(message).__name__}, expected str, "
                              "dict or None")
        if not isinstance(reward, numbers.Real) or isinstance(reward, bool):
            raise self._error(f"step()'s reward is {type(reward).__name__}, expected a number")
        if not math.isfinite(float(reward)):
            raise self._error(f"step()'s reward is {reward}, not a finite number")
        if not isinstance(done, bool):
            raise self._error(f"step()'s done is {type(done).__name__}, expected bool")
        return message, float(reward), done


def _kind(x) -> str:
    return f"a tuple of {len(x)}" if isinstance(x, tuple) else type(x).__name__
