"""DPO seconds per optimiser step: posttrain against TRL's ``DPOTrainer``, same model, data
and settings, alternating runs in one session.

Settings compared (16 pairs per step, fp32, CPU):

- ``identical``: reference forward every step on both (posttrain ``precompute_ref=False``,
  TRL ``precompute_ref_log_probs=False``), no gradient checkpointing, same lr, β, loss;
- ``defaults``: each library's defaults for the rest (posttrain caches the reference
  log-probs up front; TRL's defaults turn gradient checkpointing on). Time spent on the cache
  is reported separately.

Models: ``small`` (~0.5M parameters: hidden 128, 2 layers) and ``medium`` (~25M: hidden 512,
8 layers), built-in byte tokenizer, random init. Data: the built-in task's preference pairs.
Each run is a fresh subprocess; per-step times skip the first ``--warmup`` steps and we
report the median step, then the median over repeats, and the ratio TRL / posttrain.

Usage: python benchmarks/dpo_speed.py [--sizes small medium] [--repeats 3] [--steps 12]
Needs the bench extra: pip install -e '.[bench]'
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    child_env,
    comparison_parser,
    posttrain_step_times,
    preference_inputs,
    print_comparison,
    run_comparisons,
    run_preference_child,
    scratch,
    trl_step_timer,
)

PAIRS, LR, BETA = 16, 1e-5, 0.1


def _prepare(work: Path, size: str, steps: int) -> tuple[Path, Path]:
    return preference_inputs(work, size, PAIRS, steps)


def _run_posttrain(model_dir: Path, data: Path, steps: int, setting: str, out: Path) -> dict:
    from posttrain.trainers.offline import DPOConfig, run_dpo

    cfg = DPOConfig(model=str(model_dir), data=str(data), output_dir=str(out), max_steps=steps,
                    batch_size=PAIRS, lr=LR, beta=BETA, log_every=1, device="cpu",
                    warmup_ratio=0.0, precompute_ref=(setting == "defaults"),
                    tensorboard=False)
    cfg.validate()
    t0 = time.perf_counter()
    run_dpo(cfg)
    total = time.perf_counter() - t0
    return {"step_s": posttrain_step_times(out), "total_s": total}


def _run_trl(model_dir: Path, data: Path, steps: int, setting: str, out: Path) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    timer, times = trl_step_timer()
    ds = datasets.load_dataset("json", data_files=str(data), split="train")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    common = dict(output_dir=str(out), per_device_train_batch_size=PAIRS, max_steps=steps,
                  learning_rate=LR, beta=BETA, report_to="none", save_strategy="no",
                  use_cpu=True, disable_tqdm=True, logging_steps=10_000,
                  dataloader_num_workers=0)
    if setting == "identical":
        args = DPOConfig(**common, bf16=False, gradient_checkpointing=False,
                         precompute_ref_log_probs=False, lr_scheduler_type="linear",
                         warmup_steps=0)
    else:
        args = DPOConfig(**common)
    t0 = time.perf_counter()
    trainer = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                         callbacks=[timer])
    trainer.train()
    return {"step_s": times, "total_s": time.perf_counter() - t0}


def main() -> int:
    args = comparison_parser(__doc__, steps=12).parse_args()
    if args.child:
        args.impl, args.size, args.setting = args.child
        return run_preference_child(args, _prepare, _run_posttrain, _run_trl)

    with scratch(args.work, "posttrain-dpo-bench-") as work:
        table = run_comparisons(__file__, args, work)
    print_comparison(f"DPO, {PAIRS} pairs/step, fp32, CPU threads="
                     f"{child_env()['OMP_NUM_THREADS']}, {args.steps} steps (first "
                     f"{args.warmup} skipped), median of {args.repeats} alternating runs",
                     table, digits=4, run_time=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
