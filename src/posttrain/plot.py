"""``posttrain plot RUN_DIR... [--metrics KEY ...] [--output FILE.png]``: any runs' metrics
against the step, one panel per metric and one line per run (matplotlib, an optional
dependency: ``pip install 'posttrain[plot]'``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

DEFAULT_METRICS = ("eval/accuracy", "reward/mean", "train/loss", "eval/loss", "kl/seq_mean",
                   "train/reward_accuracy")
"""Shown when no ``--metrics`` are given: those of these that some run logged."""


def read_metrics(run: Path) -> list[dict]:
    """The rows of ``run/metrics.jsonl`` (a torn last line, from a killed run, is left out)."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run}: no metrics.jsonl (not a posttrain run directory)")
    lines = path.read_text().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise ValueError(f"{path}, line {n}: not JSON") from None
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` where it is a finite number."""
    points = [(r["step"], float(r[key])) for r in rows
              if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
    return [p[0] for p in points], [p[1] for p in points]


def plot(runs: list[str | Path], metrics: list[str] | None = None,
         output: str | Path = "metrics.png") -> Path:
    """Draw ``metrics`` (default: :data:`DEFAULT_METRICS` that were logged) of ``runs`` into
    ``output``; returns its path."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("posttrain plot needs matplotlib: pip install 'posttrain[plot]'") \
            from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {Path(r): read_metrics(Path(r)) for r in runs}
    logged = sorted({k for rows in data.values() for row in rows for k, v in row.items()
                     if k != "step" and isinstance(v, (int, float))})
    if metrics:
        unknown = [m for m in metrics if m not in logged]
        if unknown:
            raise ValueError(f"no run logged {', '.join(unknown)}; they logged: "
                             f"{', '.join(logged)}")
    else:
        metrics = [m for m in DEFAULT_METRICS if m in logged] or [
            m for m in logged if not m.startswith("time/")][:4]
    if not metrics:
        raise ValueError("the runs logged no metric to plot")
    cols = min(len(metrics), 3)
    rows_n = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.5 * cols, 3.2 * rows_n), squeeze=False)
    names = _labels(list(data))
    for ax, key in zip(axes.flat, metrics, strict=False):
        for rows, name in zip(data.values(), names, strict=True):
            x, y = series(rows, key)
            if x:
                ax.plot(x, y, marker="o" if len(x) < 20 else None, ms=3, label=name)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def _labels(runs: list[Path]) -> list[str]:
    """Each run's directory name, or its path when two runs share a name."""
    names = [r.name or str(r) for r in runs]
    return [str(r) if names.count(n) > 1 else n for r, n in zip(runs, names, strict=True)]
