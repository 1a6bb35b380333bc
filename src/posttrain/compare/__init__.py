"""``posttrain compare``: the algorithms side by side on the built-in task, from the same start
under the same budget, over several seeds, written up as a Markdown report with learning
curves.

Every algorithm starts from the built-in SFT'd model (the ``sft`` row is that start,
evaluated) and trains until it has spent the budget: ``--budget tokens`` ends each run after
the step that takes its completion tokens past ``--tokens`` (RL: every token sampled;
DPO: the chosen and rejected completions trained on), ``--budget seconds`` after
``--seconds`` of training steps. Each run is scored at the end on one fixed held-out set for
the table: greedy accuracy, mean reward, and the KL divergence of the trained policy from
the start on its own samples of the held-out prompts. With ``--moe true`` (the default) it
also trains a mixture-of-experts policy upcycled from the built-in model, sampled in
bfloat16 and trained in float32, with GRPO and GSPO, each with and without routing replay
(R3), to ask whether replay or GSPO's sequence-level ratio makes it steadier; ``--moe``
alone (or ``--moe only``) runs just that part.

    posttrain compare [--algos sft dpo ppo grpo dapo gspo dr_grpo rloo] [--seeds 3]
        [--budget tokens|seconds] [--tokens 40000] [--seconds 20] [--moe [true|false|only]]
        [--output runs/compare]

Writes ``OUTPUT/report.md``, ``OUTPUT/curves.png`` (accuracy against tokens and against
seconds), ``OUTPUT/results.json`` and each run under ``OUTPUT/runs/``.

Where each piece lives: ``runner.py`` runs each algorithm as its own ``posttrain`` process
under the budget and scores what it wrote; ``moe.py`` upcycles the dense model, builds the
MoE start and runs the MoE study; ``report.py`` turns the results into the report and the
curves; this file checks the arguments and runs the three in order.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from posttrain.compare.moe import build_moe_start, run_moe_study, setup
from posttrain.compare.report import markdown, plot
from posttrain.compare.runner import (
    DEFAULT_ALGOS,
    EVAL_SIZE,
    Scorer,
    budget_args,
    command,
    run_algos,
    train,
)


def run_compare(algos: list[str], seeds: int, budget: str, tokens: int, seconds: float,
                moe: bool | str, output: str | Path, device: str = "cpu",
                moe_seeds: int | None = None, log=print) -> Path:
    """Run the study and write its report; returns the report's path. ``moe``: also the
    mixture-of-experts arms (True), not (False), or only them (``"only"``: ``algos`` is
    not run)."""
    _check(algos, seeds, budget, tokens, seconds)
    out = Path(output)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    limit = budget_args(budget, tokens, seconds)
    t0 = time.perf_counter()
    dense = moe != "only"
    scorer = Scorer("builtin", device) if dense else None
    start = scorer("builtin") if dense else None
    results = {"budget": budget, "tokens": tokens, "seconds": seconds,
               "seeds": seeds if dense else moe_seeds or seeds,
               "algos": run_algos(algos, seeds, limit, device, runs, scorer, start, t0, log)
               if dense else {},
               "moe": run_moe_study(out, device, moe_seeds or seeds, limit, log) if moe
               else None}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    figure = plot(results, out / "curves.png") if dense else None
    report = out / "report.md"
    report.write_text(markdown(results, start, figure, time.perf_counter() - t0, EVAL_SIZE,
                               setup()))
    log(f"[compare] done in {time.perf_counter() - t0:.0f} s: {report}")
    return report


def _check(algos: list[str], seeds: int, budget: str, tokens: int, seconds: float) -> None:
    """Refuse bad arguments before anything runs (an unknown algorithm is one line)."""
    for a in algos:
        if a != "sft":
            command(a)
    if seeds < 1 or tokens < 1 or seconds <= 0:
        raise ValueError("compare: --seeds, --tokens and --seconds must be positive")
    if budget not in ("tokens", "seconds"):
        raise ValueError(f"compare: --budget is tokens or seconds, not {budget!r}")


__all__ = ["DEFAULT_ALGOS", "Scorer", "build_moe_start", "run_compare", "train"]
