"""The RLHF pipeline on the built-in task, sft -> rm -> ppo, with the figures the README quotes.

1. SFT of the built-in model on the built-in (flawed) demonstrations (`posttrain sft`
   defaults): the starting policy, still at its plateau;
2. a Bradley–Terry reward model on the built-in preference pairs, from the SFT model
   (configs/builtin/rm.yaml);
3. PPO with actor, critic (initialised from the reward model), frozen reference (the SFT
   model) and the reward model as the only reward (configs/builtin/ppo.yaml).

Reported: held-out greedy task accuracy (exact answer; never a training signal here) and the
reward model's mean score before and after PPO, the mean per-sequence KL to the reference
(k1, nats) at every step — its maximum and last value — and the wall time of each stage.

``--rollout_backend vllm`` samples the PPO stage through vLLM (run it in the vLLM
environment, docs/engines.md); ``--rollout_backend vllm_server --launch_rollout_servers N``
through N vLLM servers the PPO run launches; the default is the lean engine.

``--sft DIR`` starts from that SFT model instead of training one (benchmarks/rm_robustness.py
reuses one SFT per seed); ``--sparse_embedding_grad`` is passed to the reward model and PPO.
The figures also go to ``OUT/result.json``.

Usage (from the repository root): python benchmarks/rlhf_pipeline.py [--out DIR] [--seed N]
       [--rollout_backend auto|lean|hf|vllm|vllm_server] [--launch_rollout_servers N]
       [--sft DIR] [--sparse_embedding_grad true|false]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from posttrain import config
from posttrain.trainers.offline import RMConfig, SFTConfig, run_rm, run_sft
from posttrain.trainers.online import PPOConfig, run_rl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench-rlhf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollout_backend", default="auto")
    p.add_argument("--launch_rollout_servers", type=int, default=0)
    p.add_argument("--sft", default=None, help="an SFT model to start from (skips stage 1)")
    p.add_argument("--sparse_embedding_grad", default="true")
    args = p.parse_args()
    out = Path(args.out)
    seed = f"--seed={args.seed}"
    again = "--overwrite=true"  # a rerun into the same --out replaces the earlier one
    rows_mode = f"--sparse_embedding_grad={args.sparse_embedding_grad}"
    times = {}

    sft = args.sft or f"{out}/sft/final"
    if args.sft is None:
        t0 = time.perf_counter()
        run_sft(config.load(SFTConfig, None, [f"--output_dir={out}/sft", seed, again,
                                               "--tensorboard=false"]))
        times["sft"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    rm = run_rm(config.load(RMConfig, "configs/builtin/rm.yaml",
                            [f"--model={sft}", f"--output_dir={out}/rm", seed, again,
                             "--tensorboard=false", rows_mode]))
    times["rm"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    run_rl(config.load(PPOConfig, "configs/builtin/ppo.yaml",
                       [f"--model={sft}", f"--reward=rm:{out}/rm/final",
                        f"--output_dir={out}/ppo", seed, again, "--tensorboard=false",
                        "--log_every=1", f"--rollout_backend={args.rollout_backend}",
                        rows_mode, *([f"--launch_rollout_servers={args.launch_rollout_servers}"]
                                     if args.launch_rollout_servers else [])]))
    times["ppo"] = time.perf_counter() - t0

    rows = [json.loads(x) for x in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    kl = [r["kl/seq_mean"] for r in rows if "kl/seq_mean" in r]
    result = {
        "rm_eval_accuracy": rm["eval/accuracy"],
        "accuracy_curve": [(r["step"], round(r["eval/accuracy"], 3)) for r in evals],
        "accuracy_before": evals[0]["eval/accuracy"], "accuracy_after": evals[-1]["eval/accuracy"],
        "rm_score_before": evals[0]["eval/mean_reward"],
        "rm_score_after": evals[-1]["eval/mean_reward"],
        "kl_seq_max": max(kl), "kl_seq_last": kl[-1],
        "ppo_train_seconds": sum(r["time/step_s"] for r in rows if "time/step_s" in r),
        "stage_seconds": {k: round(v, 1) for k, v in times.items()},
    }
    print(json.dumps(result, indent=2))
    (out / "result.json").write_text(json.dumps(result))
    print(f"| accuracy {100 * result['accuracy_before']:.1f}% -> "
          f"{100 * result['accuracy_after']:.1f}% | RM score {result['rm_score_before']:.2f} -> "
          f"{result['rm_score_after']:.2f} | KL/seq max {result['kl_seq_max']:.2f}, last "
          f"{result['kl_seq_last']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
