"""Step time of two builds of posttrain side by side: GRPO and DPO at identical settings,
each build run through its own benchmark child (``grpo_speed.py`` / ``dpo_speed.py
--child posttrain SIZE identical``) in a fresh subprocess, the builds alternating run by run.

    python benchmarks/build_compare.py --base fdeb283 [--head WORKTREE_OR_REV]
        [--benches grpo dpo] [--sizes small medium] [--repeats 4]

``--base``/``--head`` are git revisions (checked out into temporary worktrees) or ``.`` for
the working tree (the default head). Prints, per benchmark and size, each build's median
step time over repeats, the ratio of medians, and the median and range of the per-repeat
ratios (two runs made back to back), as the shared machine's speed drifts within minutes.
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

from common import child_env, spawn

ROOT = Path(__file__).resolve().parent.parent
STEPS = {"grpo": 8, "dpo": 20}


def _tree(rev: str, work: Path) -> Path:
    if rev == ".":
        return ROOT
    path = work / f"tree-{rev}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                       check=True, capture_output=True)
    return path


def _run(tree: Path, bench: str, size: str, work: Path) -> float:
    env = {**child_env(), "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, str(tree / "benchmarks" / f"{bench}_speed.py"), "--child",
           "posttrain", size, "identical", "--steps", str(STEPS[bench]), "--work",
           str(work / f"{bench}-{tree.name}")]
    out, err, code, _ = spawn(cmd, env)
    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if code != 0 or not line:
        print(out[-2000:], err[-4000:], file=sys.stderr)
        raise SystemExit(f"{tree} {bench} {size} failed")
    return statistics.median(json.loads(line[0][7:])["step_s"][2:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--head", default=".")
    p.add_argument("--benches", nargs="+", default=["grpo", "dpo"], choices=list(STEPS))
    p.add_argument("--sizes", nargs="+", default=["small", "medium"])
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="posttrain-builds-"))
    trees = {"base": _tree(args.base, work), "head": _tree(args.head, work)}
    print(f"| bench | model | base {args.base} s/step | head {args.head} s/step | "
          "head/base (medians) | per-repeat head/base |")
    print("|---|---|---|---|---|---|")
    try:
        for bench in args.benches:
            for size in args.sizes:
                runs: dict[str, list[float]] = {"base": [], "head": []}
                for rep in range(args.repeats):
                    for name in (("base", "head") if rep % 2 == 0 else ("head", "base")):
                        runs[name].append(_run(trees[name], bench, size, work))
                        print(f"{bench} {size} rep {rep} {name}: {runs[name][-1]:.4f} s/step",
                              file=sys.stderr)
                med = {k: statistics.median(v) for k, v in runs.items()}
                ratios = sorted(h / b for h, b in zip(runs["head"], runs["base"], strict=True))
                print(f"| {bench} | {size} | {med['base']:.4f} | {med['head']:.4f} | "
                      f"{med['head'] / med['base']:.3f} | {statistics.median(ratios):.3f} "
                      f"({ratios[0]:.3f}-{ratios[-1]:.3f}) |", flush=True)
    finally:
        for tree in trees.values():
            if tree != ROOT and os.path.exists(tree):
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(tree)], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
