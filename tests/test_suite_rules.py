"""Rules the test suite keeps, checked on its own source.

**No test reads a clock to judge speed.** A verdict that depends on how long something took
fails on a busy or slow machine and passes on a fast one for the wrong reason: concurrency
and overlap are shown by events (a barrier all workers reach before any returns, an event
set by the other side), and speed claims live in ``benchmarks/``. A clock may be read only
to bound a wait — ``deadline = time.monotonic() + 120``, ``while time.monotonic() <
deadline`` and ``deadline - time.monotonic()`` — so that a broken run fails instead of
hanging; never in an ``assert``.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
CLOCKS = {"time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
          "process_time", "process_time_ns", "thread_time", "thread_time_ns", "clock_gettime",
          "clock_gettime_ns"}
DATETIME_CLOCKS = {"now", "utcnow", "today"}


def _clock_names(tree: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """The names under which this file reaches the clocks: the ``time`` module's aliases,
    the clock functions imported from it (under their aliases), and ``datetime`` classes'
    aliases."""
    modules, functions, datetimes = {"time"}, set(), {"datetime"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "time":
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "datetime"):
            for a in node.names:
                if node.module == "time" and a.name in CLOCKS:
                    functions.add(a.asname or a.name)
                elif node.module == "datetime" and a.name == "datetime":
                    datetimes.add(a.asname or a.name)
    return modules, functions, datetimes


def _is_clock(node: ast.AST, names) -> bool:
    """A call of a clock: ``time.perf_counter()`` (any alias of the module or the function),
    ``datetime.now()``."""
    modules, functions, datetimes = names
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Name):
        return f.id in functions
    if not isinstance(f, ast.Attribute):
        return False
    if isinstance(f.value, ast.Name):
        return (f.attr in CLOCKS and f.value.id in modules) or (
            f.attr in DATETIME_CLOCKS and f.value.id in datetimes)
    return f.attr in DATETIME_CLOCKS and isinstance(f.value, ast.Attribute) \
        and f.value.attr == "datetime"  # datetime.datetime.now()


def _names_a_deadline(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and "deadline" in n.id.lower() for n in ast.walk(node))


def clock_readings(source: str) -> list[int]:
    """Lines where a clock is read for anything but a wait's deadline: ``deadline = clock()
    + limit`` (an assignment), ``clock() < deadline`` in a loop's condition, ``deadline -
    clock()`` (the time left, to pass to a wait). Never inside an ``assert``."""
    tree = ast.parse(source)
    names = _clock_names(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def in_assert(node) -> bool:
        while node is not None:
            if isinstance(node, ast.Assert):
                return True
            node = parents.get(node)
        return False

    bad = []
    for node in ast.walk(tree):
        if not _is_clock(node, names):
            continue
        up = parents.get(node)
        if not in_assert(node):
            if isinstance(up, ast.BinOp) and isinstance(up.op, ast.Add):
                above = parents.get(up)  # deadline = clock() + limit
                if isinstance(above, ast.Assign) and all(_names_a_deadline(t)
                                                         for t in above.targets):
                    continue
            if isinstance(up, ast.BinOp) and isinstance(up.op, ast.Sub) \
                    and up.right is node and _names_a_deadline(up.left):
                continue  # deadline - clock()
            if isinstance(up, ast.Compare) and _names_a_deadline(up):
                above = up
                while isinstance(parents.get(above), ast.BoolOp):
                    above = parents[above]
                loop = parents.get(above)
                if isinstance(loop, ast.While) and loop.test is above:
                    continue  # while clock() < deadline
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
               "while time.monotonic() < deadline and not done():\n"
               "    wait(deadline - time.monotonic())\n")
    assert clock_readings(bounded) == []
    assert clock_readings("from time import monotonic\nx = monotonic()\n") == [2]
    # aliases, datetime, and a 'deadline' that is really a verdict
    assert clock_readings("import time as t\nx = t.perf_counter()\n") == [2]
    assert clock_readings("from time import perf_counter as pc\nx = pc()\n") == [2]
    assert clock_readings("import datetime\nx = datetime.datetime.now()\n") == [2]
    assert clock_readings("from datetime import datetime as dt\nx = dt.now()\n") == [2]
    assert clock_readings("import time\ndeadline = time.monotonic() + 0.5\nwork()\n"
                          "assert time.monotonic() < deadline\n") == [4]
