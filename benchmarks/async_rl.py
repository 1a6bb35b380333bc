"""Asynchronous rollouts (``--async_staleness 1``) against the synchronous loop, the same
settings and seeds, alternating runs in one session (each a fresh ``posttrain grpo``
subprocess).

Throughput (``--part speed``), each case synchronous, K=1 with ``--async_cores split`` and
K=1 with ``--async_cores adaptive`` (a producer process): on the built-in multi-turn task
(``--env builtin``, 16 prompts × 8 episodes per step, two turns each) with the environment
waiting ``L`` seconds per call (``LookupEnv(latency_s=L)``, the turn's calls run at once:
``--env_workers 128``); with a slow environment that is the bottleneck (8 × 8 episodes,
``--ppo_epochs 4``, 50 ms a call with 16 served at once, or 200 ms with all at once); and
on GRPO at ~25M parameters (the ``medium`` model of the side-by-side benchmarks, random
init, 8 prompts × 8 completions of up to 32 tokens). Reported: median seconds per step
(skipping two), episodes/s and sampled tokens/s, and the idle time per phase: the learner
waiting for a batch (synchronous: the whole generation), the engine waiting for weights
(synchronous: the whole update).

Accuracy (``--part accuracy``): the default ``posttrain grpo`` (built-in single-turn
task) and ``posttrain grpo --env builtin`` to the end of their default budget, seeds 0-2,
synchronous and K=1 with either core mode: held-out accuracy, the completion tokens and
seconds spent.

Usage: python benchmarks/async_rl.py [--part speed accuracy] [--repeats 3]
       [--cases episodes slow medium] [--latencies 0 0.05 0.1] [--steps 12]
Prints one JSON line per run and Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import SIZES


def _grpo(out: Path, args: list[str]) -> tuple[list[dict], float]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--output_dir", str(out),
                    "--device", "cpu", "--tensorboard", "false", *args], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, wall


def _speed(rows: list[dict], episodes: int, skip: int = 2) -> dict[str, float]:
    steps = [r for r in rows if "time/step_s" in r][skip:]
    tokens = {r["step"]: r["samples/tokens_total"] for r in rows if "samples/tokens_total" in r}
    per_step = [tokens[r["step"]] - tokens[r["step"] - 1] for r in steps
                if r["step"] - 1 in tokens]
    step_s = statistics.median(r["time/step_s"] for r in steps)
    sync = not any("time/learner_wait_s" in r for r in steps)

    def med(f):
        return statistics.median(f(r) for r in steps)

    return {
        "step_s": step_s, "episodes_per_s": episodes / step_s,
        "tokens_per_s": statistics.median(per_step) / step_s if per_step else float("nan"),
        # what each side waits for per step: in the synchronous loop the learner waits for
        # the whole rollout and the engine for the whole update
        "learner_idle_s": med(lambda r: r["time/generate_s"] + r["time/reward_s"]) if sync
        else med(lambda r: r["time/learner_wait_s"]),
        "engine_idle_s": med(lambda r: r["time/passes_s"] + r["time/update_s"]
                             + r["time/sync_s"]) if sync
        else med(lambda r: r["time/producer_idle_s"]),
        "env_s": med(lambda r: r.get("time/env_s", 0.0)),
    }


MODES = {"sync": ["--async_staleness", "0"],
         "K=1 split": ["--async_staleness", "1", "--async_cores", "split"],
         "K=1 adaptive": ["--async_staleness", "1", "--async_cores", "adaptive"]}


def speed(args, work: Path) -> list[dict]:
    from posttrain.builtin.build import init_model

    medium = work / "medium"
    if "medium" in args.cases:
        init_model(medium, **SIZES["medium"])
    cases = []
    quick = ["--max_steps", str(args.steps), "--eval_every", "0", "--builtin_eval_size", "0",
             "--log_every", "1"]
    if "episodes" in args.cases:
        for lat in args.latencies:
            cases.append((f"episodes 16×8, L={lat * 1000:g} ms, 128 at once", 16 * 8, [
                "--env", "builtin", "--env_kwargs", json.dumps({"latency_s": lat}),
                "--env_workers", "128", *quick]))
    if "slow" in args.cases:
        # an environment that is the bottleneck: each call waits, and the update (4 epochs
        # over the batch, as PPO takes) is about as long as the rollout's waits
        for lat, workers in ((0.05, 16), (0.2, 128)):
            cases.append((f"slow env 8×8, L={lat * 1000:g} ms, {workers} at once, "
                           "ppo_epochs 4", 8 * 8, [
                               "--env", "builtin", "--env_kwargs",
                               json.dumps({"latency_s": lat}), "--env_workers", str(workers),
                               "--prompts_per_step", "8", "--ppo_epochs", "4", *quick]))
    if "medium" in args.cases:
        cases.append(("grpo ~25M (8 × 8, 32 tokens)", 8 * 8, [
            "--model", str(medium), "--prompts_per_step", "8", "--group_size", "8",
            "--max_new_tokens", "32", "--lr", "1e-5", "--max_steps", str(min(args.steps, 8)),
            "--eval_every", "0", "--builtin_eval_size", "0", "--log_every", "1"]))
    results = []
    for name, episodes, case in cases:
        for rep in range(args.repeats):
            order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))  # alternate
            for mode in order:
                out = work / f"run-{len(results)}"
                rows, _ = _grpo(out, [*case, *MODES[mode]])
                r = {"case": name, "mode": mode, "repeat": rep, **_speed(rows, episodes)}
                print(json.dumps(r), flush=True)
                results.append(r)
    print("\n| case | sync s/step | K=1 split | K=1 adaptive | episodes/s sync → split → "
          "adaptive | ratio split | ratio adaptive | tokens/s sync → split → adaptive | "
          "learner idle/step sync → split → adaptive | engine idle/step sync → split → "
          "adaptive |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, _, _ in cases:
        part = [r for r in results if r["case"] == name]

        def m(mode, key, part=part):
            return statistics.median(r[key] for r in part if r["mode"] == mode)

        def row(key, fmt):
            return " → ".join(format(m(mode, key), fmt) for mode in MODES)

        eps = {mode: m(mode, "episodes_per_s") for mode in MODES}
        print(f"| {name} | {m('sync', 'step_s'):.3f} | {m('K=1 split', 'step_s'):.3f} | "
              f"{m('K=1 adaptive', 'step_s'):.3f} | {row('episodes_per_s', '.0f')} | "
              f"{eps['K=1 split'] / eps['sync']:.2f}× | "
              f"**{eps['K=1 adaptive'] / eps['sync']:.2f}×** | {row('tokens_per_s', '.0f')} | "
              f"{row('learner_idle_s', '.3f')} | {row('engine_idle_s', '.3f')} |")
    return results


def accuracy(args, work: Path) -> list[dict]:
    tasks = {"single-turn": [], "multi-turn": ["--env", "builtin"]}
    results = []
    for task, extra in tasks.items():
        for seed in (0, 1, 2):
            for mode, flags in MODES.items():
                out = work / f"acc-{task}-{seed}-{len(results)}"
                rows, wall = _grpo(out, [*extra, "--seed", str(seed), *flags])
                last = [r for r in rows if "eval/accuracy" in r][-1]
                spent = [r for r in rows if "samples/tokens_total" in r][-1]
                r = {"task": task, "seed": seed, "mode": mode,
                     "accuracy": last["eval/accuracy"], "tokens": spent["samples/tokens_total"],
                     "train_s": spent["time/train_s"], "wall_s": wall}
                print(json.dumps(r), flush=True)
                results.append(r)
    print("\n| task | mode | held-out accuracy (seeds 0-2) | mean ± sd | tokens | train s |")
    print("|---|---|---|---|---|---|")
    for task in tasks:
        for mode in MODES:
            part = [r for r in results if r["task"] == task and r["mode"] == mode]
            accs = [r["accuracy"] for r in part]
            print(f"| {task} | {mode} | {', '.join(f'{a:.3f}' for a in accs)} | "
                  f"{statistics.mean(accs):.3f} ± {statistics.stdev(accs):.3f} | "
                  f"{statistics.mean(r['tokens'] for r in part):.0f} | "
                  f"{statistics.median(r['train_s'] for r in part):.1f} |")
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", nargs="+", default=["speed", "accuracy"],
                   choices=["speed", "accuracy"])
    p.add_argument("--cases", nargs="+", default=["episodes", "slow", "medium"],
                   choices=["episodes", "slow", "medium"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latencies", type=float, nargs="+", default=[0.0, 0.05, 0.1])
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="posttrain-async-") as tmp:
        work = Path(tmp)
        if "speed" in args.part:
            speed(args, work)
        if "accuracy" in args.part:
            accuracy(args, work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
