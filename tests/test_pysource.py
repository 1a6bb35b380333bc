"""Python source parsed from several threads at once (the agent endpoint's tool calls, tool
lines of episodes, code rewards, the CLI's help) never trips CPython's shared AST recursion
counter, and a run's start parses no source at all."""

import ast
import sys
import threading

from posttrain import pysource

SOURCE = "\n".join(f"def f{i}(a, b=({i}, [{i}, {{'k': {i}}}])):\n"
                   f"    return [x * {i} for x in a if x > b[0]]" for i in range(60))


class _Cycle:
    """Garbage with a finaliser: the collector runs Python code in the middle of an AST
    conversion, which is where another thread can take the interpreter."""

    def __init__(self):
        self.me = self

    def __del__(self):
        pass


def _race(parse, parses=150):
    """Two threads at different stack depths parsing, one making cyclic garbage; the first
    error, or None. (With plain ast.parse on CPython 3.11 this fails within a few
    parses.)"""
    errors, done = [], threading.Event()

    def litter():
        while not done.is_set():
            _Cycle()

    def work(depth):
        if depth:
            return work(depth - 1)
        for _ in range(parses):
            try:
                parse(SOURCE)
            except Exception as e:  # (any failure counts, not only the SystemError)
                errors.append(e)
                return

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=work, args=(d,)) for d in (0, 50)]
        junk = threading.Thread(target=litter)
        for t in [*threads, junk]:
            t.start()
        for t in threads:
            t.join(timeout=120)
        done.set()
        junk.join(timeout=10)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads), "a parsing thread did not finish"
    return errors[0] if errors else None


def test_parses_from_several_threads_at_once_do_not_fail():
    assert _race(pysource.parse) is None


def test_starting_a_command_parses_no_source(monkeypatch):
    """The commands' config-key help is read from the config classes' source only when help
    is shown: every run used to parse all of them at start, racing any thread that parsed."""
    from posttrain.cli import build_parser

    calls = []
    real = ast.parse
    monkeypatch.setattr(ast, "parse", lambda *a, **k: calls.append(a) or real(*a, **k))
    parser = build_parser()
    args, _ = parser.parse_known_args(["grpo", "--max_steps", "1"])
    assert args.command == "grpo" and calls == []
    grpo = parser._subparsers._group_actions[0].choices["grpo"]
    text = grpo.format_help()
    assert calls and "--group_size (default" in text
