"""Verifiable reward terms that need no model: ``math`` (the final answer, equivalent to the
row's ``answer`` by math-verify), ``format`` (a regular expression over the whole
completion) and ``length`` (a linear penalty past a target length).

Each is a plain reward function, ``f(prompts, completions, **columns) -> list[float]``, to use
by name (``--reward math,format``) or to import and wrap. The code term is in :mod:`.code`.
"""

from __future__ import annotations

import re
import threading

FORMAT_PATTERN = r"<think>(?:(?!</?think>).)*</think>\s*(?:(?!</?think>).)+"
"""``format``'s default: one ``<think>…</think>`` block first, then a non-empty answer with
no think tags in it."""

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_MARKER = re.compile(r"(?:answer\s*(?:is\s*[:=]?|[:=])|####)\s*(.+)", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` (or ``\\fbox{…}``), braces balanced; None
    when there is none or it is not closed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(completion: str) -> str:
    """The part of a completion that ``math`` checks, the first of: the last
    ``\\boxed{…}``; the last ``<answer>…</answer>``; what follows the last "answer:",
    "answer is", "answer =" or "####" on its line; the last number; the whole completion."""
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1].strip()
    markers = _MARKER.findall(completion)
    if markers:
        return markers[-1].strip().rstrip(".").strip()
    numbers = _NUMBER.findall(completion)
    if numbers:
        return numbers[-1].replace(",", "")
    return completion.strip()


def require_math_verify():
    """The ``math_verify`` module, or an ImportError that says how to install it."""
    try:
        import math_verify
    except ImportError:
        raise ImportError("reward math needs math-verify: pip install 'posttrain[math]'"
                          ) from None
    return math_verify


def _parsed(mv, text: str, timeout):
    """math-verify's reading of ``text``: as LaTeX math first (``$…$``), then as it is."""
    got = mv.parse(f"${text}$", parsing_timeout=timeout)
    return got if got else mv.parse(text, parsing_timeout=timeout)


def math_reward(prompts: list[str], completions: list[str], answer: list | None = None,
                **_) -> list[float]:
    """1.0 when the completion's final answer (:func:`final_answer`) is mathematically
    equivalent to the row's ``answer`` (math-verify: LaTeX, fractions, decimals, sets,
    intervals, units as it supports), else 0.0. An ``answer`` math-verify cannot read is
    an error (a data error, named with its row by the scorer)."""
    if answer is None:
        raise ValueError("the data has no 'answer' column (the reference answer of each row)")
    mv = require_math_verify()
    # math-verify bounds its own parsing and checking with SIGALRM, which only the main
    # thread can use; on a worker thread the run's reward_timeout bounds the call instead
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    out = []
    for completion, gold in zip(completions, answer, strict=True):
        gold_parsed = _parsed(mv, str(gold).strip(), timeout)
        if not any(not isinstance(g, str) for g in gold_parsed):  # (text alone: unread)
            raise ValueError(f"answer {str(gold)!r} is not an expression math-verify can read")
        pred = _parsed(mv, final_answer(completion), timeout)
        ok = bool(pred) and mv.verify(gold_parsed, pred, timeout_seconds=timeout)
        out.append(1.0 if ok else 0.0)
    return out


def format_reward(prompts: list[str], completions: list[str], pattern: str | None = None,
                  **_) -> list[float]:
    """1.0 when the whole completion (surrounding whitespace aside) matches ``pattern``
    (``re.DOTALL``; default :data:`FORMAT_PATTERN`), else 0.0."""
    rx = re.compile(pattern or FORMAT_PATTERN, re.DOTALL)
    return [1.0 if rx.fullmatch(c.strip()) else 0.0 for c in completions]


def length_penalty(prompts: list[str], completions: list[str], target: int = 1024,
                   span: int = 1024, **_) -> list[float]:
    """0 up to ``target`` characters, then falling linearly to −1 at ``target + span`` (and
    −1 past it). Characters, not tokens, so that the term reads text like every other; DAPO's
    overlong shaping (``--algo dapo``) is the token-budget version."""
    return [-min(1.0, (len(c) - target) / span) if len(c) > target else 0.0
            for c in completions]
