"""Weak scaling of the data-parallel trainers on the CPU: N ranks of one thread each, each
with the per-rank work of a one-rank, one-thread run, against that run (gloo).

    python benchmarks/weak_scaling.py [--command sft|rm|dpo|grpo] [--size medium]
        [--ranks 2] [--per_rank_batch 8] [--repeats 3] [--steps 12]

``--per_rank_batch`` is examples (offline) or prompts (grpo: 8 completions of up to 16 new
tokens each) per rank.

Prints the median step time (steps 3 onwards) of each layout, alternating them run by run,
and their ratio: 1.0 is perfect weak scaling; the excess is the cost of the gradient
all-reduce and the step's other collectives (plus two processes sharing the machine's
memory bandwidth).
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

from common import SIZES, scratch


def _run(command: str, model: Path, ranks: int, batch: int, steps: int, work: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(ranks)] if ranks > 1 else [sys.executable])
    size = (["--prompts_per_step", str(batch), "--group_size", "8", "--max_new_tokens", "16",
             "--eval_every", "0"] if command == "grpo" else ["--batch_size", str(batch)])
    args = ["-m", "posttrain", command, "--model", str(model), *size,
            "--max_steps", str(steps), "--log_every", "1", "--device", "cpu",
            "--tensorboard", "false", "--builtin_train_size", "512", "--builtin_eval_size", "16",
            "--output_dir", str(out)]
    proc = subprocess.run([*launch, *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median([r["time/step_s"] for r in rows if "time/step_s" in r][2:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--command", default="sft", choices=["sft", "rm", "dpo", "grpo"])
    p.add_argument("--size", default="medium", choices=list(SIZES))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--per_rank_batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    with scratch(None, "posttrain-weak-") as work:
        return _measure(args, work)


def _measure(args, work: Path) -> int:
    from posttrain.builtin.build import init_model

    model = work / "model"
    init_model(model, **SIZES[args.size])
    runs: dict[int, list[float]] = {1: [], args.ranks: []}
    for rep in range(args.repeats):
        for ranks in ((1, args.ranks) if rep % 2 == 0 else (args.ranks, 1)):
            runs[ranks].append(_run(args.command, model, ranks, args.per_rank_batch * ranks,
                                    args.steps, work))
            print(f"rep {rep} ranks {ranks}: {runs[ranks][-1]:.4f} s/step", file=sys.stderr)
    one, many = (statistics.median(runs[k]) for k in (1, args.ranks))
    print(f"| {args.command} | {args.size} | {args.per_rank_batch} per rank | 1 rank "
          f"{one:.4f} s/step | {args.ranks} ranks {many:.4f} s/step | {many / one:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
