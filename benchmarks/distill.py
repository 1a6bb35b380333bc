"""On-policy distillation against GRPO on the built-in task (docs/algorithms.md §12).

The teacher is the quick start's GRPO model (``posttrain grpo``, defaults, trained here
unless ``--teacher DIR`` names one). Each seed then runs, from the built-in start,
``posttrain grpo`` (the teacher's own recipe: 16 prompts × 8 samples a step), ``posttrain
grpo --group_size 4`` (the samples per step of distill), and ``posttrain distill
--teacher`` (defaults: 16 prompts × 4 samples a step, reverse KL), 60 steps each, evaluated
every 5 steps on the held-out split. Reported: held-out accuracy against the completion
tokens sampled so far, the tokens each needs to reach 85% and 90%, and the final accuracy
(mean ± sd over seeds).

Usage: python benchmarks/distill.py [--seeds 0 1 2] [--teacher DIR] [--out DIR]
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
from pathlib import Path


def _run(command: list[str], out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    subprocess.run([sys.executable, "-m", "posttrain", *command, "--output_dir", str(out),
                    "--tensorboard", "false", "--eval_every", "5", "--log_every", "5",
                    "--overwrite", "true"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def curve(rows: list[dict]) -> list[tuple[int, int, float]]:
    """(step, completion tokens sampled by then, held-out accuracy) at each evaluation."""
    tokens, out = {0: 0}, []
    for r in rows:
        if "samples/tokens_total" in r:
            tokens[r["step"]] = r["samples/tokens_total"]
    for r in rows:
        if "eval/accuracy" in r and r["step"] in tokens:
            out.append((r["step"], tokens[r["step"]], r["eval/accuracy"]))
    return out


def tokens_to(c: list[tuple[int, int, float]], target: float) -> int | None:
    return next((t for _, t, a in c if a >= target), None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--teacher", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="posttrain-distill-"))
    teacher = args.teacher
    if teacher is None:
        rows = _run(["grpo"], out / "teacher")
        teacher = str(out / "teacher" / "final")
        print(json.dumps({"teacher": teacher, "accuracy": curve(rows)[-1][2]}), flush=True)
    runs = {"grpo": ["grpo"], "grpo 16×4": ["grpo", "--group_size", "4"],
            "distill": ["distill", "--teacher", teacher]}
    results: dict[str, list] = {name: [] for name in runs}
    for seed in args.seeds:
        for name, cmd in runs.items():
            c = curve(_run([*cmd, "--seed", str(seed)], out / f"{name.replace(' ', '')}-{seed}"))
            results[name].append(c)
            print(json.dumps({"run": name, "seed": seed, "curve": c}), flush=True)
    print("\n| run | seed | held-out accuracy at steps 0/10/20/30/40/50/60 (tokens) | "
          "tokens to 85% | tokens to 90% | final |")
    print("|---|---|---|---|---|---|")
    for name, curves in results.items():
        for seed, c in zip(args.seeds, curves, strict=True):
            points = ", ".join(f"{a:.3f} ({t:,})" for s, t, a in c if s % 10 == 0)
            print(f"| {name} | {seed} | {points} | {tokens_to(c, 0.85) or '-'} | "
                  f"{tokens_to(c, 0.90) or '-'} | {c[-1][2]:.3f} |")
    print("\n| run | final accuracy mean ± sd | tokens to 85% (median) | tokens (whole run) |")
    print("|---|---|---|---|")
    for name, curves in results.items():
        finals = [c[-1][2] for c in curves]
        reach = [tokens_to(c, 0.85) for c in curves]
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        got = [r for r in reach if r is not None]
        med = f"{statistics.median(got):,.0f} ({len(got)}/{len(reach)} reached)" if got else "-"
        print(f"| {name} | {statistics.mean(finals):.3f} ± {sd:.3f} | {med} | "
              f"{statistics.median(c[-1][1] for c in curves):,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
