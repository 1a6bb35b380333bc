"""Writes data/math.jsonl: a small generated math set for the docs and tests of the ``math``
reward. Each row: ``prompt``, ``answer`` (LaTeX), ``equivalent`` (other ways to write the
same value, each of which ``math`` must score 1) and ``different`` (near misses it must score
0). Run from the repository root: ``python data/make_math.py``."""

import json
import random
from fractions import Fraction
from pathlib import Path

INSTRUCTION = " Put the final answer in \\boxed{}."


def tex(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def decimal(q: Fraction) -> str | None:
    """The exact decimal of ``q`` when it terminates within 6 places."""
    for places in range(1, 7):
        scaled = q * 10**places
        if scaled.denominator == 1:
            return f"{float(q):.{places}f}"
    return None


def fraction_row(rng: random.Random) -> dict:
    a, b = Fraction(rng.randint(1, 9), rng.choice([2, 4, 5, 8])), \
        Fraction(rng.randint(1, 9), rng.choice([2, 4, 5, 8, 10]))
    op = rng.choice(["+", "-"])
    q = a + b if op == "+" else a - b
    if q.denominator == 1 or q == 0:
        q, op, b = a + b + Fraction(1, 4), "+", b + Fraction(1, 4)
    forms = [f"{q.numerator}/{q.denominator}", f"\\frac{{{2 * q.numerator}}}{{{2 * q.denominator}}}",
             f"\\dfrac{{{q.numerator}}}{{{q.denominator}}}"]
    if decimal(q):
        forms.append(decimal(q))
    wrong = [tex(q + Fraction(1, q.denominator)), tex(1 / q) if abs(q) != 1 else "0",
             f"{float(q) + 0.01:.3f}"]
    prompt = (f"Compute {a.numerator}/{a.denominator} {op} {b.numerator}/{b.denominator} "
              "as a fraction in lowest terms." + INSTRUCTION)
    return {"prompt": prompt, "answer": tex(q), "equivalent": forms, "different": wrong}


def integer_row(rng: random.Random) -> dict:
    x, y = rng.randint(12, 99), rng.randint(3, 19)
    n = x * y
    return {"prompt": f"What is {x} times {y}?" + INSTRUCTION, "answer": str(n),
            "equivalent": [f"{n}.0", f"{n}.00", f"\\boxed{{{n}}}", f"The answer is {n}."],
            "different": [str(n + 1), str(n - 10), f"{n / 10:g}"]}


def roots_row(rng: random.Random) -> dict:
    r, s = rng.sample([v for v in range(-6, 8) if v], 2)
    # x^2 - (r+s)x + rs = 0
    b, c = -(r + s), r * s
    poly = "x^2" + (f" {'+' if b > 0 else '-'} {abs(b) if abs(b) != 1 else ''}x" if b else "") + \
        (f" {'+' if c > 0 else '-'} {abs(c)}" if c else "")
    lo, hi = sorted((r, s))
    return {"prompt": f"Give the set of solutions of {poly} = 0." + INSTRUCTION,
            "answer": f"\\{{{lo}, {hi}\\}}",
            "equivalent": [f"\\{{{hi}, {lo}\\}}", f"\\{{{lo},{hi}\\}}"],
            "different": [f"\\{{{lo}\\}}", f"\\{{{lo}, {-hi}\\}}"]}


def root_row(rng: random.Random) -> dict:
    k, m = rng.choice([2, 3, 5, 6, 7]), rng.choice([2, 3, 4])
    return {"prompt": f"Simplify \\sqrt{{{k * m * m}}}." + INSTRUCTION,
            "answer": f"{m}\\sqrt{{{k}}}",
            "equivalent": [f"\\sqrt{{{k * m * m}}}", f"{m} \\sqrt{{{k}}}"],
            "different": [f"{m + 1}\\sqrt{{{k}}}", f"\\sqrt{{{k}}}"]}


def main() -> None:
    rng = random.Random(0)
    makers = [fraction_row, integer_row, roots_row, root_row]
    rows = [makers[i % len(makers)](rng) for i in range(40)]
    path = Path(__file__).with_name("math.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} rows -> {path}")


if __name__ == "__main__":
    main()
