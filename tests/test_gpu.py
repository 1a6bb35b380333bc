"""CUDA paths (marker ``gpu``; skipped without a CUDA device): the rollout engines, the
shared-prompt log-probs and every trainer on the GPU, in float32 and bfloat16. Run them
with ``python -m pytest -m gpu``; ``benchmarks/gpu_check.sh`` runs them with the GPU
timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import procs
from compiled import compiled_errors
from posttrain.data import pad_sequences
from posttrain.models import completion_logprobs, load_causal_lm, load_tokenizer
from posttrain.rollout import SamplingParams, generate
from shared_prompt import assert_shared_prompt_equals_full

pytestmark = pytest.mark.gpu

PROMPTS = ["58+67=", "40+41=", "22+33=", "12+99=", "7+8=", "3+95="]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


def _rows(r) -> list[list[int]]:
    return [ids[m.bool()].tolist() for ids, m in zip(r.completion_ids, r.completion_mask,
                                                     strict=True)]


def test_lean_and_hf_engines_agree_on_cuda(tok):
    """float32 on the GPU: greedy tokens of the lean decoder equal the model's own forward."""
    model = load_causal_lm("builtin", device="cuda").eval()
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    lean = generate(model, tok, PROMPTS, 2, params, engine="lean")
    hf = generate(model, tok, PROMPTS, 2, params, engine="hf")
    assert _rows(lean) == _rows(hf)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampling_on_cuda_is_seeded_and_scores_itself(tok, dtype):
    """A CPU generator drives sampling of a CUDA policy: the same seed gives the same
    tokens, and the sampling log-probs agree with a full forward (bf16: to its rounding)."""
    model = load_causal_lm("builtin", dtype=dtype, device="cuda").eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    a = generate(model, tok, PROMPTS, 4, params, torch.Generator().manual_seed(3))
    b = generate(model, tok, PROMPTS, 4, params, torch.Generator().manual_seed(3))
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.isfinite(a.logprobs).all()
    batch = pad_sequences(a.prompt_ids, _rows(a), pad_id=0)
    with torch.no_grad():
        full = completion_logprobs(model, batch["input_ids"].cuda(),
                                   batch["attention_mask"].cuda(),
                                   batch["loss_mask"].cuda()).float().cpu()
    sampled = a.logprobs[a.completion_mask.bool()]
    recomputed = full[batch["loss_mask"][:, 1:].bool()]
    mean_tol, max_tol = (1e-4, 1e-3) if dtype == "float32" else (0.1, 1.0)
    assert (sampled - recomputed).abs().mean().item() < mean_tol
    assert (sampled - recomputed).abs().max().item() < max_tol


@pytest.mark.parametrize("packed", [True, False])
def test_shared_prompt_logprobs_on_cuda(packed):
    """The shared-prompt forward (packed with its 4-D mask, or two calls) equals full
    sequences on the GPU, values and parameter gradients."""
    assert_shared_prompt_equals_full(load_causal_lm("builtin", device="cuda"), packed,
                                     tol=1e-4, grad_rtol=1e-3, grad_atol=1e-4)


@pytest.mark.parametrize("budget", [None, 24])
def test_packed_rows_equal_padded_on_cuda(budget):
    """Padding-free packing on the GPU: transformers builds the packed rows' block-diagonal
    mask from the positions for SDPA on CUDA too; each sequence's summed completion log-prob
    and the parameters' gradient equal the padded batch's (float32: the same bound as the
    shared-prompt layout's, two forwards of the same sums in another order)."""
    from posttrain.data import pack_sequences, per_sequence

    model = load_causal_lm("builtin", device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (3, 7, 5, 2, 9)]
    comps = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (9, 4, 12, 6, 1)]
    padded = {k: v.cuda() for k, v in pad_sequences(prompts, comps, 0).items()}
    packed = {k: v.cuda() for k, v in pack_sequences(prompts, comps, 0, budget=budget).items()}
    sums, grads = [], []
    for batch in (padded, packed):
        model.zero_grad(set_to_none=True)
        lp = completion_logprobs(model, batch["input_ids"], batch.get("attention_mask"),
                                 batch["loss_mask"], position_ids=batch.get("position_ids"))
        per = (lp.sum(-1) if "sequence_ids" not in batch
               else per_sequence(lp, batch["sequence_ids"][:, 1:], len(prompts)))
        per.sum().backward()
        sums.append(per.detach().cpu())
        grads.append(torch.cat([p.grad.flatten().cpu() for p in model.parameters()]))
    torch.testing.assert_close(sums[1], sums[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-4)


def _finite_metrics(out) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float):
                assert math.isfinite(value), (key, value)
    return rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_trainer_runs_on_cuda(tmp_path, dtype):
    """SFT → reward model → DPO, GRPO and PPO (actor, critic, reference, reward model), each a
    few steps on the GPU: metrics finite, weights saved, and the saved models load back."""
    from posttrain.trainers.offline import DPOConfig, RMConfig, SFTConfig, run_dpo, run_rm, run_sft
    from posttrain.trainers.online import PPOConfig, RLConfig, run_rl

    common = dict(device="cuda", dtype=dtype, tensorboard=False, log_every=1,
                  builtin_train_size=64, builtin_eval_size=16)
    runs = [
        (run_sft, SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=3, **common)),
        (run_rm, RMConfig(output_dir=str(tmp_path / "rm"), max_steps=3, **common)),
        (run_dpo, DPOConfig(output_dir=str(tmp_path / "dpo"), max_steps=3, **common)),
        (run_rl, RLConfig(output_dir=str(tmp_path / "grpo"), algo="grpo", max_steps=2,
                          prompts_per_step=4, group_size=4, **common)),
        (run_rl, PPOConfig(output_dir=str(tmp_path / "ppo"), max_steps=2, prompts_per_step=4,
                           group_size=2, minibatch_size=8,
                           reward=f"rm:{tmp_path / 'rm' / 'final'}", **common)),
    ]
    for run, cfg in runs:
        cfg.validate()
        run(cfg)
        _finite_metrics(Path(cfg.output_dir))
        assert (Path(cfg.output_dir) / "final" / "model.safetensors").exists()
    assert (tmp_path / "ppo" / "final" / "critic" / "model.safetensors").exists()
    reloaded = load_causal_lm(str(tmp_path / "grpo" / "final"), dtype=dtype, device="cuda")
    assert next(reloaded.parameters()).is_cuda


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_blocks_match_eager_on_cuda(dtype):
    """compile=true on the GPU (triton kernels): in float32 the compiled RMSNorm/MLP blocks
    give eager's log-probs and gradients (relative error norm per tensor < 2e-4; they sum in
    another order); in bfloat16 they stay as close to float32 as eager bfloat16 does."""
    err = compiled_errors(dtype, "cuda")
    if dtype == "float32":
        assert err["lp_vs_eager"] < 2e-4 and err["g_vs_eager"] < 2e-4
    else:
        assert err["lp_compiled_vs_fp32"] <= 3 * err["lp_eager_vs_fp32"] + 1e-3
        assert err["g_compiled_vs_fp32"] <= 3 * err["g_eager_vs_fp32"] + 1e-2
        assert err["g_vs_eager"] > 0  # its own rounding: the compiled path really ran


def _torchrun(args: list[str], out: Path) -> None:
    import os
    import sys

    proc = procs.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node", "1", "-m", "posttrain", *args, "--output_dir",
                      str(out)], env=dict(os.environ), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("command", ["sft", "grpo", "ppo"])
def test_fsdp_on_one_gpu_through_nccl(tmp_path, command):
    """torchrun with one rank and --parallel fsdp (an NCCL group of one, FSDP2 units on the
    GPU): float32 equals the plain process within 1e-5; bfloat16 (fp32 masters, bf16
    compute) runs, stays finite and saves a model that loads."""
    from safetensors.torch import load_file

    from posttrain.cli import main

    args = [command, "--device", "cuda", "--tensorboard", "false", "--log_every", "1",
            "--builtin_train_size", "64", "--builtin_eval_size", "16", "--max_steps", "3",
            "--lr", "1e-5"]
    if command != "sft":
        args += ["--prompts_per_step", "4", "--group_size", "4"]
    assert main([*args, "--output_dir", str(tmp_path / "plain")]) == 0
    _torchrun([*args, "--parallel", "fsdp"], tmp_path / "fsdp")
    a = load_file(str(tmp_path / "plain" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "fsdp" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    _torchrun([*args, "--parallel", "fsdp", "--dtype", "bfloat16"], tmp_path / "bf16")
    _finite_metrics(tmp_path / "bf16")
    reloaded = load_causal_lm(str(tmp_path / "bf16" / "final"), dtype="bfloat16",
                              device="cuda")
    assert next(reloaded.parameters()).is_cuda


def test_fsdp_with_cpu_offload_on_one_gpu(tmp_path):
    """--cpu_offload true keeps the shards, gradients and AdamW states in host memory; the
    update is the one without offload (float32, within 1e-5)."""
    from safetensors.torch import load_file

    args = ["sft", "--device", "cuda", "--tensorboard", "false", "--builtin_train_size", "64",
            "--builtin_eval_size", "16", "--max_steps", "3", "--parallel", "fsdp"]
    _torchrun(args, tmp_path / "on_gpu")
    _torchrun([*args, "--cpu_offload", "true"], tmp_path / "offload")
    a = load_file(str(tmp_path / "on_gpu" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "offload" / "final" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)


def test_qlora_trains_a_4bit_base_on_cuda(tmp_path):
    """--load_in_4bit: the base in NF4 through bitsandbytes, adapters in bf16; SFT and GRPO
    run a few steps, stay finite and save an adapter."""
    pytest.importorskip("bitsandbytes")
    from posttrain.cli import main

    for command, extra in (("sft", []), ("grpo", ["--prompts_per_step", "4",
                                                  "--group_size", "4"])):
        out = tmp_path / command
        assert main([command, "--device", "cuda", "--lora_rank", "8", "--load_in_4bit", "true",
                     "--tensorboard", "false", "--log_every", "1", "--builtin_train_size",
                     "64", "--builtin_eval_size", "16", "--max_steps", "2",
                     "--output_dir", str(out), *extra]) == 0
        _finite_metrics(out)
        assert (out / "final" / "adapter_model.safetensors").is_file()
