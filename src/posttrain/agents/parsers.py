"""What an assistant turn says, read as the OpenAI API answers it: ``content``,
``reasoning_content`` (a leading ``<think>…</think>``) and ``tool_calls``.

How a model writes a tool call is its chat template's convention, so the parsers are a
table keyed by template family, and the family is resolved from the template's own text:

- ``hermes`` (Qwen 2/2.5/3, Hermes, and every template that speaks ``<tool_call>``)::

      <tool_call>
      {"name": "add", "arguments": {"a": 2, "b": 3}}
      </tool_call>

- ``llama3_json`` (Llama 3.1+: the turn is one JSON object, optionally after
  ``<|python_tag|>``; ``parameters`` or ``arguments``)::

      {"name": "add", "parameters": {"a": 2, "b": 3}}

- ``mistral`` (``[TOOL_CALLS]`` followed by a JSON list)::

      [TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}}]

- ``plain`` (a tokenizer without a chat template: posttrain's plain layout): one call per
  line, ``call: name(args)`` with Python literal arguments;
- ``ask`` (the built-in episodes model, whose one tool call is the turn ``?``): a turn that
  is exactly ``?`` calls the request's only tool without arguments.

A turn whose calls cannot be read is answered as text (``content``), as the model wrote it:
a malformed call is the model's mistake, for the agent and the reward to see, never an
error of the run.
"""

from __future__ import annotations

import ast
import json
import re

from posttrain import pysource

_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.S)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PLAIN = re.compile(r"^\s*call:\s*(.*)$", re.M)

PARSERS = ("hermes", "llama3_json", "mistral", "plain", "ask")


def resolve(tokenizer, choice: str = "auto") -> str:
    """The parser for ``tokenizer``'s chat template: ``choice`` unless ``auto``; no template
    is ``plain``; a template that names ``<tool_call>``, ``[TOOL_CALLS]`` or
    ``<|python_tag|>`` is hermes, mistral or llama3_json; any other template that renders
    tools is an error that asks for ``--tool_parser`` (one that renders none: plain)."""
    if choice != "auto":
        if choice not in PARSERS:
            raise ValueError(f"tool_parser {choice!r}: expected auto or one of "
                             f"{', '.join(PARSERS)}")
        return choice
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return "plain"
    text = str(template)
    for marker, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                         ("<|python_tag|>", "llama3_json")):
        if marker in text:
            return name
    if "tools" in text:
        raise ValueError("the chat template renders tools in a format posttrain cannot "
                         "tell; pass --tool_parser " + "|".join(PARSERS[:-1]))
    return "plain"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, rest)``: a leading ``<think>…</think>`` apart (None: there is none)."""
    m = _THINK.match(text)
    if m is None:
        return None, text
    return m.group(1).strip(), text[m.end():]


def _call(name: str, arguments: dict, k: int) -> dict:
    return {"id": f"call_{k}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _json_call(body, k: int, keys=("arguments", "parameters")) -> dict | None:
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    args = next((body[key] for key in keys if key in body), {})
    if isinstance(args, str):  # (some models write the arguments as a JSON string)
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return _call(body["name"], args, k) if isinstance(args, dict) else None


def parse(text: str, parser: str, tools: list[dict] | None = None
          ) -> tuple[str | None, str | None, list[dict]]:
    """``(reasoning_content, content, tool_calls)`` of an assistant turn's text. ``content``
    is None when the turn is only calls; ``tools``: the request's (``ask`` calls the only
    one)."""
    reasoning, rest = split_reasoning(text)
    calls: list[dict] = []
    content: str | None = rest
    if parser == "hermes":
        bodies = _HERMES.findall(rest)
        for body in bodies:
            try:
                call = _json_call(json.loads(body), len(calls))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return reasoning, rest, []
            calls.append(call)
        if calls:
            content = _HERMES.sub("", rest).strip() or None
    elif parser == "llama3_json":
        body = rest.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            try:
                got = [json.loads(x) for x in body.split(";")] if ";" in body else \
                    [json.loads(body)]
            except json.JSONDecodeError:
                got = []
            calls = [c for c in (_json_call(g, k) for k, g in enumerate(got)) if c]
            if calls and len(calls) == len(got):
                content = None
            else:
                calls = []
    elif parser == "mistral":
        head, sep, body = rest.partition("[TOOL_CALLS]")
        if sep:
            try:
                got = json.loads(body.strip())
            except json.JSONDecodeError:
                got = None
            got = got if isinstance(got, list) else [got]
            calls = [c for c in (_json_call(g, k) for k, g in enumerate(got)) if c]
            if calls and len(calls) == len(got):
                content = head.strip() or None
            else:
                calls = []
    elif parser == "plain":
        for line in _PLAIN.findall(rest):
            try:
                node = pysource.parse(line.strip(), mode="eval").body
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) \
                        or node.args:
                    return reasoning, rest, []
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            except (SyntaxError, ValueError):
                return reasoning, rest, []
            calls.append(_call(node.func.id, args, len(calls)))
        if calls:
            content = _PLAIN.sub("", rest).strip() or None
    elif parser == "ask":
        if rest.strip() == "?" and tools and len(tools) == 1:
            calls = [_call(tool_name(tools[0]), {}, 0)]
            content = None
    else:
        raise ValueError(f"unknown tool parser {parser!r}")
    return reasoning, content, calls


def tool_name(tool: dict) -> str:
    """An OpenAI tool's function name (``{"type": "function", "function": {"name": …}}``)."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"a tool needs function.name, got {json.dumps(tool)[:80]}")
    return name
