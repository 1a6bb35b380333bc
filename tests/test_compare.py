"""``posttrain compare``: the upcycled mixture-of-experts start computes the dense model it
came from, and a small study (two algorithms and the start, one seed, a small token budget,
the MoE arms included) writes its report, curves and results with every run inside its
budget, and reports the scores of the models it trained; the MoE verdict says what the
numbers show."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bounds import model_inner, model_stages, rel_bound
from posttrain.builtin import task
from posttrain.cli import main
from posttrain.compare import moe
from posttrain.compare.runner import EVAL_SIZE
from posttrain.evaluate import evaluate_policy
from posttrain.models import load_causal_lm, load_tokenizer


def test_an_upcycled_model_computes_the_dense_one():
    """Identical experts (no noise): whatever the router picks, the top-k weights sum to
    one, so the logits are the dense model's within two float32 forwards' bound."""
    dense = load_causal_lm("builtin", device="cpu").eval()
    upcycled = moe.upcycle(dense, noise=0.0).eval()
    assert type(upcycled).__name__ == "MixtralForCausalLM"
    ids = torch.randint(3, 200, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = dense(ids).logits.double(), upcycled(ids).logits.double()
    bound = 2 * rel_bound(model_stages(dense.config, backward=False) + 2,
                          model_inner(dense.config, 12))
    assert float((a - b).norm() / a.norm()) <= bound
    jittered = moe.upcycle(dense, noise=0.05).eval()
    with torch.no_grad():
        c = jittered(ids).logits.double()
    assert float((a - c).norm() / a.norm()) > 100 * bound  # the experts do part


def _held_out_accuracy(model: str) -> float:
    """Greedy accuracy of ``model`` on the study's fixed held-out problems, evaluated here
    rather than by the study's scorer."""
    return evaluate_policy(load_causal_lm(model, device="cpu").eval(),
                           load_tokenizer("builtin"), task.rl_rows(EVAL_SIZE, "eval"),
                           task.reward, max_new_tokens=8)["accuracy"]


@pytest.mark.e2e
def test_a_small_study_writes_its_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(moe, "MOE_SFT_STEPS", 4)
    out = tmp_path / "cmp"
    assert main(["compare", "--algos", "sft", "grpo", "dpo", "--seeds", "1", "--tokens",
                 "1500", "--moe_seeds", "1", "--output", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["report"] == str(out / "report.md")
    results = json.loads((out / "results.json").read_text())
    report = (out / "report.md").read_text()
    # the start row is the built-in model on the held-out problems, and its KL to itself is 0
    (start,) = results["algos"]["sft"]
    assert start["accuracy"] == _held_out_accuracy("builtin") and start["kl"] == 0.0
    for algo in ("grpo", "dpo"):
        (run,) = results["algos"][algo]
        # the budget: stopped on the first step past it, so within one step of it
        assert 1500 <= run["tokens"] < 1500 + 16 * 8 * 8
        # the scores are the run's final model's (not the start's, a checkpoint's or the
        # run's own evaluation of 100 problems), and the report prints those numbers
        final = str(out / "runs" / f"{algo}-seed0" / "final")
        assert run["accuracy"] == _held_out_accuracy(final) and math.isfinite(run["kl"])
        row = f"| {algo} | {run['accuracy']:.1%} ± 0.0% | {run['reward']:.3f} ± 0.000 |"
        assert row in report
        # the curve rises in tokens and ends at what the run spent
        tokens = [p[0] for p in run["curve"]]
        assert tokens == sorted(set(tokens))
        assert run["curve"][-1][:2] == [run["tokens"], run["train_s"]]
        assert run["peak_rss_mib"] > 0
    assert set(results["moe"]["runs"]) == {"grpo", "grpo+r3", "gspo", "gspo+r3"}
    for arm, (run,) in results["moe"]["runs"].items():
        assert 0 <= run["disagreement"] <= 1 and 0 <= run["routing_moved"] <= 1
        assert run["gap_max"] >= run["gap_mean"] >= 0 and math.isfinite(run["accuracy"])
        assert f"| {arm} | {run['accuracy']:.1%} ± 0.0% |" in report
    for text in ("| grpo |", "| dpo |", "sft (the start)", "routing replay and GSPO",
                 "GRPO + R3", "GSPO against GRPO", "curves.png"):
        assert text in report
    assert (out / "curves.png").stat().st_size > 0


def test_an_unknown_algorithm_is_one_line(tmp_path, capsys):
    assert main(["compare", "--algos", "grpo", "ppo2", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown algorithm 'ppo2'" in err[0]


def test_moe_alone_runs_only_the_moe_arms(monkeypatch, tmp_path, capsys):
    import posttrain.compare as compare

    got = {}
    monkeypatch.setattr(compare, "run_compare", lambda *a, **kw: got.update(moe=a[5]) or
                        tmp_path / "report.md")
    for args, want in ((["--moe"], "only"), (["--moe", "false"], False), ([], True)):
        assert main(["compare", *args, "--output", str(tmp_path)]) == 0
        assert got["moe"] == want
    capsys.readouterr()


def _arm(accuracy: float, gap_max: float) -> dict:
    return {"accuracy": accuracy, "gap_max": gap_max, "disagreement": 0.004,
            "routing_moved": 0.1}


def test_the_moe_verdict_reads_the_numbers():
    """Each statement follows the table: the gap shrinks only when R3's worst gap is below
    the plain arm's; accuracy is apart only beyond the seeds' spread; a run below the start
    is named."""
    from posttrain.compare.report import _moe_verdict

    study = {"start": {"accuracy": 0.3}, "runs": {
        "grpo": [_arm(0.90, 9.0), _arm(0.94, 1.0)],
        "grpo+r3": [_arm(0.92, 0.2), _arm(0.93, 0.3)],
        "gspo": [_arm(0.95, 0.1), _arm(0.95, 0.1)],
        "gspo+r3": [_arm(0.20, 0.4), _arm(0.22, 0.5)]}}
    text = "\n".join(_moe_verdict(study))
    assert "GRPO + R3**: the worst step's trainer/sampler log-prob gap shrinks (0.250" in text
    assert "GSPO + R3**: the worst step's trainer/sampler log-prob gap does not shrink" in text
    grpo, gspo = (line for line in text.splitlines() if "+ R3**" in line)
    assert "no accuracy effect shows" in grpo and "lower with R3 by more than twice" in gspo
    assert "GSPO's advantage shows" in text  # higher and steadier than GRPO
    assert "2 runs ended below the start (gspo+r3 seed 0, gspo+r3 seed 1)" in text
    assert "0.40% of tokens" in text and "10.0%" in text
