"""The study written up: the learning curves as a PNG and the Markdown report (the table of
mean ± std over seeds, how many algorithms ended above the start, the MoE section and its
verdict). Everything here is read from the study's results; nothing is run or scored.
"""

from __future__ import annotations

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
    lines = [*_preamble(results, total_s, eval_size), *_table(results, start)]
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
    return [
        "# posttrain compare", "",
        f"posttrain {__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs "
        f"(threads {torch.get_num_threads()}), {time.strftime('%Y-%m-%d')}; "
        f"the whole study took {total_s / 60:.1f} min.", "",
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
    """GRPO against GSPO on the MoE start: what was run, the table and the verdict."""
    lines = ["", "## Mixture of experts: GRPO against GSPO", "",
             "The built-in model upcycled to a Mixtral-style policy "
             f"({setup['num_local_experts']} experts, {setup['num_experts_per_tok']} per "
             f"token) and SFT'd for "
             f"{setup['sft_steps']} steps (start accuracy {moe['start']['accuracy']:.1%}); "
             "2 epochs over 2 minibatches per step, so updates run off-policy. Means over "
             "each run's steps, then mean ± std over seeds.", "",
             "| algorithm | accuracy | clip fraction | ratio max − min | KL to start |",
             "|---|---|---|---|---|"]
    for algo, runs in moe["runs"].items():
        col = lambda k, runs=runs: [r[k] for r in runs]  # noqa: E731
        lines.append(f"| {algo} | {_pm(col('accuracy'))} | {_pm(col('clip'), '{:.3f}')} | "
                     f"{_pm(col('ratio_spread'), '{:.3f}')} | {_pm(col('kl'), '{:.3f}')} |")
    return [*lines, "", _moe_verdict(moe)]


def _moe_verdict(moe: dict) -> str:
    """Whether GSPO's stability advantage shows: accuracy no worse, steadier across seeds
    and a narrower ratio spread, all three."""
    g, s = moe["runs"]["grpo"], moe["runs"]["gspo"]
    acc_g, sd_g = _stats([r["accuracy"] for r in g])
    acc_s, sd_s = _stats([r["accuracy"] for r in s])
    spread_g = statistics.fmean(r["ratio_spread"] for r in g)
    spread_s = statistics.fmean(r["ratio_spread"] for r in s)
    stable = acc_s >= acc_g - sd_g and sd_s <= sd_g and spread_s < spread_g
    return ("**At this scale GSPO's stability advantage " + ("shows" if stable else
            "does not show") + f"**: accuracy {acc_s:.1%} ± {sd_s:.1%} (GSPO) against "
            f"{acc_g:.1%} ± {sd_g:.1%} (GRPO), ratio spread {spread_s:.3f} against "
            f"{spread_g:.3f}. GSPO's ratio is a per-sequence geometric mean, so its spread is "
            "narrower by construction, and its clip range (3e-4 / 4e-4) is about 1000× "
            "narrower than GRPO's 0.2, so it clips far more sequences by design; what would "
            "show an advantage is steadier accuracy across seeds, or GRPO failing where GSPO "
            "does not.")


def _stats(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one seed)."""
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _pm(xs: list[float], fmt: str = "{:.1%}") -> str:
    """``mean ± std`` in ``fmt``."""
    m, s = _stats(xs)
    return f"{fmt.format(m)} ± {fmt.format(s)}"
