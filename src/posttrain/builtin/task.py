"""The built-in task: addition of two two-digit numbers, answered in a fixed format.

    prompt      "58+67="
    completion  "125"            (then the end-of-sequence token)

Problems are drawn so that a share ``CARRY_SHARE`` (70%) needs a carry from the units into
the tens column; the rest are drawn uniformly among carry-free problems.

The answer is verifiable, so the task serves every stage of a pipeline:

- **SFT demonstrations with a systematic flaw.** In a share ``flaw_rate`` of the problems that
  need a carry, the demonstration makes the classic pupil's error: it adds each column and
  forgets to carry (``58+67`` → ``115``; the leftmost column is written out in full). A model
  trained on these to a plateau imitates the mixture; greedy decoding then follows the
  majority (the flaw, for ``flaw_rate > 0.5``) on carry problems, so its accuracy settles near
  the share of carry-free problems (30%) and more SFT on the same data cannot fix it. A
  sampled answer is still right about ``1 - flaw_rate`` of the time per carry, which is the
  signal RL with a verifiable reward needs.
- **Preference pairs**: chosen = the right sum, rejected = the same sum with the carry
  mishandled: dropped where there is one, added where there is none.
- **RL prompts** with their answers, and :func:`reward` to score completions.

Train and held-out problems are disjoint: a fixed hash of ``(a, b)`` puts one in ten
problems in the held-out split.
"""

from __future__ import annotations

import random
import zlib

MIN_OPERAND, MAX_OPERAND = 10, 99
CARRY_SHARE = 0.7


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer_text(a: int, b: int) -> str:
    return str(a + b)


def no_carry_answer(a: int, b: int) -> str:
    """Column-wise sum that forgets every carry; the leftmost column is written in full."""
    da, db = str(a)[::-1], str(b)[::-1]
    n = max(len(da), len(db))
    cols = [int(da[i] if i < len(da) else 0) + int(db[i] if i < len(db) else 0) for i in range(n)]
    digits = [str(c % 10) for c in cols[:-1]] + [str(cols[-1])]
    return "".join(reversed(digits)).lstrip("0") or "0"


def has_carry(a: int, b: int) -> bool:
    return no_carry_answer(a, b) != answer_text(a, b)


def is_held_out(a: int, b: int) -> bool:
    return zlib.crc32(f"{a}+{b}".encode()) % 10 == 0


def _problems(n: int, split: str, seed: int, carry_share: float = CARRY_SHARE):
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"{seed}-{split}")
    want_eval = split == "eval"
    out = []
    while len(out) < n:
        want_carry = rng.random() < carry_share
        while True:
            a, b = rng.randint(MIN_OPERAND, MAX_OPERAND), rng.randint(MIN_OPERAND, MAX_OPERAND)
            if has_carry(a, b) == want_carry and is_held_out(a, b) == want_eval:
                break
        out.append((a, b))
    return out


def sft_rows(n: int, split: str = "train", seed: int = 0, flaw_rate: float = 0.65) -> list[dict]:
    """Prompt/completion demonstrations; carry problems use the flawed answer with
    probability ``flaw_rate``."""
    rng = random.Random(f"{seed}-flaw")
    rows = []
    for a, b in _problems(n, split, seed):
        flawed = has_carry(a, b) and rng.random() < flaw_rate
        completion = no_carry_answer(a, b) if flawed else answer_text(a, b)
        rows.append({"prompt": prompt_text(a, b), "completion": completion})
    return rows


def phantom_carry_answer(a: int, b: int) -> str:
    """A carry into the tens that isn't there: on a carry-free problem the opposite mistake
    to the no-carry flaw, on a carry problem a doubled carry."""
    return str(a + b + 10)


def preference_rows(n: int, split: str = "train", seed: int = 0,
                    over_carry_rate: float = 0.3) -> list[dict]:
    """Prompt/chosen/rejected pairs that contrast the right and the wrong handling of the
    carry. On carry problems rejected is the no-carry answer, or with probability
    ``over_carry_rate`` a doubled carry; on carry-free ones a phantom carry. Both directions
    are needed: a reward model that has only seen missing carries learns "more carry is
    better" and PPO then exploits it (measured: greedy accuracy 90% → 60% as the reward
    model's score kept rising), and preference training cannot get away with "always add a
    carry"."""
    rng = random.Random(f"{seed}-preference")
    rows = []
    for a, b in _problems(n, split, seed + 1):
        if has_carry(a, b) and rng.random() >= over_carry_rate:
            rejected = no_carry_answer(a, b)
        else:
            rejected = phantom_carry_answer(a, b)
        rows.append({"prompt": prompt_text(a, b), "chosen": answer_text(a, b),
                     "rejected": rejected})
    return rows


def rl_rows(n: int, split: str = "train", seed: int = 0) -> list[dict]:
    """Prompts with their reference answers (column ``answer``)."""
    return [{"prompt": prompt_text(a, b), "answer": answer_text(a, b)}
            for a, b in _problems(n, split, seed + 2)]


def reward(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
    """1.0 when the completion is exactly the answer (surrounding whitespace ignored)."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]
