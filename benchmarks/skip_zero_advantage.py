"""What skipping zero-advantage samples saves: the same dr_grpo run (β = 0, so a sample with
zero advantage adds nothing to the gradient) with and without the skip, alternating. The
runs without it withdraw the policy loss's declaration that a zero advantage gives a zero
gradient (``PolicyLoss.zero_advantage_zero_gradient``), which is what the trainer reads.

Usage: python benchmarks/skip_zero_advantage.py [--steps 60] [--repeats 2]
Prints the median training time per step (update phase only), the share of samples that went
through the backward pass, and the final held-out accuracy of each run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

from posttrain.core import algorithms
from posttrain.trainers.online import RLConfig, run_rl


def _declared(skip: bool) -> None:
    """The table's losses with (skip) or without the zero-advantage declaration."""
    for name, loss in list(algorithms.POLICY_LOSSES.items()):
        algorithms.POLICY_LOSSES[name] = dataclasses.replace(
            loss, zero_advantage_zero_gradient=skip)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--algo", default="dr_grpo")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="posttrain-skip-"))
    res = {True: [], False: []}
    for rep in range(args.repeats):
        for skip in ((True, False) if rep % 2 == 0 else (False, True)):
            out = work / f"{skip}-{rep}"
            cfg = RLConfig(algo=args.algo, output_dir=str(out), overwrite=True,
                           max_steps=args.steps,
                           eval_every=0, log_every=1, device="cpu", tensorboard=False)
            cfg.validate()
            _declared(skip)
            final = run_rl(cfg)
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            rows = [r for r in rows if "time/update_s" in r]
            res[skip].append((sum(r["time/update_s"] for r in rows),
                              statistics.mean(r["samples/backward_frac"] for r in rows),
                              final["eval/accuracy"]))
    print(f"{args.algo}, {args.steps} steps, median of {args.repeats} alternating runs")
    print("| skip zero-advantage samples | update seconds (total) | samples through backward "
          "| final accuracy |")
    print("|---|---|---|---|")
    for skip in (False, True):
        t = statistics.median(x[0] for x in res[skip])
        f = statistics.median(x[1] for x in res[skip])
        a = statistics.median(x[2] for x in res[skip])
        print(f"| {'yes' if skip else 'no'} | {t:.2f} | {f:.0%} | {a:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
