"""Tool calls as a built-in environment (``--tools file.py:fn1,fn2``).

The first message is the row's ``prompt``. Each assistant turn is read for tool calls:

- **json** (the ``<tool_call>`` style of Qwen / Hermes chat templates, chosen when the
  template mentions ``tool_call``)::

      <tool_call>
      {"name": "add", "arguments": {"a": 2, "b": 3}}
      </tool_call>

- **plain** (any other template, or none): one call per line, ``call: name(args)`` with
  Python literal arguments, positional or by keyword::

      call: add(2, 3)

Every call runs the Python function with the environment's timeout (``env_timeout``; a
call past it is left on a daemon thread, :mod:`.calls`) and its results return together as
one ``tool`` message, a line per call; a turn without a call is the final answer and ends
the episode (the reward terms then score it). A malformed call — unparsable, an unknown
tool, arguments the function refuses, a function that raises or times out — is the model's
mistake, never a crash: its line of the ``tool`` message says what went wrong, the turn's
reward is ``tool_error_reward`` (the user's choice, 0 by default) and it is counted
(``episodes/tool_failures_mean``).
"""

from __future__ import annotations

import ast
import contextlib
import json
import re

from posttrain import pysource
from posttrain.calls import timed
from posttrain.episodes.env import load_object

_JSON_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PLAIN_CALL = re.compile(r"^\s*call:\s*(.*)$", re.M)


def load_tools(spec: str) -> dict:
    """``path/to/file.py:fn1,fn2`` or ``module:fn1,fn2`` → ``{name: function}``."""
    if ":" not in spec:
        raise ValueError(f"tools {spec!r}: expected file.py:fn1,fn2 or module:fn1,fn2")
    target, names = spec.rsplit(":", 1)
    out = {}
    for name in (n.strip() for n in names.split(",") if n.strip()):
        fn = load_object(f"{target}:{name}", "tools")
        if not callable(fn):
            raise ValueError(f"tools {spec!r}: {name} is not a function")
        out[name] = fn
    if not out:
        raise ValueError(f"tools {spec!r}: no function named")
    return out


def tool_style(tokenizer) -> str:
    """``json`` for chat templates that know ``<tool_call>``, else ``plain``."""
    return "json" if "tool_call" in str(getattr(tokenizer, "chat_template", "") or "") \
        else "plain"


def parse_calls(text: str, style: str) -> list[tuple[str, list, dict] | str]:
    """The calls in an assistant turn: ``(name, args, kwargs)`` each, or a string saying
    why a call could not be read."""
    out: list = []
    if style == "json":
        for body in _JSON_CALL.findall(text):
            try:
                call = json.loads(body)
            except json.JSONDecodeError as e:
                out.append(f"the call is not JSON ({e.msg})")
                continue
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                out.append('the call needs {"name": str, "arguments": {...}}')
                continue
            args = call.get("arguments", {})
            if isinstance(args, str):  # some templates write the arguments as a JSON string
                with contextlib.suppress(json.JSONDecodeError):
                    args = json.loads(args)
            if not isinstance(args, dict):
                out.append(f"{call['name']}: arguments must be an object")
                continue
            out.append((call["name"], [], args))
        if not out and "<tool_call>" in text:
            out.append("a <tool_call> without its </tool_call>")
        return out
    for line in _PLAIN_CALL.findall(text):
        try:
            node = pysource.parse(line.strip(), mode="eval").body
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                raise ValueError("expected name(arguments)")
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except (SyntaxError, ValueError) as e:
            out.append(f"cannot read {line.strip()!r:.60}: {e}")
            continue
        out.append((node.func.id, args, kwargs))
    return out


class ToolEnv:
    """The environment ``--tools`` makes for each trajectory (see the module docstring)."""

    def __init__(self, row: dict, tools: dict, style: str = "plain",
                 error_reward: float = 0.0, timeout: float = 30.0):
        self.prompt = row.get("prompt")
        if not isinstance(self.prompt, str):
            raise ValueError("a --tools row needs a 'prompt' string")
        self.tools, self.style = tools, style
        self.error_reward, self.timeout = float(error_reward), timeout
        self.metrics = {"tool_calls": 0, "tool_failures": 0}

    def reset(self) -> str:
        return self.prompt

    def step(self, text: str):
        calls = parse_calls(text, self.style)
        if not calls:
            return None, 0.0, True
        lines, failures = [], 0
        for call in calls:
            self.metrics["tool_calls"] += 1
            line = self._run(call)
            failures += line.startswith("\0")
            lines.append(line.lstrip("\0"))
        self.metrics["tool_failures"] += failures
        return ({"role": "tool", "content": "\n".join(lines)},
                self.error_reward if failures else 0.0, False)

    def _run(self, call) -> str:
        """A call's result line; a failure's line starts with NUL (stripped by the
        caller)."""
        if isinstance(call, str):
            return f"\0error: {call}"
        name, args, kwargs = call
        fn = self.tools.get(name)
        if fn is None:
            return f"\0error: no tool {name!r} (tools: {', '.join(self.tools)})"
        try:
            return str(timed(lambda: fn(*args, **kwargs), self.timeout))
        except Exception as e:
            return f"\0error: {name}: {type(e).__name__}: {e}"


def tool_spec(spec: str, tokenizer, error_reward: float = 0.0, timeout: float = 30.0):
    """The environment of ``--tools spec`` for ``tokenizer``, and the functions its chat
    template describes to the model (json style; None for plain)."""
    from posttrain.episodes.env import EnvSpec

    tools = load_tools(spec)
    style = tool_style(tokenizer)
    env = EnvSpec(ToolEnv, {"tools": tools, "style": style, "error_reward": error_reward,
                            "timeout": timeout}, 0.0, "tools")
    return env, (list(tools.values()) if style == "json" else None)
