"""The study written up: the learning curves as a PNG and the Markdown report (the table of
mean ± std over seeds, how many algorithms ended above the start, the MoE section and its
verdict). Everything here is read from the study's results; nothing is run or scored.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path


def plot(results: dict, path: Path) -> Path | None:
    """Held-out accuracy against tokens and against seconds, every run from the start's
    accuracy at the origin, into ``path``; ``None`` without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    start = results["algos"].get("sft", [{}])[0].get("accuracy")
    # every run starts at the start's accuracy, at 0 tokens and 0 seconds
    origin = [(0, 0.0, start)] if start is not None else []
    for colour, (algo, runs) in enumerate(results["algos"].items()):
        for j, r in enumerate(runs if algo != "sft" else []):
            pts = origin + [tuple(p) for p in r["curve"]]
            for x, ax in enumerate(axes):  # x: 0 tokens, 1 seconds
                ax.plot([p[x] for p in pts], [p[2] for p in pts], color=f"C{colour}",
                        alpha=0.8, lw=1.2, label=algo if j == 0 and x == 0 else None)
    for ax, label in zip(axes, ("completion tokens", "training seconds"), strict=True):
        if start is not None:
            ax.axhline(start, color="grey", ls="--", lw=1)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("posttrain compare: the built-in task, from the SFT start (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(results: dict, start: dict, figure: Path | None, total_s: float, eval_size: int,
             moe_setup: dict) -> str:
    """The report: ``start`` is the start's scores, ``figure`` the curves (if drawn),
    ``eval_size`` the held-out problems scored and ``moe_setup`` the MoE start's experts and
    SFT steps (:func:`posttrain.compare.moe.setup`)."""
    lines = _preamble(results, total_s, eval_size)
    if results["algos"]:
        lines += _table(results, start)
        if figure is not None:
            lines += ["", f"![held-out accuracy against tokens and seconds]({figure.name})"]
        above = [a for a, runs in results["algos"].items() if a != "sft"
                 and statistics.fmean(r["accuracy"] for r in runs) > start["accuracy"]]
        lines += ["", f"Above the start: {len(above)} of "
                  f"{len([a for a in results['algos'] if a != 'sft'])} ({', '.join(above)})."]
    if results.get("moe"):
        lines += _moe_section(results["moe"], moe_setup)
    return "\n".join(lines) + "\n"


def _preamble(results: dict, total_s: float, eval_size: int) -> list[str]:
    """The title, where and when the study ran, and what was spent and measured."""
    import torch

    from posttrain import __version__

    b = results["budget"]
    spend = (f"{results['tokens']:,} completion tokens" if b == "tokens"
             else f"{results['seconds']:g} s of training steps")
    head = ["# posttrain compare", "",
            f"posttrain {__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs "
            f"(threads {torch.get_num_threads()}), {time.strftime('%Y-%m-%d')}; "
            f"the whole study took {total_s / 60:.1f} min.", ""]
    if not results["algos"]:
        return [*head, f"Every arm trains until it has spent {spend}, {results['seeds']} "
                "seeds each. Accuracy: greedy decoding of "
                f"{eval_size} fixed held-out problems; KL: of the trained policy from the "
                "start, on its own samples of those prompts (nats per completion)."]
    return [
        *head,
        f"Every algorithm starts from the built-in SFT'd model and trains until it has spent "
        f"{spend}, {results['seeds']} seeds each (mean ± std over seeds). Accuracy and reward: "
        f"greedy decoding of {eval_size} fixed held-out problems; KL: of the trained policy "
        "from the start, on its own samples of those prompts (nats per completion).", ""]


def _table(results: dict, start: dict) -> list[str]:
    """One row per algorithm, the start's first."""
    lines = ["| algorithm | accuracy | reward | KL to start | tokens | train s | wall s | "
             "peak RSS MiB |", "|---|---|---|---|---|---|---|---|"]
    for algo, runs in results["algos"].items():
        if algo == "sft":
            lines.append(f"| sft (the start) | {start['accuracy']:.1%} | {start['reward']:.3f} "
                         "| 0 | 0 | 0 | – | – |")
            continue
        col = lambda k, runs=runs: [r[k] for r in runs]  # noqa: E731
        lines.append(
            f"| {algo} | {_pm(col('accuracy'))} | {_pm(col('reward'), '{:.3f}')} | "
            f"{_pm(col('kl'), '{:.3f}')} | {statistics.fmean(col('tokens')):,.0f} | "
            f"{statistics.fmean(col('train_s')):.1f} | {statistics.fmean(col('wall_s')):.1f} | "
            f"{statistics.fmean(col('peak_rss_mib')):.0f} |")
    return lines


def _moe_section(moe: dict, setup: dict) -> list[str]:
    """The MoE arms: what was run, the table and the verdict."""
    lines = ["", "## Mixture of experts: routing replay and GSPO", "",
             "The built-in model upcycled to a Mixtral-style policy "
             f"({setup['num_local_experts']} experts, {setup['num_experts_per_tok']} per "
             f"token) and SFT'd for {setup['sft_steps']} steps (start accuracy "
             f"{moe['start']['accuracy']:.1%}); each arm trains it with `{setup['rl']}`: "
             "off-policy updates, sampled by a bfloat16 copy of the float32 policy. "
             "Means over each run's steps (the log-prob gap's worst: the worst step's), "
             "then mean ± std over seeds. *Disagreement*: the share of tokens (every "
             "router) whose experts in the trainer's old-policy pass differ from the "
             "sampler's; *gap*: |trainer − sampler| log-prob of the sampled tokens at the "
             "sampling weights; *IS weight*: the spread of π_old/π_sampler; *routing "
             "moved*: the share of held-out tokens the final model routes elsewhere than "
             "the start.", "",
             "| arm | accuracy | clip fraction | ratio max − min | IS weight max − min | "
             "disagreement | gap mean | gap worst | routing moved | KL to start |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, runs in moe["runs"].items():
        col = lambda k, runs=runs: [r[k] for r in runs]  # noqa: E731
        lines.append(
            f"| {arm} | {_pm(col('accuracy'))} | {_pm(col('clip'), '{:.3f}')} | "
            f"{_pm(col('ratio_spread'), '{:.3f}')} | {_pm(col('weight_spread'), '{:.3f}')} | "
            f"{_pm(col('disagreement'), '{:.2%}')} | {_pm(col('gap_mean'), '{:.4f}')} | "
            f"{_pm(col('gap_max'), '{:.3f}')} | {_pm(col('routing_moved'), '{:.1%}')} | "
            f"{_pm(col('kl'), '{:.3f}')} |")
    return [*lines, "", *_moe_verdict(moe)]


def _moe_verdict(moe: dict) -> list[str]:
    """What shows and what does not, each judged from the table's numbers: the mismatch
    R3 removes, whether it or GSPO moves accuracy or its spread over seeds, and whether
    any run ended below the start."""
    runs, start = moe["runs"], moe["start"]["accuracy"]
    mean = lambda arm, k: statistics.fmean(r[k] for r in runs[arm])  # noqa: E731
    out = []
    dis = statistics.fmean(mean(a, "disagreement") for a in runs if "+" not in a)
    moved = statistics.fmean(mean(a, "routing_moved") for a in runs)
    out.append(f"- **The mismatch is there**: in the arms without replay {dis:.2%} of "
               "tokens go to other experts in the bfloat16 sampler than in the float32 "
               f"trainer, and training moved {moved:.1%} of the held-out tokens' routing "
               "from the start's.")
    for algo in ("grpo", "gspo"):
        plain, r3 = runs.get(algo), runs.get(f"{algo}+r3")
        if plain is None or r3 is None:
            continue
        g0, g3 = mean(algo, "gap_max"), mean(f"{algo}+r3", "gap_max")
        a0, s0 = _stats([r["accuracy"] for r in plain])
        a3, s3 = _stats([r["accuracy"] for r in r3])
        narrower = g3 < g0
        n = min(len(plain), len(r3))
        # apart: the difference of the means beyond twice its standard error over seeds
        apart = n > 1 and abs(a3 - a0) > 2 * math.sqrt((s0 ** 2 + s3 ** 2) / n)
        out.append(
            f"- **{algo.upper()} + R3**: the worst step's trainer/sampler log-prob gap "
            + ("shrinks" if narrower else "does not shrink")
            + f" ({g3:.3f} against {g0:.3f} without replay); accuracy {a3:.1%} ± {s3:.1%} "
            f"against {a0:.1%} ± {s0:.1%}: "
            + (f"{'higher' if a3 > a0 else 'lower'} with R3 by more than twice the "
               "difference's standard error over seeds" if apart else
               "within twice the difference's standard error over seeds, so no accuracy "
               "effect shows") + ".")
    g, s = runs.get("grpo"), runs.get("gspo")
    if g and s:
        acc_g, sd_g = _stats([r["accuracy"] for r in g])
        acc_s, sd_s = _stats([r["accuracy"] for r in s])
        stable = acc_s >= acc_g - sd_g and sd_s <= sd_g
        out.append(
            "- **GSPO against GRPO** (no replay): GSPO's advantage "
            + ("shows" if stable else "does not show")
            + f" (accuracy {acc_s:.1%} ± {sd_s:.1%} against {acc_g:.1%} ± {sd_g:.1%}). Its "
            "ratio is a per-sequence geometric mean and its clip range (3e-4 / 4e-4) about "
            "1000× narrower than GRPO's 0.2, so its ratio spread is narrower and its clip "
            "fraction higher by construction; neither is an advantage in itself.")
    below = [f"{arm} seed {i}" for arm, rs in runs.items() for i, r in enumerate(rs)
             if r["accuracy"] < start]
    out.append("- **Collapse**: " + (f"{len(below)} runs ended below the start "
                                     f"({', '.join(below)})." if below else
                                     "no run ended below the start; at this scale nothing "
                                     "is unstable enough for replay to rescue."))
    return out


def _stats(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one seed)."""
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _pm(xs: list[float], fmt: str = "{:.1%}") -> str:
    """``mean ± std`` in ``fmt``."""
    m, s = _stats(xs)
    return f"{fmt.format(m)} ± {fmt.format(s)}"
