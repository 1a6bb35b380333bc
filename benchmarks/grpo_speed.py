"""GRPO seconds per step and peak memory: posttrain against TRL's ``GRPOTrainer``, same
model, prompts, reward and settings, alternating runs in one session.

Settings (``identical``): 8 prompts × 8 completions per step, up to 32 new tokens,
temperature 1, β = 0.04, ε = 0.2, GRPO's per-sequence loss (TRL ``loss_type="grpo"``), one
update per batch, fp32, no vLLM, gradient checkpointing off, lr 1e-5. ``defaults``: the same
batch shape and algorithm name with each library's other defaults. ``identical_compiled``:
``identical`` with posttrain's ``compile=true`` (its RMSNorm and MLP blocks compiled; the
one-off compile falls in the first step, which the median skips) and TRL unchanged (eager).
``compiled``: ``identical`` with both compiled: posttrain ``compile=true``, TRL
``torch_compile=True`` (its Trainer compiles the policy and reference models for the
training and reference forwards; generation runs uncompiled, as posttrain's lean decoder
does; its first step holds the compile). ``identical_malloc``: ``identical`` with TRL's
process given the glibc setting posttrain's trainers apply by default
(``posttrain.fast.memory.keep_freed_memory``), to show how much of the difference that
setting makes. ``vllm``: ``identical`` with both sampling through a vLLM engine colocated in
the trainer's process (posttrain ``rollout_backend=vllm``; TRL ``use_vllm=True,
vllm_mode="colocate"``), each with its default mismatch correction (token-level truncated
importance weights in both), its weight sync after every step and its own engine settings
(posttrain: 1 GiB of KV cache and vLLM's threads left unbound; TRL: vLLM's defaults, which
bind them); run it in the vLLM
environment (docs/engines.md), where ``identical`` gives the lean-engine figures beside it.

Models: ``small`` (~0.5M: hidden 128, 2 layers) and ``medium`` (~25M: hidden 512, 8 layers),
random init with the built-in byte tokenizer; the reward is the built-in task's exact answer
(a random model scores 0, so both libraries see the same zero-advantage batches and both
generate the full 32 tokens nearly always). Each run is a fresh subprocess; we report the
median step (skipping ``--warmup`` steps), the median over repeats, their ratio, and each
run's peak RSS (``wait4``).

Usage: python benchmarks/grpo_speed.py [--sizes small medium] [--repeats 3] [--steps 8]
       [--settings identical defaults identical_compiled compiled identical_malloc vllm]
Needs the bench extra: pip install -e '.[bench]'
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    SIZES,
    child_env,
    comparison_parser,
    posttrain_step_times,
    print_comparison,
    run_comparisons,
    scratch,
    trl_step_timer,
)

PROMPTS, G, NEW, BETA, LR = 8, 8, 32, 0.04, 1e-5


def _prepare(work: Path, size: str) -> Path:
    from posttrain.builtin.build import init_model

    model_dir = work / f"model-{size}"
    if not model_dir.exists():
        init_model(model_dir, **SIZES[size])
    return model_dir


def _run_posttrain(model_dir, steps, setting, out) -> dict:
    from posttrain.trainers.online import RLConfig, run_rl

    kw = dict(model=str(model_dir), output_dir=str(out), algo="grpo", max_steps=steps,
              prompts_per_step=PROMPTS, group_size=G, max_new_tokens=NEW, lr=LR,
              builtin_eval_size=0, eval_every=0, log_every=1, device="cpu",
              tensorboard=False)
    if setting.startswith("identical") or setting in ("compiled", "vllm"):
        kw.update(kl_coef=BETA, minibatch_size=PROMPTS * G, micro_batch_size=PROMPTS * G)
    if setting == "vllm":
        kw.update(rollout_backend="vllm")
    if setting in ("identical_compiled", "compiled"):
        kw.update(compile=True)
    cfg = RLConfig(**kw)
    cfg.validate()
    run_rl(cfg)
    return {"step_s": posttrain_step_times(out)}


def _run_trl(model_dir, steps, setting, out) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.builtin import task
    from posttrain.fast.memory import keep_freed_memory

    if setting == "identical_malloc":
        keep_freed_memory()

    timer, times = trl_step_timer()
    ds = datasets.Dataset.from_list(task.rl_rows(PROMPTS * (steps + 2), "train"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    common = dict(output_dir=str(out), per_device_train_batch_size=PROMPTS * G,
                  num_generations=G, max_completion_length=NEW, max_steps=steps,
                  learning_rate=LR, report_to="none", save_strategy="no", use_cpu=True,
                  disable_tqdm=True, logging_steps=10_000, dataloader_num_workers=0,
                  temperature=1.0)
    if setting.startswith("identical") or setting in ("compiled", "vllm"):
        vllm = dict(use_vllm=setting == "vllm")
        if setting == "vllm":
            vllm.update(vllm_mode="colocate", vllm_enable_sleep_mode=False)
        args = GRPOConfig(**common, beta=BETA, epsilon=0.2, loss_type="grpo",
                          scale_rewards="group", bf16=False, gradient_checkpointing=False,
                          lr_scheduler_type="constant", torch_compile=setting == "compiled",
                          **vllm)
    else:
        args = GRPOConfig(**common)
    trainer = GRPOTrainer(model=model, reward_funcs=[task.reward], args=args,
                          train_dataset=ds, processing_class=tok, callbacks=[timer])
    trainer.train()
    return {"step_s": times}


def _child(impl, size, setting, steps, work) -> int:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model_dir = _prepare(work, size)
    out = Path(tempfile.mkdtemp(prefix=f"{impl}-", dir=work))
    fn = _run_posttrain if impl == "posttrain" else _run_trl
    print("RESULT " + json.dumps(fn(model_dir, steps, setting, out)))
    return 0


def main() -> int:
    args = comparison_parser(__doc__, steps=8).parse_args()
    if args.child:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        return _child(*args.child, args.steps, work)
    with scratch(args.work, "posttrain-grpo-bench-") as work:
        table = run_comparisons(__file__, args, work)
    print_comparison(f"GRPO, {PROMPTS} prompts x {G} completions, {NEW} new tokens, fp32, "
                     f"CPU threads={child_env()['OMP_NUM_THREADS']}, median of "
                     f"{args.repeats} alternating runs (steps {args.warmup + 1}-{args.steps})",
                     table, digits=3, run_time=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
