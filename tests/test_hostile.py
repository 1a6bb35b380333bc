"""Bad luck and bad input, through the command line as a user meets them: every case ends in
one clear line on stderr (exit 2, no traceback), or in a finished run; nothing already written
is lost and no NaN weights are saved."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main

QUICK = ["--device", "cpu", "--tensorboard", "false", "--builtin_train_size", "16",
         "--builtin_eval_size", "4"]
RL = [*QUICK, "--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "4"]


def fails(args: list[str], capsys, *needles: str) -> str:
    """Run the CLI; it must exit 2 with one line on stderr that holds every needle."""
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (code, err)
    lines = [x for x in err if not x.startswith(("WARNING", "["))]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in "\n".join(err)
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def finite_weights(path: Path) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in load_file(str(path)).values())


@pytest.fixture
def rl_data(tmp_path):
    reward = tmp_path / "rewards.py"
    reward.write_text(
        "def huge(prompts, completions, **_):\n    return [1e308] * len(completions)\n"
        "def nan(prompts, completions, **_):\n    return [float('nan')] * len(completions)\n"
        "def boom(prompts, completions, **_):\n    raise ZeroDivisionError('bad')\n"
        "def short(prompts, completions, **_):\n    return [1.0]\n"
        "def words(prompts, completions, **_):\n    return ['yes'] * len(completions)\n"
        "def ok(prompts, completions, **_):\n    return [float(len(c)) for c in completions]\n")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(4)))
    return reward, data


# --- config values -------------------------------------------------------------------------

@pytest.mark.parametrize("args, needles", [
    (["grpo", "--lr", "inf"], ("lr", "finite")),
    (["sft", "--lr", "nan"], ("lr", "finite")),
    (["dpo", "--lr", "-1e-5"], ("lr must be > 0",)),
    (["grpo", "--max_steps", "0"], ("max_steps",)),
    (["grpo", "--max_steps", "-3"], ("max_steps",)),
    (["sft", "--log_every", "0"], ("log_every",)),
    (["grpo", "--top_p", "0"], ("top_p",)),
    (["grpo", "--top_k", "-1"], ("top_k",)),
    (["grpo", "--kl_coef", "-0.1"], ("kl_coef",)),
    (["sft", "--epochs", "inf"], ("epochs",)),
    (["sft", "--device", "cuda"], ("cuda", "not available")),
    (["sft", "--device", "tpu9"], ("device",)),
    (["sft", "--learning_rate", "1e-4"], ("learning_rate", "'lr'")),
    (["sft", "--learning_rat", "1e-4"], ("'lr'",)),
    (["grpo", "--group_size", "1"], ("group_size",)),
    (["grpo", "--eval_data", "held.jsonl"], ("eval_data needs data",)),
    (["ppo", "--group_size", "0"], ("group_size",)),
    (["grpo", "--reward_weights", "1,x"], ("reward_weights",)),
])
def test_bad_config_values(args, needles, capsys, tmp_path):
    if torch.cuda.is_available() and "cuda" in args:
        pytest.skip("this machine has CUDA")
    fails([*args, "--output_dir", str(tmp_path / "out")], capsys, *needles)
    assert not (tmp_path / "out").exists()  # refused before the directory is touched


def test_malformed_yaml_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("lr: 1e-4\nbatch_size: [4\nseed: 1\n")
    fails(["sft", "--config", str(bad)], capsys, str(bad), "line")
    fails(["sft", "--config", str(tmp_path)], capsys, "directory")


def test_eval_arguments(capsys):
    fails(["eval", "--n", "0"], capsys, "--n")
    if not torch.cuda.is_available():
        fails(["eval", "--device", "cuda"], capsys, "cuda")


# --- data ----------------------------------------------------------------------------------

def test_data_files(tmp_path, capsys, rl_data):
    raw = tmp_path / "latin1.jsonl"
    raw.write_bytes(b'{"prompt": "a", "completion": "b"}\n'
                    b'{"prompt": "caf\xe9", "completion": "x"}\n')
    fails(["sft", "--data", str(raw), *QUICK], capsys, str(raw), "row 2", "UTF-8")
    nan = tmp_path / "pairs.jsonl"
    nan.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": NaN}\n')
    fails(["rm", "--data", str(nan), *QUICK], capsys, "row 1", "margin", "finite")
    reward, _ = rl_data
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "9" * 300}) + "\n")
    fails(["grpo", "--data", str(long), "--reward", f"{reward}:ok", "--max_length", "64", *RL,
           "--output_dir", str(tmp_path / "o")], capsys, str(long), "row 1", "prompt",
          "max_length")


# --- rewards -------------------------------------------------------------------------------

@pytest.mark.parametrize("fn, needles", [
    ("huge", ("huge", "float32")), ("nan", ("nan",)), ("boom", ("boom", "ZeroDivisionError")),
    ("short", ("short", "1 values")), ("words", ("words", "'yes'")),
])
def test_reward_functions_that_misbehave(fn, needles, tiny_model_dir, tmp_path, capsys,
                                         rl_data):
    reward, data = rl_data
    out = tmp_path / "out"
    fails(["grpo", "--model", tiny_model_dir, "--data", str(data), "--reward", f"{reward}:{fn}",
           *RL, "--max_steps", "2", "--output_dir", str(out)], capsys, *needles)
    assert not (out / "final").exists()


def test_reward_specs(tmp_path, capsys, rl_data):
    reward, data = rl_data
    fails(["grpo", "--data", str(data), "--reward", str(reward), *RL,
           "--output_dir", str(tmp_path / "a")], capsys, "module:function")
    fails(["grpo", "--data", str(data), "--reward", f"{reward}:nope", *RL,
           "--output_dir", str(tmp_path / "b")], capsys, "nope")
    fails(["eval", "--data", str(data), "--reward", "nosuchmodule_x:f"], capsys, "nosuchmodule_x")


def test_eval_with_a_nan_reward_prints_valid_json_and_fails(tiny_model_dir, capsys, rl_data):
    reward, data = rl_data
    capsys.readouterr()
    assert main(["eval", "--model", tiny_model_dir, "--data", str(data), "--reward",
                 f"{reward}:nan", "--max_new_tokens", "2"]) == 2
    out = capsys.readouterr()
    record = json.loads(out.out.strip().splitlines()[-1])  # strict JSON
    assert record["mean_reward"] is None
    assert "not a finite number" in out.err


# --- models and checkpoints ----------------------------------------------------------------

def test_model_paths(tmp_path, capsys, monkeypatch):
    fails(["sft", "--model", str(tmp_path / "no-such-model"), *QUICK], capsys, "no-such-model")
    fails(["sft", "--model", "./typo-dir", *QUICK], capsys, "typo-dir", "no such directory")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fails(["sft", "--model", "nobody/no-such-model-xyz", *QUICK], capsys,
          "nobody/no-such-model-xyz", "cache")


def test_garbage_and_truncated_model_files_are_named(tiny_model_dir, tmp_path, capsys):
    import shutil

    for damage in ("garbage", "truncated"):
        bad = tmp_path / damage
        shutil.copytree(tiny_model_dir, bad)
        weights = bad / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(b"not a model" if damage == "garbage" else data[: len(data) // 2])
        fails(["sft", "--model", str(bad), *QUICK, "--output_dir", str(tmp_path / f"o{damage}")],
              capsys, str(weights))


def test_a_half_overwritten_checkpoint_is_refused(tiny_model_dir, tmp_path, capsys):
    """Another run overwrote model.safetensors of checkpoint-2: the manifest's checksum
    catches it, naming the file, instead of resuming one run's weights with another's
    optimiser."""
    out = tmp_path / "run"
    common = ["sft", "--model", tiny_model_dir, *QUICK, "--batch_size", "4",
              "--save_every", "2", "--max_steps", "4", "--output_dir", str(out)]
    assert main(common) == 0
    other = tmp_path / "other"
    assert main([*common[:-1], str(other), "--seed", "9"]) == 0
    ckpt = out / "checkpoint-2"
    (ckpt / "model.safetensors").write_bytes((other / "checkpoint-2" /
                                              "model.safetensors").read_bytes())
    fails([*common, "--max_steps", "6", "--resume_from", str(ckpt)], capsys,
          str(ckpt / "model.safetensors"), "checksum")
    (ckpt / "optimizer-model.json").write_text("{")  # a second file damaged
    (ckpt / "manifest.json").unlink()
    fails([*common, "--max_steps", "6", "--resume_from", str(ckpt)], capsys, "incomplete")


def test_resume_refuses_another_config_and_nothing_to_do(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    common = ["sft", "--model", tiny_model_dir, *QUICK, "--batch_size", "4",
              "--save_every", "2", "--max_steps", "4", "--output_dir", str(out)]
    assert main(common) == 0
    ckpt = str(out / "checkpoint-2")
    fails([*common, "--resume_from", ckpt, "--lr", "3e-4"], capsys, "lr", "only max_steps")
    fails([*common, "--resume_from", ckpt, "--max_steps", "2"], capsys, "max_steps 2",
          "nothing to do")
    assert main([*common, "--max_steps", "6", "--resume_from", str(out)]) == 0  # the run dir
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r["step"] for r in rows if "train/lr" in r]
    assert train == [6]  # the first run's rows past checkpoint-2 (step 4) are gone
    assert all(r["step"] in (2, 6) or r["step"] < 2 for r in rows)


# --- output directories --------------------------------------------------------------------

def test_a_finished_run_is_never_replaced_silently(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["sft", "--model", tiny_model_dir, *QUICK, "--batch_size", "4", "--max_steps", "2",
            "--output_dir", str(out)]
    assert main(args) == 0
    before = (out / "final" / "model.safetensors").read_bytes()
    config = (out / "config.yaml").read_text()
    fails([*args, "--lr", "3e-4"], capsys, str(out), "--overwrite")
    assert (out / "final" / "model.safetensors").read_bytes() == before
    assert (out / "config.yaml").read_text() == config
    capsys.readouterr()
    assert main([*args, "--lr", "3e-4", "--overwrite", "true"]) == 0
    said = capsys.readouterr().err
    assert "overwrite: removed" in said and "final" in said
    assert "lr: 0.0003" in (out / "config.yaml").read_text()


# --- non-finite values ---------------------------------------------------------------------

def test_a_nan_loss_stops_the_run_and_saves_nothing(tiny_model_dir, tmp_path, capsys):
    """A huge learning rate sends the weights to inf, the loss to NaN: the run stops at that
    step, naming it, and no checkpoint or final/ holds NaN weights."""
    out = tmp_path / "run"
    args = ["sft", "--model", tiny_model_dir, *QUICK, "--batch_size", "4", "--max_steps", "30",
            "--save_every", "1", "--lr", "1e30", "--max_grad_norm", "0", "--warmup_ratio", "0",
            "--output_dir", str(out)]
    line = fails(args, capsys, "step", "nan")
    assert "--on_nonfinite skip" in line
    assert not (out / "final").exists()
    for ckpt in out.glob("checkpoint-*"):
        assert finite_weights(ckpt / "model.safetensors")
    for row in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(row)  # strict JSON throughout


def test_on_nonfinite_skip_leaves_the_update_out(tiny_model_dir, tmp_path, rl_data):
    """With skip, a step whose gradient is NaN changes nothing and is counted."""
    from posttrain.config import SFTConfig
    from posttrain.trainers import loop
    from posttrain.trainers.loop.guards import NonFiniteError

    cfg = SFTConfig(model=tiny_model_dir, output_dir=str(tmp_path), device="cpu",
                    on_nonfinite="skip")
    cfg.validate()
    model = torch.nn.Linear(2, 1)
    opt = loop.Optim("model", model, 1e-2, 0.0, 1.0, cfg.on_nonfinite)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([[math.nan, 1.0]])).sum().backward()
    assert math.isnan(opt.step()) and opt.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    raising = loop.Optim("model", model, 1e-2, 0.0, 1.0, "raise")
    model(torch.tensor([[math.inf, 1.0]])).sum().backward()
    with pytest.raises(NonFiniteError, match="gradient norm of the model"):
        raising.step()


def test_a_step_where_every_reward_failed_warns(tiny_model_dir, tmp_path, caplog, rl_data):
    reward, data = rl_data
    with caplog.at_level("WARNING"):
        assert main(["grpo", "--model", tiny_model_dir, "--data", str(data), "--reward",
                     f"{reward}:nan", "--on_reward_error", "skip", *RL, "--max_steps", "1",
                     "--output_dir", str(tmp_path / "o")]) == 0
    assert any("every sample's reward failed" in r.message for r in caplog.records)


def test_overwrite_keeps_the_old_run_until_the_new_one_has_loaded(tiny_model_dir, tmp_path,
                                                                 capsys, rl_data):
    """--overwrite with a typo in the reward: the error comes before anything is removed; and
    a run's own config.yaml (which holds overwrite: false) never deletes anything."""
    reward, data = rl_data
    out = tmp_path / "run"
    args = ["grpo", "--model", tiny_model_dir, "--data", str(data), "--reward", f"{reward}:ok",
            *RL, "--max_steps", "1", "--output_dir", str(out)]
    assert main(args) == 0
    fails([*args[:5], f"{reward}:typo", *args[6:], "--overwrite", "true"], capsys, "typo")
    assert (out / "final" / "model.safetensors").is_file()
    assert "overwrite: false" in (out / "config.yaml").read_text()
    fails(["grpo", "--config", str(out / "config.yaml"), "--seed", "1"], capsys, "--overwrite")
    assert (out / "final" / "model.safetensors").is_file()


def test_resume_writes_into_the_checkpoints_run_and_never_over_another(tiny_model_dir,
                                                                       tmp_path, capsys):
    run = tmp_path / "run"
    common = ["sft", "--model", tiny_model_dir, *QUICK, "--batch_size", "4",
              "--save_every", "2", "--max_steps", "4"]
    assert main([*common, "--output_dir", str(run)]) == 0
    other = tmp_path / "other"
    assert main([*common, "--output_dir", str(other)]) == 0
    ckpt = str(run / "checkpoint-2")
    fails([*common, "--max_steps", "6", "--resume_from", ckpt, "--output_dir", str(other)],
          capsys, str(other), "another run")
    fails([*common, "--max_steps", "6", "--resume_from", str(run / "final")], capsys,
          "final/", "not a checkpoint")
    from posttrain import config
    from posttrain.config import SFTConfig
    from posttrain.trainers import loop

    cfg = config.load(SFTConfig, None, [*common[1:], "--max_steps", "6", "--resume_from", ckpt])
    loop.start_run(cfg)  # no --output_dir: the checkpoint's own run directory
    assert cfg.output_dir == str(run)


def test_unfinished_writes_are_finished_or_removed_and_nothing_else(tmp_path):
    """A complete checkpoint-4.tmp whose checkpoint-4 is missing (killed between the two
    renames) becomes checkpoint-4; a half-written one goes; a user's own *.tmp stays."""
    from posttrain.config import SFTConfig
    from posttrain.trainers.loop import checkpoint as ckpt

    cfg = SFTConfig(output_dir=str(tmp_path))
    cfg.validate()
    done = tmp_path / "checkpoint-4.tmp"
    done.mkdir()
    (done / "model.safetensors").write_bytes(b"x" * 10)
    ckpt.write_manifest(done, 4, "run", cfg)
    half = tmp_path / "checkpoint-6.tmp"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"y")
    mine = tmp_path / "notes.tmp"
    mine.mkdir()
    said = ckpt.clean_partial(tmp_path)
    assert (tmp_path / "checkpoint-4").is_dir() and ckpt.verify(tmp_path / "checkpoint-4")
    assert not half.exists() and mine.is_dir() and len(said) == 2


def test_eval_names_a_reward_function_that_fails(tiny_model_dir, capsys, rl_data):
    reward, data = rl_data
    fails(["eval", "--model", tiny_model_dir, "--data", str(data), "--reward", f"{reward}:boom",
           "--max_new_tokens", "2"], capsys, "boom", "ZeroDivisionError", "sample")
