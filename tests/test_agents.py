"""Agents as clients (``--agent``): the tool-call parsers on each family's format, the
capture's merge and split rules token for token, the endpoint against hostile agents, and
runs that train through it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import re
import threading
import urllib.error
import urllib.request

import pytest
import torch

from posttrain.agents import AgentError, AgentSpec, Hub, parsers, run_agents
from posttrain.episodes import Renderer
from posttrain.rollout import Rollout, RolloutEngine, SamplingParams
from test_episodes import TEMPLATE, merging_tokenizer

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
NEG = {"type": "function", "function": {"name": "neg", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}


def _calls(calls):
    return [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls]


# --- parsers ----------------------------------------------------------------------------
@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
               '<tool_call>\n{"name": "neg", "arguments": {"x": 1}}\n</tool_call>'),
    ("llama3_json", '{"name": "add", "parameters": {"a": 2, "b": 3}}; '
                    '{"name": "neg", "parameters": {"x": 1}}'),
    ("llama3_json", '<|python_tag|>{"name": "add", "arguments": {"a": 2, "b": 3}}; '
                    '{"name": "neg", "arguments": "{\\"x\\": 1}"}'),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}}, '
                '{"name": "neg", "arguments": {"x": 1}}]'),
    ("plain", "call: add(a=2, b=3)\ncall: neg(x=1)"),
])
def test_each_parser_reads_parallel_calls_in_its_format(parser, text):
    """Two calls in one turn (parallel tool calls), a leading ``<think>`` part as the
    reasoning, ids in order, arguments as JSON strings (the OpenAI format)."""
    reasoning, content, calls = parsers.parse(f"<think>plan it</think>\n{text}", parser,
                                              [ADD, NEG])
    assert reasoning == "plan it" and content is None
    assert _calls(calls) == [("call_0", "add", {"a": 2, "b": 3}),
                             ("call_1", "neg", {"x": 1})]


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", '<tool_call>\n{"name": add}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "add", "parameters": [1, 2]}'),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2}}, {"oops": 1}]'),
    ("plain", "call: add(2, 3)"),
    ("plain", "call: add(a=open('x'))"),
    ("ask", "? please"),
])
def test_a_call_that_cannot_be_read_is_answered_as_text(parser, text):
    """A malformed call is the model's mistake: the turn comes back as content, unparsed."""
    reasoning, content, calls = parsers.parse(text, parser, [ADD])
    assert (reasoning, content, calls) == (None, text, [])


def test_text_and_calls_together_and_the_ask_parser():
    _, content, calls = parsers.parse('Let me add.\n<tool_call>{"name": "add", "arguments": '
                                      '{"a": 1, "b": 1}}</tool_call>', "hermes", [ADD])
    assert content == "Let me add." and _calls(calls) == [("call_0", "add", {"a": 1, "b": 1})]
    assert _calls(parsers.parse("?", "ask", [ADD])[2]) == [("call_0", "add", {})]
    assert parsers.parse("?", "ask", [ADD, NEG])[2] == []  # (which one? none: text)
    assert parsers.split_reasoning("no think") == (None, "no think")


def test_the_parser_is_resolved_from_the_chat_template():
    tok = merging_tokenizer(None)
    assert parsers.resolve(tok) == "plain"
    for marker, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                         ("<|python_tag|>", "llama3_json")):
        tok.chat_template = TEMPLATE + "{% if tools %}" + marker + "{% endif %}"
        assert parsers.resolve(tok) == name
        assert parsers.resolve(tok, "plain") == "plain"  # (--tool_parser overrides)
    tok.chat_template = TEMPLATE + "{% if tools %}{{ tools | tojson }}{% endif %}"
    with pytest.raises(ValueError, match="--tool_parser"):
        parsers.resolve(tok)
    with pytest.raises(ValueError, match="tool_parser 'qwen'"):
        parsers.resolve(tok, "qwen")
    tok.chat_template = TEMPLATE
    assert parsers.resolve(tok) == "plain"  # (renders no tools: nothing to parse)


# --- a hub over a scripted engine ------------------------------------------------------
class Replies(RolloutEngine):
    """Answers each request with ``reply(prompt_ids, seed)`` (ids; eos where the reply
    ends), log-prob ``-0.25 - 0.01·position``; keeps every batch."""

    def __init__(self, tokenizer, reply, version: int = 3):
        self.tok, self.reply, self.version, self.batches = tokenizer, reply, version, []
        self.retained = []  # (after each batch: what it was told a request may extend)

    def retain_prefixes(self, sequences):
        self.retained.append(sorted(sequences))

    def generate(self, requests, n=1, params=None, generator=None, extras=frozenset()):
        self.batches.append(list(requests))
        outs = [list(self.reply(list(r.prompt_ids), r.seed))[:params.max_new_tokens]
                for r in requests]
        N, T = len(outs), max(1, *map(len, outs))
        ids = torch.full((N, T), self.tok.pad_token_id)
        mask = torch.zeros(N, T, dtype=torch.long)
        for k, o in enumerate(outs):
            ids[k, :len(o)], mask[k, :len(o)] = torch.tensor(o, dtype=torch.long), 1
        lp = (-0.25 - 0.01 * torch.arange(T).float()).expand(N, T) * mask
        return Rollout(prompt_ids=[list(r.prompt_ids) for r in requests], completion_ids=ids,
                       completion_mask=mask, logprobs=lp,
                       truncated=torch.tensor([o[-1:] != [self.tok.eos_token_id]
                                               for o in outs]),
                       group_ids=torch.arange(N),
                       texts=[self.tok.decode(o, skip_special_tokens=True) for o in outs],
                       policy_version=self.version)


PARAMS = SamplingParams(1.0, 1.0, 0, 24, ())
"""The sampling the tests' runs enforce: temperature 1, top-p 1, 24 new tokens a turn."""


def make_hub(tok, fn, parser="auto", timeout=30.0, max_episode_tokens=200,
             concurrency=8) -> Hub:
    return Hub(AgentSpec(fn, "test_agent", parser, timeout, concurrency), tok,
               max_episode_tokens)


def ids_of(tok, text: str) -> list[int]:
    """Token ids one character each (``a`` then ``b``: the sampled order the merging
    tokenizer would not produce), eos after."""
    return [tok.convert_tokens_to_ids(c) for c in text] + [tok.eos_token_id]


def post(client, body, route="chat/completions", key=None) -> tuple[int, dict]:
    """A raw HTTP request to the endpoint (the plain ``base_url``/``api_key`` any framework
    takes)."""
    req = urllib.request.Request(
        f"{str(client.base_url).rstrip('/')}/{route}",
        data=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {key if key is not None else client.api_key}"}
                    if key != "" else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def run(hub, engine, rows, n=1, seeds=None, on_error="raise", has_rewards=False):
    try:
        return run_agents(hub, engine, hub.tok, rows, n, seeds or [None] * len(rows),
                          PARAMS, on_error, has_rewards)
    finally:
        hub.close()


# --- capture ----------------------------------------------------------------------------
def test_turns_merge_token_for_token_where_the_tokenizer_would_merge():
    """The model samples ``a`` then ``b``; the tokenizer writes ``ab`` as one token. The
    agent sends the answer back with a tool result: the second prompt is the first, the
    sampled ids as drawn, then only the new message rendered — one trajectory, loss on the
    sampled ids, their log-probs and version kept."""
    pytest.importorskip("openai")
    tok = merging_tokenizer()
    a, b, ab = (tok.convert_tokens_to_ids(x) for x in ("a", "b", "ab"))
    seen = []

    def agent(client, row):
        messages = [{"role": "user", "content": "go"}]
        for _ in range(2):
            reply = client.chat.completions.create(model="posttrain-policy",
                                                   messages=messages)
            seen.append(reply.model_extra["prompt_token_ids"])
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "c"}]
        return 1.0

    turns = iter([ids_of(tok, "ab"), ids_of(tok, "c")])
    eps = run(make_hub(tok, agent), Replies(tok, lambda ids, s: next(turns)), [{"q": 1}])
    first, second = seen
    sampled = ids_of(tok, "ab")
    added = Renderer(tok).between(True, [{"role": "user", "content": "c"}])
    assert second == first + sampled + added
    assert ab not in second and [a, b] == second[len(first):len(first) + 2]
    fresh = Renderer(tok).start([{"role": "user", "content": "go"},
                                 {"role": "assistant", "content": "ab"},
                                 {"role": "user", "content": "c"}])
    assert ab in fresh  # (re-rendering would have trained other tokens)
    ro = eps.rollout
    assert ro.prompt_ids == [first] and float(ro.stats["trajectory_splits"][0]) == 0
    n = len(ro.completion_ids[0][ro.completion_mask[0].bool()])
    assert ro.completion_ids[0, :n].tolist() == sampled + added + ids_of(tok, "c")
    assert ro.loss_mask[0, :n].tolist() == [1] * 3 + [0] * len(added) + [1] * 2
    want = [-0.25, -0.26, -0.27] + [0.0] * len(added) + [-0.25, -0.26]
    assert torch.allclose(ro.logprobs[0, :n], torch.tensor(want))
    assert ro.policy_version == 3 and eps.returns.tolist() == [1.0]


REASONING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' and not loop.last and messages[loop.index0 + 1]['role'] "
    "== 'user' %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}"
    "{% endif %}{% if m['role'] == 'assistant' %}</s>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""Drops an earlier turn's reasoning once a user message follows it (as Qwen3's does)."""


@pytest.mark.parametrize(("template", "then", "splits"), [
    (TEMPLATE, "user", 0),  # keeps reasoning: the sampled <think> part is the history
    (REASONING_TEMPLATE, "tool", 0),  # keeps it before a tool result
    (REASONING_TEMPLATE, "user", 1),  # drops it before a user message: split
])
def test_a_template_that_drops_reasoning_from_history_splits(template, then, splits):
    """The turn ``<think>b</think>a``: the agent gets ``reasoning_content`` apart and sends
    ``a`` back. Where the template would show the model its earlier reasoning the sampled
    ids are reused; where it drops it, the request starts a new trajectory rendered as
    the template renders it, and each trajectory holds only its own sampled tokens."""
    tok = merging_tokenizer(template)
    replies = iter([ids_of(tok, "<think>b</think>a"), ids_of(tok, "c")])
    prompts = []

    def agent(client, row):
        messages = [{"role": "user", "content": "go"}]
        _, out = post(client, {"messages": messages})
        prompts.append(out["prompt_token_ids"])
        message = out["choices"][0]["message"]
        assert message["reasoning_content"] == "b" and message["content"] == "a"
        messages += [message, {"role": then, "content": "x"}]
        _, out = post(client, {"messages": messages})
        prompts.append(out["prompt_token_ids"])
        return 1.0

    hub = make_hub(tok, agent)
    eps = run(hub, Replies(tok, lambda ids, s: next(replies)), [{"q": 1}])
    ro = eps.rollout
    assert float(ro.stats["trajectory_splits"].sum()) == splits
    renderer = Renderer(tok)
    if splits:
        convo = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "a"},
                 {"role": then, "content": "x"}]
        assert prompts[1] == renderer.start(convo)  # (as the template renders it)
        assert ro.prompt_ids == prompts  # two trajectories, each its own sampled tokens
        assert [ro.completion_ids[k][ro.loss_mask[k].bool()].tolist() for k in (0, 1)] == \
            [ids_of(tok, "<think>b</think>a"), ids_of(tok, "c")]
        assert ro.sample_ids.tolist() == [0, 0] and ro.group_ids.tolist() == [0, 0]
        assert eps.returns.tolist() == [1.0, 1.0]
    else:
        sampled = ids_of(tok, "<think>b</think>a")
        assert prompts[1][:len(prompts[0]) + len(sampled)] == prompts[0] + sampled


def test_an_agent_that_edits_its_history_splits_the_episode():
    tok = merging_tokenizer()
    replies = iter([ids_of(tok, "ab"), ids_of(tok, "c"), ids_of(tok, "d")])

    def agent(client, row):
        m = [{"role": "user", "content": "go"}]
        post(client, {"messages": m})  # answered "ab"
        edited = [*m, {"role": "assistant", "content": "summary"},
                  {"role": "user", "content": "x"}]
        post(client, {"messages": edited})  # split: not the answer it was given
        post(client, {"messages": [*edited, {"role": "assistant", "content": "c"},
                                   {"role": "user", "content": "y"}]})  # merges
        return 0.5

    engine = Replies(tok, lambda ids, s: next(replies))
    eps = run(make_hub(tok, agent), engine, [{"q": 1}])
    ro = eps.rollout
    # after each batch the engine may drop what the edit left behind: only the episode's
    # last answer is kept (after the last, the episode may have ended: nothing)
    first, second = (b[0].prompt_ids for b in engine.batches[:2])
    assert engine.retained[:2] == [[(*first, *ids_of(tok, "ab"))],
                                   [(*second, *ids_of(tok, "c"))]]
    assert len(engine.retained) == 3
    assert ro.stats["trajectory_splits"].tolist() == [0, 1]  # (on the episode's last row)
    assert ro.stats["requests"].tolist() == [0, 3]
    assert [ro.completion_ids[k][ro.loss_mask[k].bool()].tolist() for k in (0, 1)] == \
        [ids_of(tok, "ab"), ids_of(tok, "c") + ids_of(tok, "d")]
    assert eps.returns.tolist() == [0.5, 0.5] and ro.sample_ids.tolist() == [0, 0]


def test_completions_requests_extend_by_ids():
    """``/v1/completions`` with token ids: a prompt that starts with the last prompt and
    its sampled ids extends the trajectory; the response carries the sampled ids."""
    tok = merging_tokenizer()
    replies = iter([ids_of(tok, "ab"), ids_of(tok, "c")])

    def agent(client, row):
        code, out = post(client, {"prompt": [5, 6]}, "completions")
        got = out["choices"][0]["token_ids"]
        assert code == 200 and got == ids_of(tok, "ab") and out["choices"][0]["text"] == "ab"
        code, out = post(client, {"prompt": [5, 6, *got, 7]}, "completions")
        return 1.0

    eps = run(make_hub(tok, agent), Replies(tok, lambda ids, s: next(replies)), [{"q": 1}])
    ro = eps.rollout
    assert ro.prompt_ids == [[5, 6]] and float(ro.stats["trajectory_splits"][0]) == 0
    assert ro.completion_ids[0].tolist() == [*ids_of(tok, "ab"), 7, *ids_of(tok, "c")]
    assert ro.loss_mask[0].tolist() == [1, 1, 1, 0, 1, 1]


# --- the endpoint against hostile agents --------------------------------------------------
def _hostile(kind):
    def agent(client, row):
        m = [{"role": "user", "content": "go"}]
        if kind == "raises":
            raise KeyError("boom")
        if kind == "model":
            code, out = post(client, {"model": "gpt-4o", "messages": m})
        elif kind == "json":
            code, out = post(client, b"{not json")
        elif kind == "sampling":
            code, out = post(client, {"messages": m, "temperature": 0.2})
        elif kind == "budget":
            for _ in range(10):
                code, out = post(client, {"messages": m})
                m += [out["choices"][0]["message"], {"role": "user", "content": "more"}] \
                    if code == 200 else []
        elif kind == "tools":
            code, out = post(client, {"messages": m, "tools": [{"type": "function"}]})
        elif kind == "reward":
            post(client, {"messages": m})
            return "1.0"
        elif kind == "silent":
            return 1.0
        return 1.0

    return agent


@pytest.mark.parametrize(("kind", "match"), [
    ("raises", r"raised KeyError: 'boom'"),
    ("model", r"request 1: unknown model 'gpt-4o'"),
    ("json", r"request 1: the body is not JSON"),
    ("sampling", r"request 1: temperature: sampling is the run's"),
    ("budget", r"request \d+: the episode ran past max_episode_tokens 12"),
    ("tools", r"request 1: a tool needs function.name"),
    ("reward", r"returned '1.0'; expected a finite number"),
    ("silent", r"made no request"),
])
def test_a_hostile_agent_fails_its_episode_in_one_line(kind, match):
    tok = merging_tokenizer()
    hub = make_hub(tok, _hostile(kind), max_episode_tokens=12)
    engine = Replies(tok, lambda ids, s: ids_of(tok, "abcd"))
    with pytest.raises(AgentError, match=rf"^agent test_agent on row 1: {match}"):
        run(hub, engine, [{"q": 1}])
    hub = make_hub(tok, _hostile(kind), max_episode_tokens=12)
    eps = run(hub, engine, [{"q": 1}, {"q": 2}], on_error="skip")
    assert eps.valid.tolist() == [False, False] and len(eps.errors) == 2
    if kind == "sampling":
        assert eps.rollout.stats["refused_requests"].tolist() == [1.0, 1.0]


def test_the_endpoint_refuses_requests_without_the_runs_key_and_late_calls():
    tok = merging_tokenizer()
    kept = {}

    def agent(client, row):
        assert post(client, {"messages": [{"role": "user", "content": "go"}]}, key="")[0] \
            == 401
        assert post(client, {"messages": [{"role": "user", "content": "go"}]},
                    key="wrong." + client.api_key.split(".", 1)[1])[0] == 401
        post(client, {"messages": [{"role": "user", "content": "go"}]})
        kept["client"] = client
        return 1.0

    hub = make_hub(tok, agent)
    try:
        run_agents(hub, Replies(tok, lambda ids, s: ids_of(tok, "a")), tok, [{"q": 1}], 1,
                   [None], PARAMS)
        code, out = post(kept["client"], {"messages": [{"role": "user", "content": "go"}]})
        assert code == 409 and "not running" in out["error"]["message"]
        with pytest.raises(AgentError, match=r"^agent test_agent on row 1: a request after "
                                             "its episode ended$"):  # (the next batch says)
            run_agents(hub, Replies(tok, lambda ids, s: ids_of(tok, "a")), tok, [{"q": 1}],
                       1, [None], PARAMS)
        with urllib.request.urlopen(urllib.request.Request(
                f"{hub.url}/models", headers={"Authorization": f"Bearer {hub.key}.x"}),
                timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == "posttrain-policy"
    finally:
        hub.close()


def test_an_agent_past_its_timeout_is_abandoned_not_waited_for():
    """An agent that never returns: its episode fails at ``agent_timeout`` and the run goes
    on (the thread is abandoned); nothing waits for it."""
    tok = merging_tokenizer()
    release = threading.Event()

    def agent(client, row):
        post(client, {"messages": [{"role": "user", "content": "go"}]})
        release.wait(600)  # (never set while the run waits)
        return 1.0

    hub = make_hub(tok, agent, timeout=1.0)
    try:
        with pytest.raises(AgentError, match=r"on row 1: did not finish within 1 s"):
            run(hub, Replies(tok, lambda ids, s: ids_of(tok, "a")), [{"q": 1}])
    finally:
        release.set()


def test_many_episodes_are_answered_in_batches_with_the_episode_loops_seeds(monkeypatch):
    """4 episodes in flight: with the arrival window out of the way a batch is sampled once
    every running episode waits, so each turn is one batch of all 4 (no clock decides it);
    request ``r`` of sample ``j`` of a row is seeded as the episode loop seeds turn ``r``;
    an async agent works the same way."""
    from posttrain.agents import runner
    from posttrain.rollout.types import sample_seed, stream_seed

    monkeypatch.setattr(runner, "WINDOW_S", 600.0)
    monkeypatch.setattr(runner, "MAX_WAIT_S", 600.0)

    tok = merging_tokenizer()
    barrier = threading.Barrier(4, timeout=60)

    async def agent(client, row):
        barrier.wait()
        m = [{"role": "user", "content": "go"}]
        for _ in range(2):
            out = await client.chat.completions.create(model="posttrain-policy", messages=m)
            m += [out.choices[0].message.model_dump(exclude_none=True),
                  {"role": "user", "content": "more"}]
        return 1.0

    pytest.importorskip("openai")
    engine = Replies(tok, lambda ids, s: ids_of(tok, "a"))
    eps = run(make_hub(tok, agent, concurrency=4), engine, [{"q": 1}, {"q": 2}], n=2,
              seeds=[11, 12])
    assert eps.valid.all() and eps.rollout.stats["requests"].tolist() == [2.0] * 4
    assert [len(b) for b in engine.batches] == [4, 4]
    seeds = sorted(r.seed for b in engine.batches for r in b)
    assert seeds == sorted(stream_seed(sample_seed(s, j), "turn", r)
                           for s in (11, 12) for j in range(2) for r in range(2))



def test_the_runs_clients_are_answered_in_process():
    """The clients posttrain hands to agents (sync and async) never open a socket: the
    endpoint answers them in process."""
    pytest.importorskip("openai")

    def agent(client, row):
        out = client.chat.completions.create(model="posttrain-policy",
                                             messages=[{"role": "user", "content": "go"}])
        return float(out.choices[0].message.content == "a")

    async def async_agent(client, row):
        out = await client.chat.completions.create(
            model="posttrain-policy", messages=[{"role": "user", "content": "go"}])
        return float(out.choices[0].message.content == "a")

    tok = merging_tokenizer()
    connections = []

    def counted(serve):
        return lambda *a: connections.append(a) or serve(*a)

    for fn in (agent, async_agent):
        hub = make_hub(tok, fn, concurrency=2)
        hub.endpoint.server.process_request = counted(hub.endpoint.server.process_request)
        eps = run(hub, Replies(tok, lambda ids, s: ids_of(tok, "a")),
                  [{"q": i} for i in range(4)])
        assert eps.valid.all() and eps.returns.tolist() == [1.0] * 4
    assert connections == []


def _live(hub, name="e1"):
    """An episode ``name`` of ``hub`` running (no agent behind it: the test sends its
    requests; not started, so a request's wait is the whole --agent_timeout)."""
    from posttrain.agents.capture import Capture
    from posttrain.agents.runner import _Episode

    ep = _Episode(name, {"q": 1}, 1, None, Capture(hub.renderer_for), PARAMS)
    hub.episodes = {name: ep}
    return ep


def _httpx():
    import openai

    return importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__
                                   .split(".")[0])


def test_in_process_and_http_answer_the_same_requests_alike(monkeypatch):
    """The same requests, in process and over HTTP, during a live episode: no key, a wrong
    key, a body that is not JSON, one over the size limit, an unknown route, the model
    list, a failure of the endpoint's own (a 500 naming it, not an exception in the
    agent)."""
    pytest.importorskip("openai")
    from posttrain.agents import endpoint as ep_module

    monkeypatch.setattr(ep_module, "MAX_BODY", 200_000)
    tok = merging_tokenizer()
    hub = make_hub(tok, None)
    try:
        httpx = _httpx()
        transport = hub.endpoint.transport(httpx)
        key = hub.key + ".e1"
        cases = [("chat/completions", b'{"model": "posttrain-policy"', key, 400),
                 ("chat/completions", b"{}", "", 401),
                 ("chat/completions", b"{}", "wrong.e1", 401),
                 ("chat/completions", b'{"messages": "' + b"x" * 200_100 + b'"}', key, 413),
                 ("nowhere", b"{}", key, 404), ("models", None, key, 200),
                 ("chat/completions", b'{"temperature": 1' + b"0" * 400 + b"}", key, 400),
                 ("chat/completions", b'{"top_p": 1' + b"0" * 5000 + b"}", key, 400),
                 ("chat/completions", b"[" * 100_000, key, 400),
                 ("chat/completions", b"{}", key, 500)]
        for route, body, auth, status in cases:
            if status == 500:
                monkeypatch.setattr(hub, "answer", lambda *a: {}["boom"])
            answers = []
            for way in ("in process", "http"):
                _live(hub)
                headers = {"Authorization": f"Bearer {auth}"} if auth else {}
                if way == "in process":
                    got = transport.handle_request(httpx.Request(
                        "GET" if body is None else "POST", f"{hub.url}/{route}",
                        content=body, headers=headers))
                    answers.append((got.status_code, json.loads(got.read())))
                    continue
                req = urllib.request.Request(f"{hub.url}/{route}", data=body, headers=headers)
                try:
                    with urllib.request.urlopen(req, timeout=30) as r:
                        answers.append((r.status, json.loads(r.read())))
                except urllib.error.HTTPError as e:
                    answers.append((e.code, json.loads(e.read())))
            assert answers[0] == answers[1] and answers[0][0] == status, (route, status)
        assert "KeyError" in answers[0][1]["error"]["message"]
    finally:
        hub.close()


def test_in_process_clients_keep_their_timeout_and_reach_other_addresses():
    """A request the engine does not answer within the client's read timeout raises the
    SDK's timeout error, as over HTTP (not the episode's own bound); the same client sent
    to another address goes there over the network."""
    import http.server

    openai = pytest.importorskip("openai")
    from posttrain.agents.endpoint import client_for

    class Elsewhere(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = json.dumps({"object": "list", "data": [
                {"id": "elsewhere", "object": "model", "owned_by": "x", "created": 0}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

        def log_message(self, *a):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    tok = merging_tokenizer()
    hub = make_hub(tok, None, timeout=60.0)
    try:
        _live(hub)
        client = client_for(hub.url, hub.key + ".e1", 60.0, endpoint=hub.endpoint)
        go = [{"role": "user", "content": "go"}]
        def waits_on():
            with contextlib.suppress(openai.APIError):
                client.with_options(timeout=None).chat.completions.create(
                    model="posttrain-policy", messages=go)

        first = threading.Thread(target=waits_on, daemon=True)
        first.start()  # (its request waits for a sample that never comes, holding the
        # episode: a second request's timeout counts from its start, not from its turn)
        while not hub.pending and first.is_alive():
            first.join(0.01)
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=0.3).chat.completions.create(
                model="posttrain-policy", messages=go)
        assert first.is_alive() and len(hub.pending) == 1  # (the second never queued)

        async def asynchronous():
            async with client_for(hub.url, hub.key + ".e2", 60.0, True, hub.endpoint) as c:
                await c.with_options(timeout=0.3).chat.completions.create(
                    model="posttrain-policy", messages=go)

        _live(hub, "e2")
        with pytest.raises(openai.APITimeoutError):
            asyncio.run(asynchronous())
        assert [j.episode.name for j in hub.pending] == ["e1"]  # (e2's job withdrawn)
        away = client.with_options(base_url=f"http://127.0.0.1:{other.server_address[1]}/v1")
        assert [m.id for m in away.models.list().data] == ["elsewhere"]
        assert [m.id for m in client.models.list().data] == ["posttrain-policy"]
    finally:
        hub.close()
        other.shutdown()
        other.server_close()


def test_an_engine_that_fails_leaves_no_request_waiting():
    """The engine raises while sampling a batch: the run stops with the error, and the
    batch's requests are answered at once (504), not left waiting out the episode's time —
    an async agent's request waits on a thread of its own, which would hold the process
    open at exit. Likewise when the hook before a later batch fails."""
    pytest.importorskip("openai")

    class Broken(Replies):
        def generate(self, *a, **k):
            raise RuntimeError("the engine broke")

    async def agent(client, row):
        await client.chat.completions.create(model="posttrain-policy",
                                             messages=[{"role": "user", "content": "go"}])
        return 1.0

    tok = merging_tokenizer()
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="the engine broke"):
        run(make_hub(tok, agent, timeout=120.0), Broken(tok, None), [{"q": 1}, {"q": 2}])
    hub = make_hub(tok, agent, timeout=120.0)

    def later(k):
        raise RuntimeError("newer weights failed to load")

    async def twice(client, row):
        for _ in range(2):
            await client.chat.completions.create(
                model="posttrain-policy", messages=[{"role": "user", "content": "go"}])
        return 1.0

    hub.spec.fn = twice

    with pytest.raises(RuntimeError, match="newer weights"):  # (partial rollouts' hook)
        run_agents(hub, Replies(tok, lambda ids, s: ids_of(tok, "a")), tok, [{"q": 1}], 2,
                   [None], PARAMS, "raise", False, before_batch=later)
    hub.close()
    waiting = [t for t in threading.enumerate()
               if t.name == "posttrain-agent-answer" and t not in before]
    for t in waiting:
        t.join(20)
    assert not [t for t in waiting if t.is_alive()]


# --- runs ---------------------------------------------------------------------------------
def _grpo(tmp_path, name, **kw):
    import json as _json

    from posttrain.config import RLConfig
    from posttrain.trainers.online import run_rl

    kw = {"max_steps": 2, **kw}
    cfg = RLConfig(output_dir=str(tmp_path / name), prompts_per_step=4, group_size=4,
                   builtin_train_size=16, builtin_eval_size=8, eval_every=2, log_every=1,
                   device="cpu", tensorboard=False, **kw)
    cfg.validate()
    run_rl(cfg)
    return [_json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text()
            .splitlines()]


def test_the_builtin_agent_trains_as_the_builtin_environment(tmp_path):
    """``--agent builtin`` is ``--env builtin`` written as an ``openai``-SDK agent: the same
    seeds draw the same episodes, so rewards and held-out accuracy are the same numbers."""
    pytest.importorskip("openai")
    env = _grpo(tmp_path, "env", env="builtin")
    agent = _grpo(tmp_path, "agent", agent="builtin")
    for key in ("reward/mean", "eval/accuracy"):
        got = [r[key] for r in agent if key in r]
        assert got and got == [r[key] for r in env if key in r], key
    steps = [r for r in agent if "agent/requests" in r]
    assert len(steps) == 2 and all(r["agent/trajectory_splits"] == 0 for r in steps)
    assert all(16 <= r["agent/requests"] <= 32 for r in steps)  # (16 episodes, 1-2 each)


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_trainer_log_probs_at_captured_tokens_equal_the_behaviour_ones(backend, tmp_path,
                                                                      monkeypatch):
    """Through the endpoint, the trainer's log-probs of each captured sequence at its
    sampled tokens equal the engine's behaviour log-probs to float32 rounding; a request
    that extends an earlier answer runs only what it adds, on the keys and values the
    engine kept of that answer (as an environment's next turn does)."""
    pytest.importorskip("openai")
    import posttrain.rollout.engine as engine_mod
    from posttrain.agents import runner
    from posttrain.config import RLConfig
    from posttrain.trainers.online import RLTrainer
    from rl_steps import check_trainer_reads_behaviour

    calls, real = [], engine_mod._prefill

    def spy(model, prompt_ids, n, pad_id, device, past=None):
        calls.append((len(prompt_ids), sum(kv is not None for kv in past or [])))
        return real(model, prompt_ids, n, pad_id, device, past)

    monkeypatch.setattr(engine_mod, "_prefill", spy)
    # batches as requests come: samples that drew the same answer extend it in different
    # batches (the first to extend it must not take it from the others)
    monkeypatch.setattr(runner, "WINDOW_S", 0.0)
    cfg = RLConfig(output_dir=str(tmp_path), agent="builtin", max_steps=1, prompts_per_step=4,
                   group_size=4, rollout_backend=backend, builtin_train_size=16,
                   builtin_eval_size=0, device="cpu", tensorboard=False, kl_coef=0.0,
                   temperature=1.0)
    cfg.validate()
    trainer = RLTrainer(cfg)
    try:
        ro = trainer.experience.collect(1).rollout
    finally:
        trainer.close()
    assert ro.stats["requests"].max() == 2  # the model asks, then answers
    # (requests are batched by arrival: every first request ran whole, every second reused)
    seconds = int((ro.stats["requests"] == 2).sum())
    assert seconds and sum(n for n, _ in calls) == 16 + seconds
    assert sum(held for _, held in calls) == seconds
    check_trainer_reads_behaviour(trainer, ro, share=True)


def test_agent_config_errors(tmp_path):
    from posttrain.config import ConfigError, RLConfig

    for kw, match in [({"agent": "builtin", "env": "builtin"}, "choose one"),
                      ({"agent": "x.py:fn"}, "--agent x.py:fn needs --data"),
                      ({"agent": "builtin", "env_kwargs": '{"a": 1}'},
                       "unknown key 'env_kwargs' for --agent"),
                      ({"agent": "builtin", "agent_timeout": 0}, "agent_timeout > 0"),
                      ({"agent": "builtin", "tool_parser": "qwen"}, "tool_parser must be"),
                      ({"agent_concurrency": 4}, "unknown key 'agent_concurrency'")]:
        cfg = RLConfig(output_dir=str(tmp_path), **kw)
        cfg.given = set(kw)
        with pytest.raises(ConfigError, match=match):
            cfg.validate()
    cfg = RLConfig(output_dir=str(tmp_path), agent="builtin")
    cfg.validate()
    assert cfg.model == "builtin-episodes"


def test_eval_agent_builtin_scores_as_eval_env_builtin(capsys):
    """``posttrain eval --agent builtin`` prints what ``eval --env builtin`` prints: the same
    greedy episodes, played through the endpoint."""
    pytest.importorskip("openai")
    from posttrain.cli import main

    common = ["--model", "builtin", "--n", "16", "--max_new_tokens", "6", "--device", "cpu"]
    assert main(["eval", "--env", "builtin", *common]) == 0
    env = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["eval", "--agent", "builtin", *common]) == 0
    agent = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert agent == env and env["n"] == 16


def test_the_documented_example_trains(tiny_model_dir, tmp_path):
    """docs/agents.md's example agent, as the page prints it, trains and evaluates with the
    page's commands' keys (on the tiny model, two steps)."""
    pytest.importorskip("openai")
    from pathlib import Path

    from posttrain.cli import main

    page = (Path(__file__).parent.parent / "docs" / "agents.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    rows = re.search(r"```json\n(.*?)```", page, re.S).group(1)
    (tmp_path / "guess_agent.py").write_text(code)
    (tmp_path / "targets.jsonl").write_text(rows)
    common = ["--agent", f"{tmp_path}/guess_agent.py:guess", "--data",
              str(tmp_path / "targets.jsonl"), "--max_new_tokens", "16"]
    assert main(["grpo", *common, "--model", tiny_model_dir, "--output_dir",
                 str(tmp_path / "run"), "--max_steps", "2", "--prompts_per_step", "2",
                 "--group_size", "2", "--device", "cpu", "--tensorboard", "false",
                 "--eval_every", "0"]) == 0
    assert main(["eval", *common, "--model", str(tmp_path / "run" / "final"),
                 "--device", "cpu"]) == 0
    # its tool path, on a model that calls the tool (plain layout: ``call: guess(n=…)``)
    import importlib.util

    spec = importlib.util.spec_from_file_location("guess_agent", tmp_path / "guess_agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tok = merging_tokenizer(None)
    replies = iter([ids_of(tok, "call: guess(n=50)"), ids_of(tok, "call: guess(n=37)")])
    eps = run(make_hub(tok, module.guess), Replies(tok, lambda ids, s: next(replies)),
              [{"target": 37}])
    assert eps.returns.tolist() == [1.0] and eps.rollout.stats["requests"].tolist() == [2.0]
    assert eps.rollout.stats["trajectory_splits"].tolist() == [0.0]  # (the turns merged)
    assert "tool: lower" in tok.decode(eps.rollout.completion_ids[0])


SUMMARISER = '''
def summarise(client, row):
    """Asks, then starts over with a summary of its first answer (a rewritten history):
    every episode is two trajectories."""
    m = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="posttrain-policy", messages=m)
    text = first.choices[0].message.content or ""
    m = [{"role": "user", "content": row["prompt"] + " (earlier: " + text[:3] + ")"}]
    second = client.chat.completions.create(model="posttrain-policy", messages=m)
    return float(len(second.choices[0].message.content or "") % 3 == 0)
'''


@pytest.mark.parametrize("algo", ["grpo", "rloo", "dapo"])
def test_split_episodes_train_every_trajectory_as_one_sample(tiny_model_dir, tmp_path, algo,
                                                             monkeypatch):
    """An agent that rewrites its history: each episode is two rows with one sample id and
    reward; the group statistics count the episode once, so its two rows get the same
    advantage, the advantage its episode gets alone; dynamic sampling keeps whole groups."""
    pytest.importorskip("openai")
    from posttrain.config import RLConfig
    from posttrain.core.algorithms import compute_advantages
    from posttrain.trainers.online import RLTrainer

    (tmp_path / "agent.py").write_text(SUMMARISER)
    (tmp_path / "rows.jsonl").write_text("".join(
        json.dumps({"prompt": p}) + "\n" for p in ("ab", "cd", "ef", "gh")))
    cfg = RLConfig(output_dir=str(tmp_path / "run"), agent=f"{tmp_path}/agent.py:summarise",
                   data=str(tmp_path / "rows.jsonl"), model=tiny_model_dir, algo=algo,
                   max_steps=2, prompts_per_step=4, group_size=4, max_new_tokens=4,
                   device="cpu", tensorboard=False, eval_every=0, log_every=1)
    cfg.validate()
    trainer = RLTrainer(cfg)
    try:
        exp = trainer.experience.collect(1)
        ro = exp.rollout
        episodes = int(ro.sample_ids.unique().numel())
        assert len(ro.prompt_ids) == 2 * episodes and ro.stats["trajectory_splits"].sum() \
            == episodes
        first = torch.tensor([i for i in range(len(ro.prompt_ids))
                              if i == 0 or ro.sample_ids[i] != ro.sample_ids[i - 1]])
        mask = ro.trained_mask.float()
        adv, _ = compute_advantages(trainer.algo, exp.scores, ro.group_ids, mask,
                                    sample_ids=ro.sample_ids)
        alone, _ = compute_advantages(trainer.algo, exp.scores[first], ro.group_ids[first],
                                      mask[first])
        seq = adv.sum(-1) / mask.sum(-1).clamp_min(1)
        lone = alone.sum(-1) / mask[first].sum(-1).clamp_min(1)
        index = torch.unique(ro.sample_ids, return_inverse=True)[1]
        torch.testing.assert_close(seq, lone[index], rtol=0, atol=0)
        from posttrain.trainers.online import trainer as module

        passed = []

        def spy(*args):  # (the trainer hands the sample ids to the advantages)
            passed.append(args[7])
            return compute_advantages(*args)

        monkeypatch.setattr(module, "compute_advantages", spy)
        trainer.train()
        assert passed and all(p is not None and len(p.unique()) * 2 == len(p) for p in passed)
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines() if "agent/requests" in x]
    assert rows and all(r["agent/trajectory_splits"] * 2 == r["agent/requests"] for r in rows)


@pytest.mark.parametrize("partial", [False, True])
def test_agents_run_asynchronously(tmp_path, partial):
    """``--async_staleness 1``: the producer thread's episodes play through the endpoint
    while the learner trains; with partial rollouts a batch after the first may sample
    under newer weights, every answer's tokens carrying the version that sampled them."""
    pytest.importorskip("openai")
    rows = _grpo(tmp_path, "async", agent="builtin", async_staleness=1,
                 async_producer="thread", partial_rollouts=partial, max_steps=3)
    steps = [r for r in rows if "agent/requests" in r]
    assert len(steps) == 3 and all(0 <= r["async/staleness"] <= 1 for r in steps)
    assert all(16 <= r["agent/requests"] <= 32 for r in steps)  # (16 episodes, 1-2 each)


OPENAI_AGENTS = '''
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
from agents import set_tracing_disabled

set_tracing_disabled(True)  # (offline: no traces sent anywhere)


async def lookup(client, row):
    """The built-in task as an openai-agents Agent with a function tool."""
    @function_tool
    def operand() -> str:
        """The hidden operand of the sum."""
        return str(row["b"])

    agent = Agent(name="adder", tools=[operand], model=OpenAIChatCompletionsModel(
        model="posttrain-policy", openai_client=client))
    result = await Runner.run(agent, f"{row['a']}+?", max_turns=3)
    return 1.0 if str(result.final_output).strip() == str(row["answer"]) else 0.0
'''


def test_an_openai_agents_agent_plays_the_episodes_the_sdk_agent_plays(tmp_path):
    """An ``openai-agents`` Agent (its Runner, a function tool, the Chat Completions model on
    the endpoint's AsyncOpenAI client) sends what the built-in ``openai``-SDK agent sends:
    the same prompts token for token, so the same episodes are drawn and scored, and its
    turns merge (no splits)."""
    pytest.importorskip("agents")
    from posttrain.builtin.episodes import rows
    from posttrain.config import RLConfig
    from posttrain.trainers.online import RLTrainer

    (tmp_path / "oa.py").write_text(OPENAI_AGENTS)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(16, "train")))
    got = {}
    for name, agent in (("sdk", "posttrain.builtin.agent:lookup_agent"),
                        ("openai-agents", f"{tmp_path}/oa.py:lookup")):
        cfg = RLConfig(output_dir=str(tmp_path / name), agent=agent, data=str(data),
                       model="builtin-episodes", tool_parser="ask", max_steps=1,
                       prompts_per_step=8, group_size=4, device="cpu", tensorboard=False)
        cfg.validate()
        trainer = RLTrainer(cfg)
        try:
            exp = trainer.experience.collect(1)
        finally:
            trainer.close()
        ro = exp.rollout
        got[name] = (exp.scores.tolist(), ro.prompt_ids, ro.completion_ids.tolist(),
                     ro.loss_mask.tolist())
        assert ro.stats["trajectory_splits"].sum() == 0 and ro.stats["requests"].sum() > 32
    assert got["sdk"] == got["openai-agents"]


def test_a_hostile_agent_stops_the_run_in_one_line_with_exit_2(tiny_model_dir, tmp_path,
                                                               capsys):
    """From the command line: one line naming the agent, the file's row and the request;
    exit 2. With ``--on_reward_error skip`` the episodes are dropped and the run goes on."""
    pytest.importorskip("openai")
    from posttrain.cli import main

    (tmp_path / "bad.py").write_text(
        "def bad(client, row):\n"
        "    client.chat.completions.create(model='gpt-4o', messages=[\n"
        "        {'role': 'user', 'content': row['prompt']}])\n")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    common = ["grpo", "--agent", f"{tmp_path}/bad.py:bad", "--data",
              str(tmp_path / "rows.jsonl"), "--model", tiny_model_dir, "--max_steps", "1",
              "--prompts_per_step", "2", "--group_size", "2", "--device", "cpu",
              "--tensorboard", "false", "--eval_every", "0"]
    assert main([*common, "--output_dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        r"error: agent bad on row [12]: request 1: unknown model 'gpt-4o' \(this endpoint "
        r"serves 'posttrain-policy'\)", err[0])
    assert main([*common, "--output_dir", str(tmp_path / "b"), "--on_reward_error",
                 "skip"]) == 0
