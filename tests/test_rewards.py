"""The built-in verifiable reward terms (math, format, length, code) and how terms are called
(workers, timeouts, failures): docs/rewards.md."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.rewards import (
    RewardError,
    RewardOptions,
    RewardTerm,
    final_answer,
    format_reward,
    length_penalty,
    parse_rewards,
    score,
)

DATA = Path(__file__).resolve().parent.parent / "data"
BOUND_S = 60
"""How long a test waits for a call that is promised to return (a hang fails, not a slow
machine: the calls here return in well under a second when they work)."""


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


# --- math ----------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, expected", [
    ("125", "125"),
    ("The sum is 125.", "125"),
    ("so it is \\boxed{\\frac{1}{2}} in the end", "\\frac{1}{2}"),
    ("\\boxed{\\frac{a}{\\sqrt{2}}} then \\boxed{x^{2}}", "x^{2}"),     # the last, nested
    ("<think>7?</think><answer> 8 </answer>", "8"),
    ("Final answer: 3/4.", "3/4"),
    ("the answer is 2\\sqrt{2}", "2\\sqrt{2}"),
    ("#### 1,000", "1,000"),
    ("about 1,234.5 units, not 7", "7"),
    ("no number here", "no number here"),
])
def test_the_final_answer_is_the_boxed_tagged_marked_or_last_number(completion, expected):
    assert final_answer(completion) == expected


def test_math_scores_every_equivalent_form_1_and_every_near_miss_0():
    """data/math.jsonl: 40 generated problems, each with its answer in other equivalent forms
    (fractions, decimals, reordered sets, radicals, words around the number) and near
    misses: 220 pairs."""
    pytest.importorskip("math_verify")
    from posttrain.rewards import math_reward

    rows = _rows("math.jsonl")
    completions, answers, want = [], [], []
    for r in rows:
        for form in r["equivalent"]:
            plain = "boxed" in form or form.startswith("The answer")
            completions.append(form if plain else f"\\boxed{{{form}}}")
            answers.append(r["answer"])
            want.append(1.0)
        for form in r["different"]:
            completions.append(f"\\boxed{{{form}}}")
            answers.append(r["answer"])
            want.append(0.0)
    assert len(want) >= 30
    got = math_reward([""] * len(want), completions, answers)
    wrong = [(a, c, g) for a, c, g, w in zip(answers, completions, got, want, strict=True)
             if g != w]
    assert not wrong, wrong[:5]


def test_math_reads_plain_answers_and_refuses_an_unreadable_gold():
    pytest.importorskip("math_verify")
    from posttrain.rewards import math_reward

    assert math_reward(["1+1="] * 3, ["2", "3", "It is 2."], ["2", "2", 2]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="math-verify can read"):
        math_reward([""], ["1"], ["\\frac{"])


def test_math_without_math_verify_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    from posttrain.rewards import math_reward

    with pytest.raises(ImportError, match=r"posttrain\[math\]"):
        math_reward([""], ["1"], ["1"])


# --- format and length ---------------------------------------------------------------------

def test_format_wants_one_think_block_then_an_answer():
    got = format_reward([""] * 6, ["<think>carry the 1</think> 42", "42",
                                   "<think>a</think><think>b</think> 4", "<think>x</think>",
                                   " <think>\nmulti\nline</think>\n<answer>4</answer> ",
                                   "4 <think>late</think> 4"])
    assert got == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert format_reward([""] * 2, ["ANSWER: 3", "3"], pattern=r"ANSWER: \d+") == [1.0, 0.0]


def test_length_penalty_is_zero_to_the_target_then_linear_to_minus_one():
    got = length_penalty([""] * 5, ["a" * 10, "a" * 100, "a" * 150, "a" * 200, "a" * 999],
                         target=100, span=100)
    assert got == [0.0, 0.0, -0.5, -1.0, -1.0]


# --- terms by name --------------------------------------------------------------------------

def test_terms_by_name_with_weights_and_options():
    terms = parse_rewards("builtin,format,length", "1,0.5,0.1",
                          options=RewardOptions(length_target=3, length_span=3,
                                                format_pattern=r"\d+", workers=2, timeout=5))
    assert [(t.name, t.weight, t.workers, t.timeout) for t in terms] == [
        ("builtin", 1.0, 2, 5), ("format", 0.5, 2, 5), ("length", 0.1, 2, 5)]
    total, per, valid = score(terms, ["1+1="] * 2, ["2", "2222222"], {"answer": ["2", "2"]})
    assert per["format"].tolist() == [1.0, 1.0]
    assert per["length"].tolist() == [0.0, -1.0]
    assert torch.allclose(total, torch.tensor([1.5, 0.5 - 0.1])) and valid.all()
    with pytest.raises(ValueError, match="named twice"):
        parse_rewards("builtin,builtin")


def test_the_config_refuses_the_settings_of_terms_it_does_not_run():
    from posttrain.config import RLConfig, load

    with pytest.raises(ConfigError, match="format_pattern"):
        load(RLConfig, None, ["--format_pattern", "x"])
    with pytest.raises(ConfigError, match="sandbox"):
        load(RLConfig, None, ["--sandbox", "rlimits"])
    with pytest.raises(ConfigError, match="not a regular expression"):
        load(RLConfig, None, ["--reward", "format", "--format_pattern", "("])
    with pytest.raises(ConfigError, match="on_reward_error"):
        load(RLConfig, None, ["--on_reward_error", "ignore"])
    cfg = load(RLConfig, None, ["--reward", "builtin,length", "--length_target", "5",
                                "--reward_workers", "3", "--on_reward_error", "zero"])
    options = cfg.reward_options()
    assert (options.length_target, options.workers) == (5, 3)


# --- calling terms: workers, timeouts, failures ---------------------------------------------

def _bounded(fn, *args):
    """``fn(*args)`` on a thread, or a failure if it has not returned within BOUND_S."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn(*args)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), f"did not return within {BOUND_S} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_workers_score_parts_of_the_batch_at_once_and_keep_its_order():
    """Each of 3 parts is called on its own thread; all three are inside the term together
    (a barrier that only 3 concurrent calls pass), and the values come back in order."""
    barrier = threading.Barrier(3, timeout=BOUND_S)
    threads = set()

    def fn(prompts, completions, **_):
        threads.add(threading.get_ident())
        barrier.wait()
        return [float(c) for c in completions]

    term = RewardTerm("n", fn, workers=3, timeout=BOUND_S)
    completions = [str(i) for i in range(10)]
    _, per, valid = _bounded(score, [term], [""] * 10, completions, {})
    assert per["n"].tolist() == [float(i) for i in range(10)]
    assert len(threads) == 3 and valid.all()


def _never_returns(release: threading.Event):
    def fn(prompts, completions, **_):
        if any(c == "hang" for c in completions):
            release.wait()  # (set at the test's end, so no thread outlives the test)
        return [1.0] * len(completions)
    return fn


@pytest.mark.parametrize("on_error", ["raise", "skip", "zero"])
def test_a_term_past_its_timeout_fails_its_samples_and_the_batch_goes_on(on_error):
    release = threading.Event()
    try:
        term = RewardTerm("slow", _never_returns(release), workers=2, timeout=0.5)
        completions = ["ok", "ok", "hang", "hang"]  # the second part never returns
        if on_error == "raise":
            with pytest.raises(RewardError, match=r"'slow' did not return within 0.5 s .*"
                                                  r"samples 2-3"):
                _bounded(score, [term], [""] * 4, completions, {}, on_error)
            return
        _, per, valid = _bounded(score, [term], [""] * 4, completions, {}, on_error)
        if on_error == "skip":
            assert valid.tolist() == [True, True, False, False]
        else:
            assert valid.all() and per["slow"].tolist() == [1.0, 1.0, 0.0, 0.0]
            assert per["slow_failed"].tolist() == [0.0, 0.0, 1.0, 1.0]
        # the abandoned pool is replaced: the next batch is scored by fresh workers
        _, per, valid = _bounded(score, [term], [""] * 2, ["ok", "ok"], {}, on_error)
        assert per["slow"].tolist() == [1.0, 1.0]
    finally:
        release.set()


def test_zero_scores_a_raising_sample_0_and_counts_it():
    def fn(prompts, completions, **_):
        if "boom" in completions:
            raise ValueError("boom")
        return [2.0] * len(completions)

    _, per, valid = score([RewardTerm("f", fn)], [""] * 3, ["a", "boom", "b"], {}, "zero")
    assert per["f"].tolist() == [2.0, 0.0, 2.0] and valid.all()
    assert per["f_failed"].tolist() == [0.0, 1.0, 0.0]


def test_a_reward_that_never_returns_does_not_keep_the_process_alive(tmp_path):
    """A run's reward call past its timeout is abandoned on a daemon thread: the process
    ends when its work does (a pool thread would be joined at exit, forever)."""
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import threading
        from posttrain.rewards import RewardTerm, score

        def never(prompts, completions, **_):
            threading.Event().wait()

        total, per, valid = score([RewardTerm("never", never, timeout=0.2)], ["p"], ["c"],
                                  {}, "zero")
        print("scored", per["never_failed"].tolist())
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=BOUND_S)
    assert done.returncode == 0, done.stderr
    assert "scored [1.0]" in done.stdout


# --- the docs' example, end to end ---------------------------------------------------------

@pytest.mark.slow
def test_grpo_with_math_and_format_on_the_shipped_math_set(tiny_model_dir, tmp_path):
    """docs/rewards.md's command on the tiny model: the terms are made by name from the
    run's keys, scored on the sampler's completions, and logged one by one."""
    pytest.importorskip("math_verify")
    from posttrain.cli import main

    out = tmp_path / "run"
    code = main(["grpo", "--model", tiny_model_dir, "--data", str(DATA / "math.jsonl"),
                 "--reward", "math,format", "--reward_weights", "1,0.2",
                 "--reward_workers", "2", "--output_dir", str(out), "--max_steps", "2",
                 "--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "8",
                 "--max_length", "160", "--eval_every", "0", "--device", "cpu",
                 "--tensorboard", "false", "--log_every", "1"])
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "reward/math" in r]
    assert len(logged) == 2 and all("reward/format" in r and "time/reward_s" in r
                                    for r in logged)


# --- code -----------------------------------------------------------------------------------

def _code_reward(mode: str = "all", timeout: float = 10.0):
    from posttrain.rewards import CodeReward
    from posttrain.sandbox import available_levels

    levels = available_levels()
    if not levels:
        pytest.skip("no sandbox level works on this machine")
    return CodeReward(levels[0], mode, timeout)


def test_code_scores_each_reference_1_and_each_wrong_solution_0():
    """data/code.jsonl: every problem's reference solution passes its tests, and its wrong
    one fails them, run in the sandbox."""
    reward = _code_reward()
    rows = _rows("code.jsonl")
    n = len(rows)
    got = reward([r["prompt"] for r in rows] * 2, [r["reference"] for r in rows]
                 + [r["wrong"] for r in rows], [r["tests"] for r in rows] * 2)
    assert got == [1.0] * n + [0.0] * n


def test_code_gives_no_credit_to_early_exits_forged_reports_or_broken_set_up():
    reward = _code_reward("share", timeout=2.0)  # (one program never ends)
    tests = "import math\nassert f(1) == 2\nassert f(2) == 3\nassert f(3) == 5"
    completions = [
        "def f(x):\n    return x + 1\n",                              # 2 of 3 asserts
        "```python\ndef f(x):\n    return x + 1\n```\ntext after",    # the same, fenced
        "import os\ndef f(x):\n    return x + 1\nos._exit(0)",          # exits before the tests
        "import sys\nprint('x 3 0')\nsys.exit(0)",                      # a forged report line
        "def f(x) return",                                              # a syntax error
        "while True:\n    pass",                                        # past the time limit
    ]
    got = reward([""] * 6, completions, [tests] * 6)
    assert got[:2] == [2 / 3, 2 / 3] and got[2:] == [0.0] * 4
    assert _code_reward("all")([""], [completions[0]], [tests]) == [0.0]
    bad_setup = "import not_a_module\nassert f(1) == 2"
    assert reward([""], [completions[0]], [bad_setup]) == [0.0]
    with pytest.raises(ValueError, match="not valid Python"):
        reward([""], [completions[0]], ["assert ("])


def test_code_refuses_resource_limits_alone_unless_asked(monkeypatch):
    """auto on a machine that offers only resource limits: one line saying what that leaves
    open and how to accept it."""
    import posttrain.sandbox.run as sandbox_run
    from posttrain.rewards import CodeReward
    from posttrain.sandbox import SandboxError

    # (the probes' verdicts as on such a machine: nothing is run)
    monkeypatch.setitem(sandbox_run._why_not, "bwrap", "not here (test)")
    monkeypatch.setitem(sandbox_run._why_not, "namespaces", "not here (test)")
    monkeypatch.setitem(sandbox_run._why_not, "rlimits", None)
    with pytest.raises(SandboxError, match="--sandbox rlimits"):
        CodeReward("auto")
    assert CodeReward("rlimits").box.level == "rlimits"


@pytest.mark.slow
def test_grpo_with_the_math_reward_learns_the_built_in_task(tmp_path):
    """The issue's target: `posttrain grpo --reward math` (the quick start's defaults, the
    built-in task's answers checked by math-verify) reaches ≥ 90% held-out greedy accuracy.
    Measured 95.4% (docs/rewards.md); the built-in exact-answer reward gives the same curve
    on this task, where an equivalent answer is the exact one."""
    pytest.importorskip("math_verify")
    from posttrain.cli import main

    out = tmp_path / "run"
    assert main(["grpo", "--reward", "math", "--output_dir", str(out), "--device", "cpu",
                 "--tensorboard", "false"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval/accuracy"] >= 0.90, rows[-1]
