"""Show that the built-in model sits on a plateau: more SFT on the same (flawed)
demonstrations does not raise its greedy accuracy, while the same amount of SFT on clean
demonstrations does — so the model can learn the task, and the flaw is what holds it back.
That is the gap RL with a verifiable reward is meant to close.

Usage: python benchmarks/builtin_plateau.py [--steps 600] [--every 200] [--n-eval 1000]
Prints a table of held-out greedy accuracy against extra SFT steps for both data sets.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from posttrain.builtin import task
from posttrain.builtin.build import SFT
from posttrain.evaluate import evaluate_policy
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.trainers.offline import SFTConfig, run_sft


def accuracy(model_dir: str, n: int) -> float:
    model = load_causal_lm(model_dir, device="cpu")
    return evaluate_policy(model, load_tokenizer(model_dir), task.rl_rows(n, "eval"),
                           task.reward, max_new_tokens=6)["accuracy"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--n-eval", type=int, default=1000)
    p.add_argument("--work", default=None)
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="posttrain-plateau-"))
    work.mkdir(parents=True, exist_ok=True)
    start = accuracy("builtin", args.n_eval)
    curves = {}
    for name, flaw_rate in (("same flawed demonstrations", None), ("clean demonstrations", 0.0)):
        kw = {} if flaw_rate is None else {"flaw_rate": flaw_rate}
        rows = task.sft_rows(args.steps * SFT["batch_size"], "train", seed=1, **kw)
        data = work / f"{'clean' if flaw_rate == 0.0 else 'flawed'}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = work / data.stem
        cfg = SFTConfig(data=str(data), output_dir=str(out), overwrite=True, max_steps=args.steps,
                        save_every=args.every, lr=args.lr, lr_schedule="constant",
                        warmup_ratio=0.0, batch_size=SFT["batch_size"], log_every=100,
                        device="cpu", tensorboard=False)
        cfg.validate()
        run_sft(cfg)
        curve = [(0, start)]
        for step in range(args.every, args.steps, args.every):
            curve.append((step, accuracy(str(out / f"checkpoint-{step}"), args.n_eval)))
        curve.append((args.steps, accuracy(str(out / "final"), args.n_eval)))
        curves[name] = curve
    print(f"Held-out greedy accuracy of the built-in model under extra SFT "
          f"(lr {args.lr}, batch {SFT['batch_size']}, n={args.n_eval})")
    steps = [s for s, _ in next(iter(curves.values()))]
    print("| extra SFT steps | " + " | ".join(str(s) for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for name, curve in curves.items():
        print(f"| {name} | " + " | ".join(f"{a:.1%}" for _, a in curve) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
