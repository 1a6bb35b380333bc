"""Shared machinery of the side-by-side benchmarks: model sizes, running each case in a fresh
subprocess (with its peak RSS), and alternating the two libraries across repeats."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = {
    "small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4),
    "medium": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=8),
    # ~180M: the medium body with Qwen's 151,936-token vocabulary, untied
    "large": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8, vocab_size=151936,
                  tie_word_embeddings=False),
}
IMPLS = ("trl", "posttrain")


@contextlib.contextmanager
def scratch(path: str | None, prefix: str):
    """A benchmark's working directory: ``path`` when given (created, and kept), else a fresh
    temporary one removed when the benchmark ends, since its models and runs take gigabytes
    at the 180M size."""
    if path:
        work = Path(path)
        work.mkdir(parents=True, exist_ok=True)
        yield work
        return
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def preference_inputs(work: Path, size: str, pairs: int, steps: int,
                      columns: tuple[str, ...] | None = None) -> tuple[Path, Path]:
    """The model of ``size`` and ``pairs × (steps + 2)`` built-in preference pairs
    (``columns`` of each row, or all) under ``work``, made once for a benchmark's runs."""
    from posttrain.builtin import task
    from posttrain.builtin.build import init_model

    model_dir = work / f"model-{size}"
    if not model_dir.exists():
        init_model(model_dir, **SIZES[size])
    data = work / "pairs.jsonl"
    if not data.exists():
        rows = task.preference_rows(pairs * (steps + 2), "train")
        if columns is not None:
            rows = [{k: r[k] for k in columns} for r in rows]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def run_preference_child(args, prepare, run_posttrain, run_trl) -> int:
    """A preference benchmark's child (``--child IMPL SIZE SETTING``): one run of one
    library, printing its ``RESULT`` line."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    work = Path(args.work)
    model_dir, data = prepare(work, args.size, args.steps)
    out = Path(tempfile.mkdtemp(prefix=f"{args.impl}-", dir=work))
    fn = run_posttrain if args.impl == "posttrain" else run_trl
    print("RESULT " + json.dumps(fn(model_dir, data, args.steps, args.setting, out)))
    return 0


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}


def trl_step_timer():
    """A ``transformers`` callback that times each optimiser step of a TRL trainer, and the
    list of seconds it fills."""
    import time

    from transformers import TrainerCallback

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    return StepTimer(), times


def posttrain_step_times(out) -> list[float]:
    """The seconds of each step a posttrain run logged in ``out/metrics.jsonl``."""
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["time/step_s"] for r in rows if "time/step_s" in r]


def spawn(cmd: list[str], env: dict[str, str]) -> tuple[str, str, int, float]:
    """Run ``cmd``; return stdout, stderr, exit code and the child's peak RSS in MiB."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return out.read(), err.read(), code, usage.ru_maxrss / 1024


def comparison_parser(doc: str, steps: int) -> argparse.ArgumentParser:
    """The command line every side-by-side benchmark takes (sizes, settings, repeats, steps,
    warm-up steps, work directory, and the hidden ``--child IMPL SIZE SETTING``)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["small", "medium"], choices=list(SIZES))
    p.add_argument("--settings", nargs="+", default=["identical", "defaults"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--work", default=None)
    p.add_argument("--child", nargs=3, metavar=("IMPL", "SIZE", "SETTING"),
                   help=argparse.SUPPRESS)
    return p


def run_comparisons(script: str, args, work) -> list[tuple]:
    """``alternate`` for every size × setting of ``args`` (a :func:`comparison_parser`
    namespace); rows of ``(size, setting, trl, posttrain)``."""
    table = []
    for size in args.sizes:
        for setting in args.settings:
            res = alternate(script, size, setting, args.repeats,
                            ["--steps", str(args.steps), "--work", str(work)], args.warmup)
            table.append((size, setting, res["trl"], res["posttrain"]))
    return table


def print_comparison(title: str, table: list[tuple], digits: int, run_time: bool) -> None:
    """The markdown table of :func:`run_comparisons` rows: step times, speed-up, (whole-run
    times,) peak RSS. The speed-up is given three ways, because a shared machine's speed
    drifts by tens of percent within minutes: the ratio of the two libraries' medians; the
    median (and range) of the per-repeat ratios, each of two runs made back to back; and
    the ratio of each library's fastest run, the one least slowed by other load."""
    total = " TRL run s | posttrain run s |" if run_time else ""
    print(title)
    print(f"| model | setting | TRL s/step | posttrain s/step | speed-up | per-repeat ratios | "
          f"fastest runs |{total} TRL peak RSS MiB | posttrain peak RSS MiB |")
    print("|---" * (11 if run_time else 9) + "|")
    for size, setting, trl, pt in table:
        runs = f" {trl['total_s']:.1f} | {pt['total_s']:.1f} |" if run_time else ""
        ratios = sorted(a / b for a, b in zip(trl["step_s_runs"], pt["step_s_runs"],
                                              strict=True))
        print(f"| {size} | {setting} | {trl['step_s']:.{digits}f} | {pt['step_s']:.{digits}f} | "
              f"{trl['step_s'] / pt['step_s']:.2f}x | {statistics.median(ratios):.2f}x "
              f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | "
              f"{min(trl['step_s_runs']) / min(pt['step_s_runs']):.2f}x |{runs} "
              f"{trl['rss_mib']:.0f} | {pt['rss_mib']:.0f} |")


def alternate(script: str, size: str, setting: str, repeats: int, child_args: list[str],
              warmup: int) -> dict[str, dict[str, float]]:
    """Run ``script --child IMPL SIZE SETTING *child_args`` for both libraries, alternating
    which goes first; each child prints ``RESULT {"step_s": [...], ...}``. Returns, per
    library, the medians over repeats of: the median step after ``warmup`` (``step_s``), the
    peak RSS (``rss_mib``) and, when reported, the whole run (``total_s``); and each
    repeat's median step (``step_s_runs``)."""
    env = child_env()
    runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
    for rep in range(repeats):
        for impl in (IMPLS if rep % 2 == 0 else IMPLS[::-1]):
            cmd = [sys.executable, script, "--child", impl, size, setting, *child_args]
            out, err, code, peak = spawn(cmd, env)
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if code != 0 or not line:
                print(out[-2000:], err[-4000:], file=sys.stderr)
                raise SystemExit(f"{impl} {size} {setting} failed")
            res = json.loads(line[0][len("RESULT "):])
            run = {"step_s": statistics.median(res["step_s"][warmup:]), "rss_mib": peak}
            if "total_s" in res:
                run["total_s"] = res["total_s"]
            runs[impl].append(run)
            print(f"{size:>6} {setting:>9} rep {rep} {impl:>9}: {run['step_s']:.4f} s/step, "
                  f"peak RSS {peak:.0f} MiB", file=sys.stderr)
    return {impl: {**{k: statistics.median(r[k] for r in rs) for k in rs[0]},
                   "step_s_runs": [r["step_s"] for r in rs]}
            for impl, rs in runs.items()}
