"""An agent's requests as trajectories, token for token.

posttrain applies the chat template, once, to each request's messages; the engine samples
from those ids; what it sampled is kept with its behaviour log-probs and policy version.
The next request of the episode usually repeats the conversation so far — the messages of
the last request, the assistant message the endpoint answered, then new messages (tool
results, the user's next turn). Then nothing is rendered again: the new prompt is the last
prompt, the sampled ids as they were drawn, and only the new messages rendered after them
(:meth:`~posttrain.episodes.render.Renderer.between`), so the turns **merge** into one
trajectory whose loss covers the sampled tokens only. The assistant message is recognised
as the endpoint's own by its content and tool calls (their names and arguments; ids and
``reasoning_content`` are not compared): its sampled tokens, reasoning included, are what
the model sees again — it is never re-tokenised.

Any other request **splits** the episode: the agent rewrote its history (dropped or
summarised turns, edited a message, changed the tools), or the chat template itself would
render the history otherwise (one that drops the ``<think>`` part of earlier turns once a
new user message follows, as Qwen3's does), so the request's messages are rendered afresh
as the prompt of a new trajectory. Each trajectory is trained on exactly its own sampled
tokens.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field

from posttrain.episodes.render import TemplateError


class RequestError(ValueError):
    """A request the endpoint refuses (400): malformed, or a message it cannot render."""


def _text(content) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or \
                    not isinstance(p.get("text"), str):
                raise RequestError("a message's content parts must be text parts "
                                   f"({json.dumps(p)[:60]})")
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError(f"a message's content is {type(content).__name__}, expected text")


def _calls(calls) -> list[dict]:
    """Tool calls as the chat templates take them: name and arguments (an object)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise RequestError("tool_calls must be a list")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"a tool call needs function.name ({json.dumps(c)[:60]})")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise RequestError(f"tool call {fn['name']}: arguments are not JSON") from None
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def normalise(messages) -> list[dict]:
    """A request's ``messages`` in the form the chat template renders and the capture
    compares: ``role``, ``content`` text, and ``tool_calls``, ``tool_call_id``, ``name``
    where given."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user",
                                                              "assistant", "tool"):
            raise RequestError(f"message {i}: needs a role (system, user, assistant, tool)")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": _text(m.get("content"))}
        if m.get("tool_calls"):
            msg["tool_calls"] = _calls(m["tool_calls"])
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def same_turn(sent: dict, ours: dict) -> bool:
    """Whether a message the agent sent back is the assistant turn the endpoint answered
    (content and calls; ids and reasoning aside)."""
    def calls(m):
        return [(c["function"]["name"], c["function"]["arguments"])
                for c in m.get("tool_calls", [])]

    return sent["role"] == "assistant" and sent["content"].strip() == \
        ours["content"].strip() and calls(sent) == calls(ours)


@dataclass
class Trajectory:
    """One trajectory of an episode: its prompt, then every id after it (sampled or
    rendered), which of them were sampled, their behaviour log-probs and versions."""

    prompt: list[int]
    tools: str
    convo: list[dict] = field(default_factory=list)
    """The conversation its ids hold: the last request's messages and the answer."""
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    ended: bool = True
    """The last turn ended with eos (the template's closing then follows it)."""
    requests: int = 0
    reasoning: bool = False
    """The last turn began with ``<think>…</think>`` (a template may drop it from history)."""


@dataclass
class Plan:
    """Where a request's prompt comes from: the ids, the trajectory it extends (None: a new
    one) and the rendered ids it adds to it."""

    ids: list[int]
    extends: Trajectory | None
    added: list[int]
    messages: list[dict]
    tools: str


class Capture:
    """One episode's trajectories. ``renderer(tools)`` gives the
    :class:`~posttrain.episodes.render.Renderer` of a request's tools."""

    def __init__(self, renderer):
        self.renderer = renderer
        self.trajectories: list[Trajectory] = []

    @property
    def current(self) -> Trajectory | None:
        return self.trajectories[-1] if self.trajectories else None

    @property
    def spent(self) -> int:
        """Ids after the prompts, every trajectory's (what ``max_episode_tokens`` bounds)."""
        return sum(len(t.tokens) for t in self.trajectories)

    def plan(self, messages: list[dict], tools: list | None) -> Plan:
        """The prompt of a request (:func:`normalise`'d ``messages``): the current
        trajectory extended when the request repeats its conversation, else a new one."""
        key = json.dumps(tools, sort_keys=True) if tools else ""
        render = self.renderer(tools)
        t = self.current
        if t is not None and t.tools == key and len(messages) > len(t.convo) \
                and messages[:len(t.convo) - 1] == t.convo[:-1] \
                and same_turn(messages[len(t.convo) - 1], t.convo[-1]):
            new = messages[len(t.convo):]
            if not t.reasoning or render.keeps_reasoning(new):
                try:
                    added = render.between(t.ended, new)
                except TemplateError:  # (earlier turns render otherwise now: split)
                    pass
                else:
                    return Plan(t.prompt + t.tokens + added, t, added, messages, key)
        try:
            return Plan(render.start(messages), None, [], messages, key)
        except Exception as e:  # (a template that cannot render these messages)
            raise RequestError(f"the chat template cannot render the messages: "
                               f"{type(e).__name__}: {e}") from None

    def plan_ids(self, ids: list[int]) -> Plan:
        """The plan of a completions request (its prompt as ids): the current trajectory
        extended when ``ids`` start with all of its ids, else a new one."""
        t = self.current
        if t is not None and not t.tools and len(ids) > len(t.prompt) + len(t.tokens) \
                and ids[:len(t.prompt) + len(t.tokens)] == t.prompt + t.tokens:
            added = list(ids[len(t.prompt) + len(t.tokens):])
            return Plan(list(ids), t, added, [], "")
        return Plan(list(ids), None, [], [], "")

    def record(self, plan: Plan, ids: list[int], logps: list[float], version: int,
               ended: bool, answer: dict, reasoning: bool = False) -> Trajectory:
        """A sampled answer to the request of ``plan``: ``answer`` is the assistant message
        the endpoint returned (normalised); ``reasoning``: it began with a ``<think>``
        part."""
        t = plan.extends
        if t is None:
            t = Trajectory(list(plan.ids), plan.tools)
            self.trajectories.append(t)
        t.tokens += plan.added + ids
        t.mask += [0] * len(plan.added) + [1] * len(ids)
        t.logps += [0.0] * len(plan.added) + logps
        t.versions += [version] * (len(plan.added) + len(ids))
        t.convo = [*plan.messages, answer]
        t.ended, t.reasoning = ended, reasoning
        t.requests += 1
        return t


def check_sampling(p, body: dict) -> None:
    """Sampling parameters are the run's (``p``, a ``SamplingParams``): a request may repeat
    them, not change them (RequestError naming what it changes)."""
    run = {"temperature": p.temperature, "top_p": p.top_p}
    bad = [k for k, v in run.items() if body.get(k) is not None and
           (not isinstance(body[k], numbers.Real) or not _equal(body[k], v))]
    bad += [k for k in ("n", "best_of") if body.get(k) not in (None, 1)]
    bad += [k for k in ("max_tokens", "max_completion_tokens")
            if body.get(k) is not None and (not isinstance(body[k], int)
                                            or body[k] < p.max_new_tokens)]
    bad += ["stream"] if body.get("stream") else []
    if bad:
        raise RequestError(
            f"{', '.join(bad)}: sampling is the run's (temperature {p.temperature:g}, "
            f"top_p {p.top_p:g}, at most {p.max_new_tokens} new tokens, n 1, no "
            "streaming); a request may leave them out")


def _equal(x, v: float) -> bool:
    """``x == v`` for a JSON number ``x`` (an integer too large for a float is not)."""
    try:
        return float(x) == v
    except OverflowError:
        return False
