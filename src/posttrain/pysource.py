"""Python source parsed under one lock.

CPython (3.11 here) keeps the AST constructor's recursion counter in the ``ast`` module's
state, shared by every thread: two threads turning parse trees into ``ast`` objects at once
can overwrite each other's counter and one of them fails with ``SystemError: AST constructor
recursion depth mismatch`` (python/cpython#106905 and its reports). posttrain parses in
threads (the agent endpoint's tool calls, tool lines of episodes, code rewards), so every
parse of ours goes through :func:`parse`.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """``ast.parse(source, mode=mode)``, one thread at a time."""
    with _LOCK:
        return ast.parse(source, mode=mode)
