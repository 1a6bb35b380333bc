"""Reward-model training seconds per optimiser step: posttrain's ``rm`` against TRL's
``RewardTrainer``, same model, pairs and settings, alternating runs in one session.

Settings (``identical``): 16 preference pairs per step, the Bradley–Terry loss without a
margin or centring term, fp32, no gradient checkpointing, lr 1e-5, linear schedule without
warm-up. ``defaults``: the same batch and model with each library's other defaults (TRL's
turn gradient checkpointing on). The model is a causal LM's backbone with a fresh scalar
head (``AutoModelForSequenceClassification``, one label) on both sides.

Models: ``small``, ``medium`` and ``large`` of ``common.SIZES``, random init with the
built-in byte tokenizer; the pairs are the built-in task's. Each run is a fresh subprocess;
per-step times skip the first ``--warmup`` steps; we report the median step, the median
over repeats and their ratio.

Usage: python benchmarks/rm_speed.py [--sizes small medium] [--repeats 3] [--steps 12]
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

PAIRS, LR = 16, 1e-5


def _prepare(work: Path, size: str, steps: int) -> tuple[Path, Path]:
    return preference_inputs(work, size, PAIRS, steps, columns=('prompt', 'chosen', 'rejected'))


def _run_posttrain(model_dir: Path, data: Path, steps: int, setting: str, out: Path) -> dict:
    from posttrain.trainers.offline import RMConfig, run_rm

    cfg = RMConfig(model=str(model_dir), data=str(data), output_dir=str(out), max_steps=steps,
                   batch_size=PAIRS, lr=LR, log_every=1, device="cpu", warmup_ratio=0.0,
                   lr_schedule="linear", tensorboard=False)
    cfg.validate()
    t0 = time.perf_counter()
    run_rm(cfg)
    total = time.perf_counter() - t0
    return {"step_s": posttrain_step_times(out), "total_s": total}


def _run_trl(model_dir: Path, data: Path, steps: int, setting: str, out: Path) -> dict:
    import datasets
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    timer, times = trl_step_timer()
    ds = datasets.load_dataset("json", data_files=str(data), split="train")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    common = dict(output_dir=str(out), per_device_train_batch_size=PAIRS, max_steps=steps,
                  learning_rate=LR, report_to="none", save_strategy="no", use_cpu=True,
                  disable_tqdm=True, logging_steps=10_000, dataloader_num_workers=0)
    if setting == "identical":
        args = RewardConfig(**common, bf16=False, gradient_checkpointing=False,
                            lr_scheduler_type="linear", warmup_steps=0)
    else:
        args = RewardConfig(**common)
    t0 = time.perf_counter()
    trainer = RewardTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                            callbacks=[timer])
    trainer.train()
    return {"step_s": times, "total_s": time.perf_counter() - t0}


def main() -> int:
    args = comparison_parser(__doc__, steps=12).parse_args()
    if args.child:
        args.impl, args.size, args.setting = args.child
        return run_preference_child(args, _prepare, _run_posttrain, _run_trl)
    with scratch(args.work, "posttrain-rm-bench-") as work:
        table = run_comparisons(__file__, args, work)
    print_comparison(f"Reward model, {PAIRS} pairs/step, fp32, CPU threads="
                     f"{child_env()['OMP_NUM_THREADS']}, {args.steps} steps (first "
                     f"{args.warmup} skipped), median of {args.repeats} alternating runs",
                     table, digits=4, run_time=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
