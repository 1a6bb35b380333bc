"""Rules the test suite keeps, checked on its own source.

**No test reads a clock to judge speed.** A verdict that depends on how long something took
fails on a busy or slow machine and passes on a fast one for the wrong reason: concurrency
and overlap are shown by events (a barrier all workers reach before any returns, an event
set by the other side), and speed claims live in ``benchmarks/``. A clock may be read only
to bound a wait — ``deadline = time.monotonic() + 120`` and ``time.monotonic() < deadline``
— so that a broken run fails instead of hanging.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
CLOCKS = {"time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
          "process_time", "process_time_ns", "thread_time", "thread_time_ns"}


def _is_clock(node: ast.AST) -> bool:
    """``time.<clock>()`` or a bare ``<clock>()`` imported from time."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr in CLOCKS and isinstance(f.value, ast.Name) and f.value.id == "time"
    return isinstance(f, ast.Name) and f.id in CLOCKS - {"time"}


def _names_a_deadline(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and "deadline" in n.id.lower() for n in ast.walk(node))


def clock_readings(source: str) -> list[int]:
    """Lines where a clock is read for anything but a wait's deadline."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bad = []
    for node in ast.walk(tree):
        if not _is_clock(node):
            continue
        up = parents.get(node)
        if isinstance(up, ast.BinOp) and isinstance(up.op, ast.Add):
            up = parents.get(up)  # deadline = clock() + limit
            if isinstance(up, ast.Assign) and all(_names_a_deadline(t) for t in up.targets):
                continue
        if isinstance(up, ast.Compare) and _names_a_deadline(up):
            continue  # clock() < deadline
        bad.append(node.lineno)
    return bad


def test_no_test_reads_a_clock_except_to_bound_a_wait():
    offenders = [f"{path.relative_to(TESTS.parent)}:{line}"
                 for path in sorted(TESTS.rglob("*.py"))
                 for line in clock_readings(path.read_text())]
    assert not offenders, ("a test reads a clock (time a verdict depends on; show "
                           "concurrency by events, measure speed in benchmarks/): "
                           + ", ".join(offenders))


def test_the_rule_sees_a_timed_verdict_and_lets_a_deadline_pass():
    timed = ("import time\nt0 = time.perf_counter()\nwork()\n"
             "assert time.perf_counter() - t0 < 1.0\n")
    assert clock_readings(timed) == [2, 4]
    bounded = ("import time\ndeadline = time.monotonic() + 120\n"
               "while time.monotonic() < deadline:\n    pass\n")
    assert clock_readings(bounded) == []
    assert clock_readings("from time import monotonic\nx = monotonic()\n") == [2]
