"""Python source parsed under one lock.

CPython before 3.11.8 and 3.12.2 keeps the AST constructor's recursion counter in the
``ast`` module's state, shared by every thread: two threads turning parse trees into
``ast`` objects at once can overwrite each other's counter, and one of them fails with
``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905, fixed by
#113035 and its backports). posttrain parses in threads (the agent endpoint's tool calls,
tool lines of episodes, code rewards), so every parse of its own goes through
:func:`parse`, and :func:`class_source` reads a class's source (which parses its module)
under the same lock. This is a mitigation on those versions, not a cure: a parse by the
standard library or another package in another thread (``traceback`` reading source for
its carets, say) is outside the lock; the cure is a newer CPython.
"""

from __future__ import annotations

import ast
import inspect
import threading

_LOCK = threading.RLock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """``ast.parse(source, mode=mode)``, one thread at a time."""
    with _LOCK:
        return ast.parse(source, mode=mode)


def class_source(cls: type) -> str:
    """``inspect.getsource(cls)`` (which parses the class's module), under the lock."""
    with _LOCK:
        return inspect.getsource(cls)
