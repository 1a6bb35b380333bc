"""posttrain distill: the trainer's divergence is the formula's on the models' logits, the
chunked head path is the plain one, the student learns the teacher, a resume is exact, LoRA
runs, bad teachers are one line, and two ranks compute the update of one."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import procs
from bounds import (
    assert_within,
    grad_term_scales,
    logprob_scale,
    model_inner,
    model_stages,
    pair_bound,
)
from posttrain.cli import main
from posttrain.models import builtin_model_dir

SMALL = ["distill", "--prompts_per_step", "4", "--group_size", "2", "--builtin_train_size",
         "32", "--builtin_eval_size", "8", "--device", "cpu", "--tensorboard", "false",
         "--log_every", "1", "--seed", "2"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _trainer(student: str, teacher: str, tmp_path, **kw):
    from posttrain.config import DistillConfig
    from posttrain.trainers.online.distill import DistillTrainer

    cfg = DistillConfig(model=student, teacher=teacher, output_dir=str(tmp_path / "run"),
                        device="cpu", tensorboard=False, prompts_per_step=4, group_size=2,
                        builtin_train_size=16, builtin_eval_size=4, **kw)
    cfg.validate()
    return DistillTrainer(cfg)


def _step_inputs(t):
    from posttrain.trainers.online.batch import TokenBatch

    exp = t.experience.collect(1)
    tokens = TokenBatch(exp.local, t.tok.pad_token_id, t.device, False, 1.0)
    return exp, tokens, torch.arange(len(exp.valid))


def test_the_trainers_divergence_is_the_formulas_on_each_models_logits(tiny_model_dir,
                                                                        tmp_path):
    """Per sampled token: the loss of the two models' own forward logits at the positions
    that predict the token (computed here from a plain forward of each)."""
    from posttrain.core.distill import distill_token_loss

    t = _trainer(tiny_model_dir, str(builtin_model_dir()), tmp_path, beta=0.5)
    exp, tokens, rows = _step_inputs(t)
    div, _ = t._per_token(tokens, rows)
    want = []
    for i in range(len(rows)):
        prompt, comp = exp.rollout.prompt_ids[i], exp.rollout.completion_ids[i]
        comp = comp[exp.rollout.completion_mask[i].bool()].tolist()
        ids = torch.tensor([prompt + comp])
        with torch.no_grad():
            s = t.policy(input_ids=ids).logits[0]
            te = t.teacher(input_ids=ids).logits[0]
        at = slice(len(prompt) - 1, len(prompt) - 1 + len(comp))  # what predicts each token
        want.append(distill_token_loss(s[at], te[at], 0.5))
    want = torch.cat(want)
    assert div.shape == want.shape
    # the same float32 computation in another batch layout (padding, the heads on the
    # completion positions only): two forwards (the models' stages, the two log-softmaxes
    # and the sum over V), each term of the divergence a log-prob of one of the models
    ids = tokens.full["input_ids"][rows]
    stages = max(model_stages(m.config, False) for m in (t.policy, t.teacher)) + 2
    bound = pair_bound(stages, max(model_inner(m.config, ids.shape[1])
                                   for m in (t.policy, t.teacher)))
    with torch.no_grad():
        scale = sum(logprob_scale(m(input_ids=ids).logits) for m in (t.policy, t.teacher))
    assert_within(div.detach(), want, bound, scale, "divergence")
    t.close()


@pytest.mark.parametrize("budget", [None, 28])
def test_packed_rows_give_the_padded_divergences(tiny_model_dir, tmp_path, budget):
    """Packed (``--packing``, or chosen per step), the divergences and log-probs of every
    sampled token are the padded batch's, to the float32 bound of two forwards in another
    layout (as above)."""
    from posttrain.trainers.online.batch import TokenBatch

    t = _trainer(tiny_model_dir, str(builtin_model_dir()), tmp_path, beta=0.5)
    exp, padded, rows = _step_inputs(t)
    packed = TokenBatch(exp.local, t.tok.pad_token_id, t.device, False, 1.0, packing=True,
                        budget=budget)
    assert packed.packing and len(packed._pack(rows)[0]["input_ids"]) < len(rows)  # (shared)
    calls, pack = [], packed._pack
    packed._pack = lambda r: calls.append(r) or pack(r)  # (the packed layout is the one run)
    with torch.no_grad():
        (div_a, lp_a), (div_b, lp_b) = (x._per_token(x_tokens, rows) for x, x_tokens in
                                        ((t, padded), (t, packed)))
        ids = padded.full["input_ids"][rows]
        stages = max(model_stages(m.config, False) for m in (t.policy, t.teacher)) + 2
        bound = pair_bound(stages, max(model_inner(m.config, ids.numel())
                                       for m in (t.policy, t.teacher)))
        lp_scale = logprob_scale(t.policy(input_ids=ids).logits)
        div_scale = lp_scale + logprob_scale(t.teacher(input_ids=ids).logits)
    assert len(calls) == 1
    assert_within(div_b, div_a, bound, div_scale, "divergence")
    assert_within(lp_b, lp_a, bound, lp_scale, "log-prob")
    t.close()


def test_the_chunked_head_path_is_the_plain_one(tiny_model_dir, tmp_path, monkeypatch):
    """Chunked (each chunk's logits recomputed in the backward) against the whole logits:
    the same divergences and the same gradient, to float32 rounding."""
    from posttrain.trainers.online import distill

    t = _trainer(tiny_model_dir, str(builtin_model_dir()), tmp_path, reward_coef=1.0)
    _, tokens, rows = _step_inputs(t)
    params = [p for p in t.policy.parameters() if p.requires_grad]
    out = {}
    for name, threshold in (("plain", 1 << 60), ("chunked", 0)):
        monkeypatch.setattr(distill, "FUSED_HEAD_MIN_ELEMENTS", {"cpu": threshold})
        monkeypatch.setattr(t, "chunk_elements", 3 * t.tok.vocab_size if hasattr(
            t.tok, "vocab_size") else 300)  # a few tokens per chunk
        t.policy.zero_grad()
        div, lp = t._per_token(tokens, rows)
        if name == "plain":  # the magnitude of the per-token terms each gradient sums
            scales = grad_term_scales(div + lp, params)
        (div.sum() + lp.sum()).backward()
        out[name] = (div.detach(), lp.detach(), [p.grad.clone() for p in params])
    # Both paths run the student's backbone once and differ in the heads: the logits, the
    # two log-softmaxes over V and the divergence's sum over V in chunks of a few tokens
    # (and the head's weight gradient summed chunk by chunk): the models' stages plus two,
    # reductions no longer than V or the batch's tokens. The values' terms are log-probs of
    # both models; each gradient's terms the per-token gradients (grad_term_scales). The
    # bound is ~1e-4 of those terms: a gradient 1% off, or without one of the ~60 tokens'
    # terms, is 50x and 1000x beyond it.
    ids = tokens.full["input_ids"][rows]
    stages = max(model_stages(t.policy.config), model_stages(t.teacher.config, False)) + 2
    bound = pair_bound(stages, max(model_inner(t.policy.config, ids.numel()),
                                   model_inner(t.teacher.config, ids.numel())))
    with torch.no_grad():
        lp_scale = logprob_scale(t.policy(input_ids=ids).logits)
        div_scale = lp_scale + logprob_scale(t.teacher(input_ids=ids).logits)
    assert_within(out["chunked"][0], out["plain"][0], bound, div_scale, "divergence")
    assert_within(out["chunked"][1], out["plain"][1], bound, lp_scale, "log-prob")
    names = [n for n, p in t.policy.named_parameters() if p.requires_grad]
    for name, a, b, s in zip(names, out["plain"][2], out["chunked"][2], scales, strict=True):
        assert_within(b, a, bound, s, name)
    assert max(float(g.abs().max()) for g in out["plain"][2]) > 0
    t.close()


def _noisy_builtin(path: Path, scale: float = 0.3) -> str:
    """The built-in model with every weight moved by ``scale`` of its tensor's spread."""
    from transformers import AutoModelForCausalLM

    from posttrain.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(builtin_model_dir()))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    load_tokenizer(str(builtin_model_dir())).save_pretrained(path)
    return str(path)


def test_the_student_learns_the_teacher(tmp_path):
    """The built-in model with noise on its weights, distilled from the built-in model: the
    divergence on its own samples falls to a small part of where it started."""
    out = tmp_path / "run"
    student = _noisy_builtin(tmp_path / "noisy")
    assert main([*SMALL, "--model", student, "--teacher", "builtin", "--max_steps", "6",
                 "--output_dir", str(out)]) == 0
    div = [r["distill/divergence"] for r in _rows(out) if "distill/divergence" in r]
    assert len(div) == 6 and all(d == d and d >= 0 for d in div)
    assert sum(div[-3:]) / 3 < 0.25 * div[0]
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_resumed_distillation_ends_with_the_weights_of_the_whole_run(tmp_path, staleness):
    """Also with rollouts one version behind (a producer thread: the sampler side every RL
    command uses), whose batches the checkpoint keeps."""
    args = [*SMALL, "--model", "builtin", "--teacher", str(builtin_model_dir()), "--lr",
            "1e-3", "--save_every", "2", "--max_steps", "4"]
    if staleness:
        args += ["--async_staleness", str(staleness), "--async_producer", "thread"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main([*args, "--output_dir", str(whole)]) == 0
    lags = [r["async/staleness"] for r in _rows(whole) if "async/staleness" in r]
    assert lags == ([0.0, 1.0, 1.0, 1.0] if staleness else [])
    import shutil

    part.mkdir()
    shutil.copytree(whole / "checkpoint-2", part / "checkpoint-2")
    assert main([*args, "--output_dir", str(part), "--resume_from",
                 str(part / "checkpoint-2")]) == 0
    a = load_file(str(whole / "final" / "model.safetensors"))
    b = load_file(str(part / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_distillation_saves_an_adapter(tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "run"
    assert main([*SMALL, "--model", "builtin", "--teacher", "builtin", "--lora_rank", "4",
                 "--max_steps", "2", "--output_dir", str(out)]) == 0
    assert (out / "final" / "adapter_model.safetensors").exists()


def test_bad_teachers_are_one_line_and_exit_2(tmp_path, capsys):
    from posttrain.builtin.build import init_model
    from posttrain.models import load_tokenizer

    assert main([*SMALL, "--model", "builtin", "--max_steps", "1", "--output_dir",
                 str(tmp_path / "a")]) == 2
    assert "distill needs --teacher" in capsys.readouterr().err
    wide = tmp_path / "wide"  # the same tokenizer, a head of another size
    init_model(wide, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=2, vocab_size=300)
    assert main([*SMALL, "--model", "builtin", "--teacher", str(wide), "--max_steps", "1",
                 "--output_dir", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert "its head has 300 logits" in err and "\n" not in err
    other = tmp_path / "other"  # another vocabulary
    tok = load_tokenizer(str(builtin_model_dir()))
    tok.add_tokens(["<extra>"])
    init_model(other, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=2)
    tok.save_pretrained(other)
    assert main([*SMALL, "--model", "builtin", "--teacher", str(other), "--max_steps", "1",
                 "--output_dir", str(tmp_path / "c")]) == 2
    assert "vocabulary differs" in capsys.readouterr().err
    assert main([*SMALL, "--teacher", "builtin", "--beta", "2", "--output_dir",
                 str(tmp_path / "d")]) == 2
    assert "beta must be in [0, 1]" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_distill_as_one(tiny_model_dir, tmp_path, parallel):
    """Each rank's samples, the divergence's token mean over the whole minibatch, the
    gradients summed (DDP) or reduce-scattered (FSDP2): the single process's weights within
    1e-5 (lr 1e-5: AdamW moves a weight by about lr whatever its gradient, see
    tests/test_distributed.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = {}
    for ranks in (1, 2):
        out = tmp_path / f"r{ranks}"
        launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--standalone"] if ranks > 1 else [sys.executable])
        args = [*SMALL, "--model", tiny_model_dir, "--teacher", "builtin", "--prompts_per_step",
                "3", "--group_size", "4", "--minibatch_size", "6", "--lr", "1e-5",
                "--max_steps", "3", "--output_dir", str(out),
                *(["--parallel", parallel] if ranks > 1 else [])]
        proc = procs.run([*launch, "-m", "posttrain", *args], env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[ranks] = out
    a = load_file(str(outs[1] / "final" / "model.safetensors"))
    b = load_file(str(outs[2] / "final" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    ra = [r for r in _rows(outs[1]) if "distill/divergence" in r]
    rb = [r for r in _rows(outs[2]) if "distill/divergence" in r]
    assert [r["reward/mean"] for r in ra] == [r["reward/mean"] for r in rb]
    for x, y in zip(ra, rb, strict=True):  # (AdamW hides a gradient's scale; these do not)
        for k in ("distill/divergence", "train/loss", "train/grad_norm"):
            assert y[k] == pytest.approx(x[k], rel=1e-4), k


@pytest.mark.e2e
def test_distilling_the_quick_start_grpo_model_reaches_85_percent(tmp_path):
    """The quick start's GRPO model as the teacher, the built-in start as the student, the
    defaults of both commands: the student ends at ≥ 85% held-out (benchmarks/distill.py
    measures the curves over seeds, against GRPO)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from distill import _run, curve

    teacher_curve = curve(_run(["grpo"], tmp_path / "teacher"))
    assert teacher_curve[-1][2] >= 0.9, teacher_curve
    teacher = str(tmp_path / "teacher" / "final")
    student = curve(_run(["distill", "--teacher", teacher], tmp_path / "student"))
    assert student[-1][2] >= 0.85, student
