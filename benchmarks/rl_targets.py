"""Online RL from the built-in model: held-out greedy accuracy against training time for
grpo, dapo and gspo (target: +25 points within 5 minutes on 2 CPU cores), with learning
curves saved as PNG.

Usage: python benchmarks/rl_targets.py [--algos grpo dapo gspo] [--steps 60] [--eval-every 10]
       [--out runs/bench-rl]
Writes OUT/<algo>/metrics.jsonl, OUT/curves.png and prints a table. Needs matplotlib for the
PNG (pip install -e '.[bench]').
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from posttrain.trainers.online import RLConfig, run_rl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algos", nargs="+", default=["grpo", "dapo", "gspo"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--out", default="runs/bench-rl")
    args = p.parse_args()
    curves = {}
    for algo in args.algos:
        out = Path(args.out) / algo
        cfg = RLConfig(algo=algo, output_dir=str(out), overwrite=True, max_steps=args.steps,
                       eval_every=args.eval_every, log_every=1, device="cpu",
                       tensorboard=False)
        cfg.validate()
        run_rl(cfg)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        elapsed, points = 0.0, []
        for r in rows:
            elapsed += r.get("time/step_s", 0.0)
            if "eval/accuracy" in r:
                points.append((r["step"], elapsed, r["eval/accuracy"]))
        curves[algo] = points
    print("| algorithm | accuracy at step 0 | final accuracy | gain (points) | train seconds |")
    print("|---|---|---|---|---|")
    for algo, pts in curves.items():
        print(f"| {algo} | {pts[0][2]:.1%} | {pts[-1][2]:.1%} | "
              f"{100 * (pts[-1][2] - pts[0][2]):+.1f} | {pts[-1][1]:.0f} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, pts in curves.items():
        ax.plot([t for _, t, _ in pts], [a for _, _, a in pts], marker="o", label=algo)
    ax.set_xlabel("training seconds (generate + score + update, 2 CPU cores)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("Online RL from the built-in model")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = Path(args.out) / "curves.png"
    fig.savefig(png, dpi=120)
    print(f"curves: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
