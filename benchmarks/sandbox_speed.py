"""Sandboxed executions per second of a trivial program (``print(1)``), per isolation level
available here, with N threads calling ``Sandbox.run_python`` at once, and the floor under
them: the same number of plain ``python -I -c pass`` starts (no sandbox, no temporary
directory, no limits) from N threads.

Every run of a level is checked (status 0, stdout ``1``); the levels and the floor alternate
within each N, so a machine that drifts moves them alike. It leaves out what a run costs
beyond start-up (the program's own work).

Also, per level, how long after its wall limit (3 s) a program that never ends comes back
killed (the promise: within the limit plus one second; the tests only check that it comes
back), the worst of five.

Usage: python benchmarks/sandbox_speed.py [--runs 200] [--threads 1,2,4] [--levels all]
Prints one JSON line per measurement and Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from posttrain.sandbox import Sandbox, available_levels

FLOOR = "python -I -c pass"


def _sandboxed(level: str):
    box = Sandbox(level)

    def one(_: int) -> None:
        r = box.run_python("print(1)")
        if not (r.passed and r.stdout == "1\n"):
            raise RuntimeError(f"{level}: a trivial run failed: {r}")
    return one


def _plain(_: int) -> None:
    subprocess.run([sys.executable, "-I", "-c", "pass"], check=True, env={},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _rate(one, runs: int, threads: int) -> float:
    """Executions per second of ``runs`` calls of ``one`` from ``threads`` threads."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))  # warm: probes, imports, page cache
        start = time.perf_counter()
        list(pool.map(one, range(runs)))
        return runs / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--threads", default="1,2,4")
    p.add_argument("--levels", default="all", help="comma-separated, or all (available here)")
    args = p.parse_args(argv)
    levels = available_levels() if args.levels == "all" else args.levels.split(",")
    threads = [int(n) for n in args.threads.split(",")]
    cases = {level: _sandboxed(level) for level in levels}
    cases[FLOOR] = _plain
    rates: dict[tuple[str, int], float] = {}
    for n in threads:
        for name, one in cases.items():
            rates[name, n] = _rate(one, args.runs, n)
            print(json.dumps({"case": name, "threads": n, "runs": args.runs,
                              "per_s": round(rates[name, n], 1)}), flush=True)
    cores = len(os.sched_getaffinity(0))
    print(f"\nExecutions per second of `print(1)`, {args.runs} runs per cell, {cores} cores, "
          f"{'root' if os.geteuid() == 0 else 'not root'}:\n")
    print("| level | " + " | ".join(f"{n} thread{'s' * (n > 1)}" for n in threads) + " | best |")
    print("|---" * (len(threads) + 2) + "|")
    for name in cases:
        row = [rates[name, n] for n in threads]
        label = f"`{name}` (floor)" if name == FLOOR else name
        print(f"| {label} | " + " | ".join(f"{r:.1f}" for r in row) + f" | {max(row):.1f} |")
    print("\n| level | an endless loop under a 3 s wall limit: back after (worst of 5) |")
    print("|---|---|")
    for level in levels:
        print(f"| {level} | {_killed_back_after(level):.2f} s |")


def _killed_back_after(level: str, wall: float = 3.0, repeats: int = 5) -> float:
    """Seconds from the call to its return for ``while True: pass``, the worst of
    ``repeats``; each must come back killed at the wall limit."""
    box = Sandbox(level)
    worst = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = box.run_python("while True:\n    pass\n", wall_s=wall)
        worst = max(worst, time.perf_counter() - t0)
        assert r.timed_out, r
    return worst


if __name__ == "__main__":
    main()
