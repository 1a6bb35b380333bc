"""Measure the offline targets on the built-in model and task:

Settings: the commands' defaults, with no config file (what `posttrain rm` and `posttrain dpo`
run with no arguments).

- reward model: held-out pairwise accuracy (target ≥ 0.90);
- DPO: held-out implicit-reward accuracy (target ≥ 0.90) and the greedy task accuracy of
  the policy before and after (target: +10 points).

Usage: python benchmarks/offline_targets.py [--out DIR] [--rm-steps N] [--dpo-steps N]
Prints one JSON object with the figures and the wall time of each run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from posttrain import config
from posttrain.builtin import task
from posttrain.evaluate import evaluate_policy
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.trainers.offline import DPOConfig, RMConfig, run_dpo, run_rm


def greedy_accuracy(model_dir: str, n: int) -> float:
    model = load_causal_lm(model_dir, device="cpu")
    tok = load_tokenizer(model_dir)
    return evaluate_policy(model, tok, task.rl_rows(n, "eval"), task.reward,
                           max_new_tokens=6)["accuracy"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench-offline")
    p.add_argument("--rm-steps", type=int, default=0, help="0: the config's epochs")
    p.add_argument("--dpo-steps", type=int, default=0)
    p.add_argument("--n-eval", type=int, default=1000)
    args = p.parse_args()
    result = {}

    t0 = time.perf_counter()
    rm = config.load(RMConfig, None,
                     [f"--output_dir={args.out}/rm", f"--max_steps={args.rm_steps}",
                      "--overwrite=true"])
    m = run_rm(rm)
    result["rm"] = {"eval_accuracy": m["eval/accuracy"], "eval_margin": m["eval/margin"],
                    "seconds": time.perf_counter() - t0}

    before = greedy_accuracy("builtin", args.n_eval)
    t0 = time.perf_counter()
    dpo = config.load(DPOConfig, None,
                      [f"--output_dir={args.out}/dpo", f"--max_steps={args.dpo_steps}",
                       "--overwrite=true"])
    m = run_dpo(dpo)
    seconds = time.perf_counter() - t0
    after = greedy_accuracy(f"{args.out}/dpo/final", args.n_eval)
    result["dpo"] = {"eval_reward_accuracy": m["eval/reward_accuracy"],
                     "greedy_accuracy_before": before, "greedy_accuracy_after": after,
                     "gain_points": 100 * (after - before), "seconds": seconds}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
