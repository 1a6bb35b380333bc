"""Is the built-in reward-model recipe robust to float rounding? The grid: CPU kernels
(``ATEN_CPU_CAPABILITY``) × embedding-gradient mode (``--sparse_embedding_grad``) × seed.

Rounding differs between the cells and nothing else: a kernel sums in another order and at
another vector width, and the embedding trained by rows sums its gradient in another order
than the dense one. A recipe whose outcome moves with them is decided by rounding.

- **rm** cells: ``posttrain rm --seed S --sparse_embedding_grad M`` (the command's defaults on
  the built-in model; configs/builtin/rm.yaml spells the same settings out): held-out
  pairwise accuracy (target ≥ 0.95) and the first logged step whose 10-step mean loss is
  below 0.5 (ln 2 = 0.693 is where the recipe starts);
- **pipeline** cells: ``benchmarks/rlhf_pipeline.py`` (README's sft → rm → ppo) from one SFT
  model per kernel and seed — SFT does not read the mode: the built-in model ties its
  embedding to its head, and a tied embedding is always trained densely — the gain in
  held-out greedy accuracy (target ≥ +30 points).

Each cell runs in a subprocess with ``ATEN_CPU_CAPABILITY`` set; ``--head_init transformers``
runs the recipe with the fresh head drawn as before the fix (transformers' N(0, 0.02²)).

Usage (from the repository root):
    python benchmarks/rm_robustness.py [--kernels default avx2 avx512] [--modes true false]
        [--seeds 0 1 2] [--pipeline all|none|KERNEL:MODE:SEED ...] [--head_init unit_scores]
        [--out DIR]
Prints one markdown table per stage.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import child_env

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], kernel: str, log: Path) -> float:
    """``cmd`` under ``ATEN_CPU_CAPABILITY=kernel`` (output to ``log``); its seconds."""
    env = {**child_env(), "ATEN_CPU_CAPABILITY": kernel}
    t0 = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                              cwd=ROOT).returncode
    if code:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - t0


def capability(kernel: str) -> str:
    """What torch reports it runs under ``ATEN_CPU_CAPABILITY=kernel``."""
    env = {**child_env(), "ATEN_CPU_CAPABILITY": kernel}
    return subprocess.run([sys.executable, "-c", "import torch; print("
                           "torch.backends.cpu.get_cpu_capability())"], env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


def rm_cell(out: Path, kernel: str, mode: str, seed: int, head_init: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    seconds = run([sys.executable, "-m", "posttrain", "rm", f"--seed={seed}",
                   f"--sparse_embedding_grad={mode}", f"--head_init={head_init}",
                   f"--output_dir={out}", "--overwrite=true", "--tensorboard=false"],
                  kernel, out.with_suffix(".log"))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "eval/accuracy" in r][-1]
    below = [r["step"] for r in rows if r.get("train/loss", 1.0) < 0.5]
    return {"accuracy": final["eval/accuracy"], "margin": final["eval/margin"],
            "loss_below_half": below[0] if below else None, "seconds": seconds}


def pipeline_cell(out: Path, sft: Path, kernel: str, mode: str, seed: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    seconds = run([sys.executable, "benchmarks/rlhf_pipeline.py", f"--out={out}",
                   f"--seed={seed}", f"--sft={sft}", f"--sparse_embedding_grad={mode}"],
                  kernel, out.with_suffix(".log"))
    result = json.loads((out / "result.json").read_text())
    return {**result, "seconds": seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", nargs="+", default=["default", "avx2", "avx512"])
    p.add_argument("--modes", nargs="+", default=["true", "false"],
                   help="--sparse_embedding_grad values")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--pipeline", nargs="+", default=["all"],
                   help="all, none, or cells KERNEL:MODE:SEED")
    p.add_argument("--skip_rm", action="store_true", help="pipeline cells only")
    p.add_argument("--head_init", default="unit_scores", choices=["unit_scores", "transformers"])
    p.add_argument("--out", default="runs/bench-rm-robustness")
    args = p.parse_args()
    out = Path(args.out).resolve()
    grid = [(k, m, s) for k in args.kernels for m in args.modes for s in args.seeds]
    caps = {k: capability(k) for k in args.kernels}

    rm_rows = []
    for k, m, s in ([] if args.skip_rm else grid):
        r = rm_cell(out / f"rm-{args.head_init}-{k}-{m}-{s}", k, m, s, args.head_init)
        rm_rows.append((k, m, s, r))
        print(f"rm {k} {m} {s}: {json.dumps(r)}", file=sys.stderr, flush=True)

    wanted = (grid if args.pipeline == ["all"] else [] if args.pipeline == ["none"] else
              [(k, m, int(s)) for k, m, s in (c.split(":") for c in args.pipeline)])
    sft_seconds, pipe_rows = {}, []
    for k, m, s in wanted:
        sft = out / f"sft-{k}-{s}"
        if (k, s) not in sft_seconds:  # one SFT per kernel and seed, shared by both modes
            sft.mkdir(parents=True, exist_ok=True)
            sft_seconds[k, s] = run([sys.executable, "-m", "posttrain", "sft", f"--seed={s}",
                                     f"--output_dir={sft}", "--overwrite=true",
                                     "--tensorboard=false"], k, sft.with_suffix(".log"))
        r = pipeline_cell(out / f"pipeline-{k}-{m}-{s}", sft / "final", k, m, s)
        pipe_rows.append((k, m, s, r))
        print(f"pipeline {k} {m} {s}: {json.dumps(r)}", file=sys.stderr, flush=True)

    if rm_rows:
        print(f"\nReward model, `posttrain rm` defaults, head_init {args.head_init}\n")
        print("| kernel (torch reports) | sparse_embedding_grad | seed | held-out pairwise acc "
              "| mean margin | first step with loss < 0.5 | wall s |")
        print("|---|---|---|---|---|---|---|")
        for k, m, s, r in rm_rows:
            print(f"| {k} ({caps[k]}) | {m} | {s} | **{r['accuracy']:.3f}** | "
                  f"{r['margin']:.1f} | {r['loss_below_half']} | {r['seconds']:.0f} |")
        accs = [r["accuracy"] for *_, r in rm_rows]
        print(f"\nmin {min(accs):.3f}, max {max(accs):.3f} over {len(accs)} cells")
    if pipe_rows:
        print("\nRLHF pipeline sft → rm → ppo (benchmarks/rlhf_pipeline.py)\n")
        steps = " / ".join(str(t) for t, _ in pipe_rows[0][3]["accuracy_curve"])
        print("| kernel (torch reports) | sparse_embedding_grad | seed | RM pairwise acc | "
              f"accuracy at steps {steps} | gain | KL/seq max | wall s |")
        print("|---|---|---|---|---|---|---|---|")
        for k, m, s, r in pipe_rows:
            curve = " / ".join(f"{100 * a:.1f}" for _, a in r["accuracy_curve"])
            gain = 100 * (r["accuracy_after"] - r["accuracy_before"])
            print(f"| {k} ({caps[k]}) | {m} | {s} | {r['rm_eval_accuracy']:.3f} | {curve} | "
                  f"**{gain:+.1f}** | {r['kl_seq_max']:.2f} | {r['seconds']:.0f} |")
        print("\nSFT per kernel and seed, s: "
              + ", ".join(f"{k}/{s} {v:.0f}" for (k, s), v in sft_seconds.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
