"""The built-in multi-turn task: addition with a hidden operand, which only the
environment can tell.

    user       "58+?"          the first message: one operand hidden
    assistant  "?"             asks for it
    tool       "67"            the environment's answer
    assistant  "125"           the sum: reward 1 if right, and the episode ends

An assistant turn other than ``?`` is taken as the answer. Without asking, the right sum is
a guess among 90 (≈1%); the information is necessary. The SFT demonstrations
(:func:`sft_rows`, ``messages`` rows) show the protocol, and answer with the built-in
task's systematic flaw (the forgotten carry, ``posttrain.builtin.task``) on a share
``flaw_rate`` of the carry problems, so the model SFT'd on them asks, then adds without
carrying on most carry problems — the signal GRPO needs. ``posttrain grpo --env builtin``
trains it; its start is ``--model builtin-episodes`` (this SFT, shipped; rebuilt with
``python -m posttrain.builtin.build --episodes``).

``LookupEnv`` is written only against the environment protocol
(``posttrain.episodes.env``): it is also the runnable example of ``docs/environments.md``.
"""

from __future__ import annotations

import random
import time

from posttrain.builtin import task

ASK = "?"


class LookupEnv:
    """``row``: ``{"a": int, "b": int, "answer": str}``. ``withhold=True`` answers the
    question with ``?`` (the ablation that shows the information is needed).
    ``latency_s``: every step waits this long first, as an environment behind a sandbox or
    a remote service does (the asynchronous benchmark's slow environment)."""

    def __init__(self, row: dict, withhold: bool = False, wrong_answer_reward: float = 0.0,
                 latency_s: float = 0.0):
        self.a, self.b, self.answer = int(row["a"]), int(row["b"]), str(row["answer"])
        self.withhold = withhold
        self.wrong = float(wrong_answer_reward)
        self.latency_s = float(latency_s)
        self.asked = False

    def reset(self) -> str:
        return f"{self.a}+{ASK}"

    def step(self, text: str):
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        if text.strip() == ASK and not self.asked:
            self.asked = True
            return {"role": "tool", "content": ASK if self.withhold else str(self.b)}, 0.0, False
        right = text.strip() == self.answer
        return None, 1.0 if right else self.wrong, True


def rows(n: int, split: str = "train", seed: int = 0) -> list[dict]:
    """Episode rows ``{"a", "b", "answer"}``, from the built-in task's problems (train and
    held-out disjoint as there)."""
    return [{"a": a, "b": b, "answer": task.answer_text(a, b), "_row": i + 1}
            for i, (a, b) in enumerate(task._problems(n, split, seed + 3))]


def sft_rows(n: int, split: str = "train", seed: int = 0, flaw_rate: float = 0.65
             ) -> list[dict]:
    """``messages`` demonstrations of the protocol (ask, read, answer); carry problems are
    answered without the carry with probability ``flaw_rate``."""
    rng = random.Random(f"{seed}-episodes-flaw")
    out = []
    for r in rows(n, split, seed):
        a, b = r["a"], r["b"]
        flawed = task.has_carry(a, b) and rng.random() < flaw_rate
        out.append({"messages": [
            {"role": "user", "content": f"{a}+{ASK}"},
            {"role": "assistant", "content": ASK},
            {"role": "tool", "content": str(b)},
            {"role": "assistant",
             "content": task.no_carry_answer(a, b) if flawed else r["answer"]}]})
    return out
