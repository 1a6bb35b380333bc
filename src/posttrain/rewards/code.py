"""The ``code`` reward term: the completion's code run against the row's tests, in the
sandbox (:mod:`posttrain.sandbox`), never in the trainer's process.

The program is the completion's last fenced code block (the whole completion when it has
none), then the row's ``tests``: Python source whose ``assert`` statements are the tests and
whose other statements are their set-up. A harness runs it in one sandboxed interpreter:
the solution, then each statement of the tests in turn. It reports through a per-run token
it reads from stdin before the solution runs, so a solution that exits early, or prints a
report of its own, does not pass; one that searches the interpreter's memory for the token
could forge it (the harness and the solution share an interpreter: see docs/rewards.md).

``code_reward_mode``: ``all`` scores 1 when every test passes and 0 otherwise; ``share``
scores the share of asserts passed. A program that crashes, is killed at a limit or runs
past ``code_timeout`` scores 0. A row whose tests are not valid Python is a data error.
"""

from __future__ import annotations

import ast
import secrets
import sys

from posttrain import pysource


def extract_code(completion: str) -> str:
    """The last fenced code block's body, without its info string (```` ```python ````); a
    block the completion opened and did not close (cut at the token budget) runs to the
    end; no fence: the whole completion."""
    parts = completion.split("```")  # text, block, text, block, ...
    if len(parts) < 2:
        return completion
    body = parts[-1] if len(parts) % 2 == 0 else parts[-2]  # (an odd fence count: unclosed)
    info, newline, code = body.partition("\n")
    return code if newline else info


def split_tests(tests: str) -> list[tuple[str, str]]:
    """The top-level statements of ``tests``: ``(kind, source)``, kind ``assert`` or
    ``setup``. A SyntaxError names the problem."""
    return [("assert" if isinstance(node, ast.Assert) else "setup",
             ast.get_source_segment(tests, node)) for node in pysource.parse(tests).body]


_HARNESS = '''\
import sys, traceback
def _run(token, solution, statements):
    namespace = {"__name__": "__main__"}
    passed = failed = 0
    try:
        exec(compile(solution, "solution.py", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(token, 0, -1, flush=True)
        return
    for kind, source in statements:
        try:
            exec(compile(source, "tests.py", "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            if kind != "assert":
                print(token, passed, -1, flush=True)
                return
            failed += 1
        else:
            passed += kind == "assert"
    print(token, passed, failed, flush=True)
'''


def harness(solution: str, tests: str) -> str:
    """The program one sample runs: the solution, then each statement of the tests."""
    return (_HARNESS + f"_run(sys.stdin.readline().strip(), {solution!r}, "
            f"{split_tests(tests)!r})\n")


def _outcome(stdout: str, token: str, asserts: int) -> tuple[int, bool]:
    """``(asserts passed, set-up and solution ran)`` from the harness's report line."""
    for line in reversed(stdout.splitlines()):
        parts = line.split()
        if len(parts) == 3 and parts[0] == token:
            passed, failed = int(parts[1]), int(parts[2])
            return passed, failed >= 0 and passed + failed == asserts
    return 0, False


class CodeReward:
    """``f(prompts, completions, tests, **columns)``: each completion's code against its
    row's tests, in a :class:`posttrain.sandbox.Sandbox` made once."""

    def __init__(self, isolation: str = "auto", mode: str = "all", timeout: float = 10.0):
        from posttrain.sandbox import Limits, Sandbox, SandboxError

        if mode not in ("all", "share"):
            raise ValueError(f"code_reward_mode must be all or share, got {mode!r}")
        self.box = Sandbox(isolation, Limits(cpu_s=timeout, wall_s=timeout))
        if self.box.level == "rlimits" and isolation != "rlimits":
            raise SandboxError(
                "reward code: this machine isolates programs by resource limits alone (no "
                "bubblewrap, no usable namespaces), which does not keep model-written code "
                "off the network or the trainer's files; install bubblewrap, or accept that "
                "with --sandbox rlimits (docs/rewards.md)")
        self.mode = mode
        # (once per run, where the run's other one-time lines go)
        print(f"reward code: programs run in the sandbox at level {self.box.level}",
              file=sys.stderr)

    def __call__(self, prompts: list[str], completions: list[str],
                 tests: list[str] | None = None, **_) -> list[float]:
        if tests is None:
            raise ValueError("the data has no 'tests' column (Python source with asserts, "
                             "one per row)")
        out = []
        for completion, row_tests in zip(completions, tests, strict=True):
            if not isinstance(row_tests, str) or not row_tests.strip():
                raise ValueError(f"tests {row_tests!r}: expected Python source with asserts")
            try:
                program = harness(extract_code(completion), row_tests)
                asserts = sum(kind == "assert" for kind, _ in split_tests(row_tests))
            except SyntaxError as e:
                raise ValueError(f"tests are not valid Python: {e}") from None
            token = secrets.token_hex(16)
            result = self.box.run_python(program, stdin=token + "\n")
            passed, complete = _outcome(result.stdout, token, asserts)
            if result.timed_out or not complete:
                out.append(0.0)
            elif self.mode == "share":
                out.append(passed / asserts if asserts else float(result.passed))
            else:
                out.append(1.0 if passed == asserts and result.passed else 0.0)
        return out


def code_reward(prompts: list[str], completions: list[str], tests: list[str],
                **columns) -> list[float]:
    """The ``code`` term with its defaults (the strongest sandbox this machine offers,
    all-or-nothing, 10 s a program), for use as a plain function; its sandbox is made on
    the first call and kept."""
    global _default
    if _default is None:
        _default = CodeReward()
    return _default(prompts, completions, tests, **columns)


_default: CodeReward | None = None
