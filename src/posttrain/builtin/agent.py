"""The built-in multi-turn task as an agent (``posttrain grpo --agent builtin``): the
program ``--env builtin``'s :class:`~posttrain.builtin.episodes.LookupEnv` would be if it
were written, as agents are, against an OpenAI-compatible endpoint with the ``openai`` SDK.

The model is given one function tool, ``operand``, which returns the hidden operand; the
built-in model calls a tool by answering ``?`` (its SFT demonstrations' protocol, read by
the ``ask`` tool-call parser). The agent answers the call with a ``tool`` message, and the
next answer is scored: 1 if it is the sum. Written only against the ``openai`` client, it is
also the runnable example of ``docs/agents.md``.
"""

from __future__ import annotations

OPERAND = {"type": "function", "function": {
    "name": "operand", "description": "The hidden operand of the sum.",
    "parameters": {"type": "object", "properties": {}}}}


def lookup_agent(client, row: dict) -> float:
    """One episode of the built-in task through ``client`` (an ``openai.OpenAI``)."""
    messages = [{"role": "user", "content": f"{row['a']}+?"}]
    for _ in range(2):
        reply = client.chat.completions.create(model="posttrain-policy", messages=messages,
                                               tools=[OPERAND])
        reward = answered(reply.choices[0].message, messages, row)
        if reward is not None:
            return reward
    return 0.0


def answered(message, messages: list, row: dict) -> float | None:
    """After the model's ``message``: the episode's reward when it is the final answer (1 if
    it is the sum), else None, its tool calls answered in ``messages``."""
    if not message.tool_calls:
        return 1.0 if (message.content or "").strip() == str(row["answer"]) else 0.0
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(row["b"])})
    return None
