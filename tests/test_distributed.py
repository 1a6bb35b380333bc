"""torchrun on the CPU (gloo, 2 processes of one thread): the offline trainers compute on 2
ranks the update they compute in one process, and a 2-rank run resumes exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ARGS = ["--batch_size", "8", "--grad_accum", "2", "--max_steps", "4", "--builtin_train_size",
        "64", "--builtin_eval_size", "8", "--device", "cpu", "--tensorboard", "false",
        "--lr", "1e-3", "--log_every", "1", "--warmup_ratio", "0"]


def _run(command: str, model: str, out: Path, ranks: int, *extra: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--standalone"] if ranks > 1 else [sys.executable])
    proc = subprocess.run([*launch, "-m", "posttrain", command, "--model", model, *ARGS,
                           "--output_dir", str(out), *extra], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("command", ["sft", "rm", "dpo"])
def test_two_ranks_compute_the_update_of_one(command, tiny_model_dir, tmp_path):
    """Final weights within 1e-5 of the single process (the target), losses and gradient
    norms at every step to float32 rounding (the ranks sum in another order). Only rank 0
    writes: one metrics.jsonl, one final/."""
    one, two = tmp_path / "one", tmp_path / "two"
    _run(command, tiny_model_dir, one, 1)
    _run(command, tiny_model_dir, two, 2)
    a, b = _weights(one), _weights(two)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    rows_a, rows_b = _rows(one), _rows(two)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for x, y in zip(rows_a, rows_b, strict=True):
        for key in ("train/loss", "train/grad_norm", "eval/loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5), key


def test_a_two_rank_run_resumes_exactly(tiny_model_dir, tmp_path):
    whole = tmp_path / "whole"
    _run("sft", tiny_model_dir, whole, 2, "--save_every", "2", "--lr_schedule", "constant")
    again = tmp_path / "again"
    _run("sft", tiny_model_dir, again, 2, "--save_every", "2", "--lr_schedule", "constant",
         "--resume_from", str(whole / "checkpoint-2"))
    a, b = _weights(whole), _weights(again)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_on_policy_trainers_refuse_to_run_on_several_ranks(tiny_model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", "--standalone", "-m", "posttrain", "grpo", "--model",
                           tiny_model_dir, "--output_dir", str(tmp_path / "o"), "--device",
                           "cpu"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "do not run under torchrun yet" in proc.stderr
