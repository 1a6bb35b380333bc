"""``posttrain samples RUN_DIR [--step S]``: a run's sample tables (``samples.jsonl``, written
every ``log_samples_every`` steps) printed for a person: each sample's numbers on one line,
then its prompt and completion."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape

SHOWN = ("sample", "group", "prompt", "completion", "reward", "advantage", "length", "finish",
         "correct", "turns", "step")


def read_tables(run_dir: str | Path) -> dict[int, list[dict]]:
    """The run's tables by step (a resumed run's file holds each step once)."""
    path = Path(run_dir) / "samples.jsonl"
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no sample tables (train with --log_samples_every N "
                                "to write them)")
    tables: dict[int, list[dict]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path}, line {n}: not a sample row (JSON with a step)") from None
        tables.setdefault(step, []).append(row)
    if not tables:
        raise ValueError(f"{path}: empty")
    return tables


def _num(v) -> str:
    if v is None:
        return "failed"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def show(run_dir: str | Path, step: int | None = None, console: Console | None = None) -> int:
    """Print the table of ``step`` (default: the last one); returns the step shown."""
    tables = read_tables(run_dir)
    if step is None:
        step = max(tables)
    if step not in tables:
        steps = ", ".join(str(s) for s in sorted(tables))
        raise ValueError(f"{run_dir}: no sample table at step {step} (tables at steps {steps})")
    console = console or Console(soft_wrap=True)
    rows = tables[step]
    console.print(f"[bold]{escape(str(run_dir))}[/bold]  step {step}  {len(rows)} samples")
    for row in rows:
        terms = "  ".join(f"{k[7:]} {_num(v)}" for k, v in row.items()
                          if k.startswith("reward/"))
        head = [f"sample {row.get('sample')}", f"group {row.get('group')}",
                f"reward {_num(row.get('reward'))}" + (f" ({terms})" if terms else ""),
                f"advantage {_num(row.get('advantage'))}", f"{row.get('length')} tokens",
                str(row.get("finish")), f"correct {_num(row.get('correct'))}"]
        if "turns" in row:
            head.append(f"{row['turns']} turns")
        extra = [f"{k} {_num(v)}" for k, v in row.items()
                 if k not in SHOWN and not k.startswith("reward/")]
        console.print()
        console.print("[bold]" + escape(" · ".join(head + extra)) + "[/bold]")
        console.print("  [dim]prompt[/dim]      " + escape(_indent(row.get("prompt", ""))))
        console.print("  [dim]completion[/dim]  " + escape(_indent(row.get("completion", ""))))
    return step


def _indent(text) -> str:
    return str(text).replace("\n", "\n              ")
