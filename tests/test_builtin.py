"""The shipped built-in model and task."""

from posttrain.builtin import task
from posttrain.evaluate import evaluate_policy
from posttrain.models import load_causal_lm, load_tokenizer


def test_builtin_model_is_small_and_on_its_plateau():
    """The shipped model loads, is under 5M parameters, and its greedy held-out accuracy
    sits in the designed band (15-60%): right on carry-free problems, flawed on most others."""
    model = load_causal_lm("builtin", device="cpu")
    tok = load_tokenizer("builtin")
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    rows = task.rl_rows(200, "eval")
    result = evaluate_policy(model, tok, rows, task.reward, max_new_tokens=6)
    assert 0.15 <= result["accuracy"] <= 0.60, result


def test_task_answers_and_flaw():
    """Hand-checked sums, the no-carry flaw, and disjoint train/held-out problems."""
    assert task.answer_text(58, 67) == "125"
    assert task.no_carry_answer(58, 67) == "115"
    assert task.no_carry_answer(95, 17) == "102"
    assert task.no_carry_answer(12, 34) == "46" and not task.has_carry(12, 34)
    train = {r["prompt"] for r in task.rl_rows(2000, "train")}
    held = {r["prompt"] for r in task.rl_rows(500, "eval")}
    assert not train & held
    assert task.reward(["1+1="] * 3, ["2", " 2 ", "3"], ["2", "2", "2"]) == [1.0, 1.0, 0.0]


def test_flawed_demonstrations_follow_the_flaw_rate():
    """About flaw_rate of the carry problems carry the no-carry answer; carry-free ones are
    always right."""
    rows = task.sft_rows(4000, "train", seed=3, flaw_rate=0.65)
    carry = flawed = 0
    for r in rows:
        a, b = map(int, r["prompt"][:-1].split("+"))
        if task.has_carry(a, b):
            carry += 1
            flawed += r["completion"] == task.no_carry_answer(a, b)
        else:
            assert r["completion"] == task.answer_text(a, b)
    assert 0.60 < flawed / carry < 0.70
    assert 0.65 < carry / len(rows) < 0.75
