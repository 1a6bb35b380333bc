"""Turns as token ids, appended and never re-tokenised.

An episode's tokens are built once, left to right: the first messages rendered as a prompt
(:meth:`Renderer.start`), then each assistant turn's sampled tokens exactly as the engine
drew them, then what the chat template puts between that turn and the next assistant turn
(:meth:`Renderer.between`: the rest of the assistant turn's closing, the environment's
messages, the next generation prompt), tokenised on its own. Nothing already in the
sequence is rendered or tokenised again, so the tokens trained are the tokens sampled;
re-tokenising the decoded transcript would not give them back in general (a tokenizer may
merge across the boundary of two sampled tokens, a template may rewrite earlier turns).

What goes between two assistant turns is found once from the template itself: the
difference between rendering a probe conversation with and without the new messages
(``[user, assistant]`` against ``[user, assistant, *messages]`` with the generation prompt).
A template whose renderings are not prefixes of one another cannot be appended to and is
refused with one line.

A tokenizer without a chat template gets the plain layout (the one SFT's ``messages`` rows
use)::

    user: first message
    assistant: the assistant's turn</s>
    tool: a tool's result
    assistant: ...

each message ``"{role}: {content}\\n"``, each assistant turn opened by ``"assistant: "`` and
closed by eos and a newline.
"""

from __future__ import annotations

_PROBE_USER, _PROBE_ASSISTANT = "U", "A"
_PROBE_REASONING = "posttrain-probe-reasoning"


class TemplateError(ValueError):
    """A chat template episodes cannot be appended to."""


class Renderer:
    """Token ids of an episode's non-sampled parts for ``tokenizer`` (see the module
    docstring)."""

    def __init__(self, tokenizer, tools: list | None = None):
        self.tok = tokenizer
        self.tools = tools or None
        """Functions the chat template describes to the model (its ``tools`` argument)."""
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.eos_text = tokenizer.eos_token or ""
        self._closing: str | None = None  # what the template puts after an assistant's content
        self._keeps: dict[tuple, bool] = {}  # keeps_reasoning, by the following roles
        self._probed: str | None = None

    # --- text ---------------------------------------------------------------------------
    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if not self.chat:
            text = "".join(f"{m['role']}: {m['content']}" + (
                f"{self.eos_text}\n" if m["role"] == "assistant" else "\n") for m in messages)
            return text + ("assistant: " if generation_prompt else "")
        return self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                            tokenize=False, tools=self.tools)

    def _probe(self) -> tuple[list[dict], str]:
        convo = [{"role": "user", "content": _PROBE_USER},
                 {"role": "assistant", "content": _PROBE_ASSISTANT}]
        if self._probed is None:  # (rendered once: every turn's opening starts from it)
            self._probed = self._render(convo, False)
        return convo, self._probed

    def closing(self) -> str:
        """What follows an assistant turn's content in the template (eos included)."""
        if self._closing is None:
            convo, full = self._probe()
            opened = self._render(convo[:1], True)
            if not full.startswith(opened + _PROBE_ASSISTANT):
                raise TemplateError(
                    "the chat template does not render an assistant turn as the generation "
                    "prompt followed by its content, so episodes cannot be appended to it "
                    "token by token; use a template that does, or none (the plain layout)")
            self._closing = full[len(opened) + len(_PROBE_ASSISTANT):]
        return self._closing

    def _opening(self, messages: list[dict]) -> str:
        convo, base = self._probe()
        full = self._render(convo + messages, True)
        if not full.startswith(base):
            raise TemplateError(
                "the chat template renders earlier turns differently once a "
                f"{[m['role'] for m in messages]} message follows, so episodes cannot be "
                "appended to it token by token")
        return full[len(base):]

    def keeps_reasoning(self, messages: list[dict]) -> bool:
        """Whether the template renders an earlier assistant turn's ``<think>…</think>``
        when ``messages`` follow it (some drop the reasoning of turns before the last user
        message); the plain layout keeps everything."""
        if not self.chat:
            return True
        roles = tuple(m["role"] for m in messages)
        if roles not in self._keeps:
            convo = [{"role": "user", "content": _PROBE_USER},
                     {"role": "assistant", "content": f"<think>\n{_PROBE_REASONING}\n</think>"
                                                      f"\n\n{_PROBE_ASSISTANT}"}]
            probe = [{**m, "content": _PROBE_USER} for m in messages]
            try:
                self._keeps[roles] = _PROBE_REASONING in self._render(convo + probe, True)
            except Exception:  # (a template that cannot render the probe: assume not)
                self._keeps[roles] = False
        return self._keeps[roles]

    # --- ids ----------------------------------------------------------------------------
    def start(self, messages: list[dict]) -> list[int]:
        """The first messages and the generation prompt, as the prompt's token ids (the
        tokenizer's special tokens added as for any prompt)."""
        return list(self.tok(self._render(messages, True))["input_ids"])

    def between(self, ended: bool, messages: list[dict]) -> list[int]:
        """The ids that follow an assistant turn's sampled tokens up to the next turn's first
        sampled token: the rest of the turn's closing (all of it when the turn did not end
        with eos, ``ended`` False), ``messages`` (none: the assistant speaks again), and the
        generation prompt."""
        closing = self.closing()
        if ended and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]
        text = closing + self._opening(messages)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])
