"""The one run loop: every trainer killed with SIGKILL after a checkpoint and resumed ends with
the weights and metrics of a run that was never interrupted; the cadences mean the same for
every trainer; a checkpoint directory is never half-written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.trainers.loop import checkpoint as ckpt

# the same tiny-run settings for a subprocess and an in-process run of each command
RUNS = {
    "sft": ["--batch_size", "4", "--grad_accum", "2", "--builtin_train_size", "64"],
    "rm": ["--batch_size", "4", "--builtin_train_size", "64"],
    "dpo": ["--batch_size", "4", "--builtin_train_size", "64", "--precompute_ref", "false"],
    "grpo": ["--prompts_per_step", "2", "--group_size", "4", "--max_new_tokens", "4",
             "--builtin_train_size", "32", "--algo", "dapo"],
    "ppo": ["--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "4",
            "--builtin_train_size", "32", "--ppo_epochs", "2", "--minibatch_size", "2"],
}
STEPS, SAVE = 12, 3
CONSTANT = ("--lr_schedule", "constant", "--warmup_ratio", "0")


def _args(command: str, model: str, out: Path, *extra: str) -> list[str]:
    if command == "grpo":  # DAPO's dynamic sampling needs groups that are not all wrong
        model = "builtin"
    return [command, "--model", model, "--output_dir", str(out), "--max_steps", str(STEPS),
            "--save_every", str(SAVE), "--log_every", "2", "--eval_every", "4",
            "--builtin_eval_size", "4", "--device", "cpu", "--tensorboard", "false",
            "--warmup_ratio", "0.1", "--lr_schedule", "cosine", "--seed", "3",
            *RUNS[command], *extra]


def _cli(args: list[str]) -> int:
    from posttrain.cli import main

    return main(args)


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    out = load_file(str(path / "model.safetensors"))
    if (path / "critic").exists():
        out.update({f"critic.{k}": v for k, v in
                    load_file(str(path / "critic" / "model.safetensors")).items()})
    return out


@pytest.mark.kill
@pytest.mark.parametrize("command", sorted(RUNS))
def test_sigkill_after_a_checkpoint_then_resume_is_bit_identical(command, tiny_model_dir,
                                                                 tmp_path):
    """A run killed (SIGKILL, no chance to clean up) once checkpoint-3 exists, resumed from
    that checkpoint into the same directory, ends on the same weights and the same metrics
    rows (times aside) as one uninterrupted run. The killed run is given far more steps, so
    the kill lands mid-run; with a constant schedule and no warm-up nothing it computes
    depends on max_steps."""
    whole = tmp_path / "whole"
    assert _cli(_args(command, tiny_model_dir, whole, *CONSTANT)) == 0
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain",
                             *_args(command, tiny_model_dir, killed, *CONSTANT,
                                    "--max_steps", "100000")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = killed / f"checkpoint-{SAVE}"
    deadline = time.monotonic() + 120
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
    assert first.exists()
    # the killed run went on past the checkpoint; its later checkpoints and rows are dropped
    # by using the first checkpoint
    assert _cli(_args(command, tiny_model_dir, killed, *CONSTANT,
                      "--resume_from", str(first))) == 0
    a, b = _weights(whole / "final"), _weights(killed / "final")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _rows(killed) == _rows(whole)


def test_cadences_mean_the_same_for_offline_and_rl(tiny_model_dir, tmp_path):
    """log_every: a row every N steps (and the last); eval_every: evaluation rows at its
    multiples; the final evaluation at the last step; the same for SFT and GRPO."""
    for command in ("sft", "grpo"):
        out = tmp_path / command
        assert _cli(_args(command, tiny_model_dir, out, "--save_every", "0")) == 0
        rows = _rows(out)
        train = [r["step"] for r in rows if "train/lr" in r]
        evals = [r["step"] for r in rows if "eval/accuracy" in r or "eval/loss" in r]
        assert train == [2, 4, 6, 8, 10, 12], command
        assert [s for s in evals if s != 0] == [4, 8, 12], command


def test_truncate_metrics_keeps_rows_up_to_the_step_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "tr')
    assert ckpt.truncate_metrics(path, 2) == 2
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n{"step": 2, "x"')
    assert ckpt.truncate_metrics(path, 5) == 1


def test_checkpoints_are_written_atomically(tmp_path):
    """A write that fails leaves no directory under the final name (only the temporary one,
    replaced by the next attempt), and a finished write replaces an older directory."""
    target = tmp_path / "checkpoint-3"

    def broken(tmp: Path) -> None:
        (tmp / "model.safetensors").write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        ckpt.write_atomically(target, broken)
    assert not target.exists()
    ckpt.write_atomically(target, lambda tmp: (tmp / "a").write_text("1"))
    ckpt.write_atomically(target, lambda tmp: (tmp / "b").write_text("2"))
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert not target.with_name("checkpoint-3.tmp").exists()


def test_window_averages_each_value_over_the_steps_that_reported_it():
    from posttrain.trainers.loop.job import StepResult
    from posttrain.trainers.loop.metrics import Window

    w = Window()
    w.add(StepResult(values={"train/loss": 2.0, "reward/mean": 1.0}), 0.5)
    w.add(StepResult(values={"reward/mean": 3.0}), 1.5)  # the policy did not train
    m = w.means()
    assert m["train/loss"] == 2.0 and m["reward/mean"] == 2.0 and m["time/step_s"] == 1.0
    w2 = Window()
    w2.load(w.state())
    assert w2.means() == m


def test_a_checkpoint_of_an_older_release_is_refused_by_name(tmp_path):
    from posttrain.config import SFTConfig
    from posttrain.trainers.loop.rundir import resolve_resume

    old = tmp_path / "checkpoint-4"
    old.mkdir()
    (old / "trainer_state.json").write_text('{"step": 4, "kl_coef": 0.05}')
    cfg = SFTConfig(resume_from=str(old), output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"checkpoint-4 is incomplete.*older release"):
        resolve_resume(cfg)


KILLER = """
import os, signal, sys
from posttrain.trainers.loop import checkpoint as ck
point, args = sys.argv[1], sys.argv[2:]

def dies(orig):
    def f(*a, **k):
        if any("checkpoint-4" in str(x) for x in a):
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(*a, **k)
    return f

if point == "tokenizer":   # the model's weights and config are written, its tokenizer not
    import posttrain.trainers.offline as off
    real_save = off.save_model

    def save_model(model, tokenizer, path, state_dict=None):
        if "checkpoint-4" in str(path):
            model.save_pretrained(path)
            os.kill(os.getpid(), signal.SIGKILL)
        real_save(model, tokenizer, path, state_dict)
    off.save_model = save_model
elif point == "optimizer":   # the model files are written, the optimiser's are not
    ck.save_optimizer = dies(ck.save_optimizer)
elif point == "state":     # the optimiser's too, not the RNG and trainer state
    import posttrain.trainers.loop.state as lp
    real_save_ckpt = lp.save_checkpoint

    def save_checkpoint(path, *a, **k):
        if path.name == "checkpoint-4":
            def rng_state():
                os.kill(os.getpid(), signal.SIGKILL)
            ck.rng_state = rng_state
        return real_save_ckpt(path, *a, **k)
    lp.save_checkpoint = save_checkpoint
elif point == "manifest":  # every file but the manifest
    ck.write_manifest = dies(ck.write_manifest)
else:                      # everything, before the rename
    ck.os.replace = dies(ck.os.replace)
from posttrain.cli import main
sys.exit(main(args))
"""


@pytest.mark.kill
@pytest.mark.parametrize("point", ["tokenizer", "optimizer", "state", "manifest", "rename"])
def test_sigkill_during_a_checkpoint_write_resumes_from_a_complete_one(point, tiny_model_dir,
                                                                       tmp_path):
    """Killed while writing checkpoint-4 — after the model's weights, after the optimiser's,
    before the RNG and trainer state, before the manifest, before the rename: the
    half-written directory is never taken; resuming the run directory starts
    from checkpoint-2, cleans the leftover and ends where an uninterrupted run ends."""
    args = ["sft", "--model", tiny_model_dir, "--batch_size", "4", "--builtin_train_size",
            "32", "--builtin_eval_size", "4", "--device", "cpu", "--tensorboard", "false",
            "--save_every", "2", "--max_steps", "6", "--lr_schedule", "constant"]
    whole = tmp_path / "whole"
    assert _cli([*args, "--output_dir", str(whole)]) == 0
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", KILLER, point, *args, "--output_dir",
                           str(run)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (run / "checkpoint-4").exists() and (run / "checkpoint-2").exists()
    assert _cli([*args, "--output_dir", str(run), "--resume_from", str(run)]) == 0
    assert not list(run.glob("*.tmp"))
    a, b = _weights(whole / "final"), _weights(run / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.kill
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_sigint_and_sigterm_checkpoint_and_print_the_resume_command(sig, code, tiny_model_dir,
                                                                    tmp_path):
    out = tmp_path / "run"
    args = ["sft", "--model", tiny_model_dir, "--batch_size", "4", "--builtin_train_size",
            "32", "--builtin_eval_size", "4", "--device", "cpu", "--tensorboard", "false",
            "--max_steps", "100000", "--log_every", "1", "--lr_schedule", "constant",
            "--output_dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None and not (
            metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err
    said = [x for x in err.splitlines() if "resume with:" in x]
    assert len(said) == 1, err[-2000:]
    command = said[0].split("resume with: ", 1)[1].split()
    assert command[:2] == ["posttrain", "sft"]
    ckpt_dir = Path(command[command.index("--resume_from") + 1])
    step = int(ckpt_dir.name.split("-")[1])
    ckpt.verify(ckpt_dir)
    # the printed command resumes (here up to two more steps)
    assert _cli([*command[1:], "--max_steps", str(step + 2)]) == 0
    assert (out / "final" / "manifest.json").is_file()


def test_resume_restores_the_rng_that_dropout_draws_from(tmp_path):
    """With dropout the global RNG shapes every step: a resume that did not restore it would
    end on other weights."""
    from posttrain.builtin.build import init_model

    model = tmp_path / "dropout-model"
    init_model(model, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.3)
    args = ["sft", "--model", str(model), "--batch_size", "4", "--builtin_train_size", "32",
            "--builtin_eval_size", "4", "--device", "cpu", "--tensorboard", "false",
            "--save_every", "3", "--max_steps", "6", "--lr_schedule", "constant"]
    whole = tmp_path / "whole"
    assert _cli([*args, "--output_dir", str(whole)]) == 0
    again = tmp_path / "again"
    assert _cli([*args, "--output_dir", str(again), "--resume_from",
                 str(whole / "checkpoint-3")]) == 0
    a, b = _weights(whole / "final"), _weights(again / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_a_token_budget_ends_the_run_after_the_step_that_spends_it(command, tiny_model_dir,
                                                                  tmp_path):
    """``max_tokens``: the run stops after the first step whose running count of completion
    tokens reaches the budget, with its row logged (whatever log_every), the final
    evaluation and final/ written; the count is what the steps report, and a checkpoint
    carries it into a resumed run."""
    whole = tmp_path / "whole"
    args = _args(command, tiny_model_dir, whole, *CONSTANT)
    assert _cli(args) == 0
    rows = [r for r in _rows(whole) if "samples/tokens_total" in r]
    per_step = rows[1]["samples/tokens_total"] - rows[0]["samples/tokens_total"]
    assert per_step > 0
    budget = int(rows[2]["samples/tokens_total"]) - 1  # spent during step 6 (log_every 2)
    out = tmp_path / "budget"
    assert _cli(_args(command, tiny_model_dir, out, *CONSTANT, "--max_tokens",
                      str(budget))) == 0
    got = _rows(out)
    last = [r for r in got if "samples/tokens_total" in r][-1]
    assert last["step"] == 6 and last["samples/tokens_total"] >= budget
    assert next(r for r in _rows(whole) if r["step"] == 6)["samples/tokens_total"] == \
        last["samples/tokens_total"]
    assert json.loads((out / "final" / ckpt.MANIFEST).read_text())["step"] == 6
    assert any("eval/" in k for r in got if r["step"] == 6 for k in r)  # the final evaluation
    # resumed from checkpoint-3 with the budget: the count goes on from the checkpoint's
    again = tmp_path / "again"
    assert _cli(_args(command, tiny_model_dir, again, *CONSTANT, "--max_tokens", str(budget),
                      "--resume_from", str(whole / "checkpoint-3"))) == 0
    assert [r["step"] for r in _rows(again) if "samples/tokens_total" in r][-1] == 6


def test_a_time_budget_ends_the_run(tiny_model_dir, tmp_path):
    out = tmp_path / "t"
    assert _cli(_args("sft", tiny_model_dir, out, "--max_seconds", "1e-9")) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and rows[0]["time/train_s"] > 0
    assert (out / "final").exists()
