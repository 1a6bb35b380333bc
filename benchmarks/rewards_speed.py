"""Rewards that cost time: ``math`` calls per second, and what a reward that hangs adds to a
GRPO step under ``--reward_timeout`` (target: a reward that sleeps 10 s under
``--reward_timeout 1`` adds ≤ 2 s to its step). Sandboxed executions per second are
``benchmarks/sandbox_speed.py``.

- **math**: ``math_reward`` over data/math.jsonl's equivalent and different forms (220
  completions), one call per completion on one thread, then the whole list in one call;
  repeated, medians.
- **timeout**: ``posttrain grpo`` on the built-in task for ``--steps`` steps, its reward the
  built-in exact answer except at one step, where the call sleeps 10 s first; with
  ``--reward_timeout 1 --on_reward_error zero``. Added seconds = that step's time minus the
  median of the others.

Usage: python benchmarks/rewards_speed.py [--repeats 5] [--steps 8] [--out runs/bench-rewards]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOW_STEP = 4
"""The step whose reward call sleeps (the run's reward is also called by the evaluation
before step 1, hence the count below)."""

_calls = {"n": 0}


def sleepy_reward(prompts, completions, answer, **_):
    """The built-in exact answer; the reward call of step SLOW_STEP sleeps 10 s first."""
    from posttrain.builtin import task

    _calls["n"] += 1
    if _calls["n"] == SLOW_STEP + 1:  # (+1: the evaluation before the first step)
        time.sleep(10)
    return task.reward(prompts, completions, answer)


def bench_math(repeats: int) -> dict:
    from posttrain.rewards import math_reward

    rows = [json.loads(x) for x in (ROOT / "data/math.jsonl").read_text().splitlines()]
    pairs = [(f"\\boxed{{{f}}}", r["answer"]) for r in rows
             for f in r["equivalent"] + r["different"]]
    one, batch = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for c, a in pairs:
            math_reward([""], [c], [a])
        one.append(len(pairs) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        math_reward([""] * len(pairs), [c for c, _ in pairs], [a for _, a in pairs])
        batch.append(len(pairs) / (time.perf_counter() - t0))
    return {"completions": len(pairs), "per_s_one_call_each": statistics.median(one),
            "per_s_one_call": statistics.median(batch)}


def bench_timeout(steps: int, out: Path) -> dict:
    from posttrain.trainers.online import RLConfig, run_rl

    cfg = RLConfig(output_dir=str(out), overwrite=True, max_steps=steps, log_every=1,
                   device="cpu", tensorboard=False,
                   reward=f"{Path(__file__).resolve()}:sleepy_reward", reward_timeout=1.0,
                   on_reward_error="zero")
    cfg.given = {"reward", "reward_timeout", "on_reward_error"}
    cfg.validate()
    run_rl(cfg)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = {r["step"]: r["time/step_s"] for r in rows if "time/step_s" in r}
    others = [v for k, v in step_s.items() if k != SLOW_STEP]
    slow = next(r for r in rows if r.get("step") == SLOW_STEP and "time/step_s" in r)
    return {"slow_step_s": step_s[SLOW_STEP], "median_other_step_s": statistics.median(others),
            "added_s": step_s[SLOW_STEP] - statistics.median(others),
            "failed_share_at_slow_step": slow.get("reward/sleepy_reward_failed")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="runs/bench-rewards")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    m = bench_math(args.repeats)
    print(f"math: {m['completions']} completions; {m['per_s_one_call_each']:.0f}/s one call "
          f"each, {m['per_s_one_call']:.0f}/s in one call (medians of {args.repeats})")
    t = bench_timeout(args.steps, Path(args.out) / "timeout")
    print(f"timeout: step {SLOW_STEP} (reward sleeps 10 s, reward_timeout 1) took "
          f"{t['slow_step_s']:.2f} s against a median {t['median_other_step_s']:.2f} s: "
          f"+{t['added_s']:.2f} s (target ≤ 2); its samples failed: "
          f"{t['failed_share_at_slow_step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
