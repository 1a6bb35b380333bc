"""No wait without an end: an environment's call or a tool's past ``--env_timeout`` is an
error (the run's one line, or the tool message's error line) and leaves nothing that keeps
the process alive; in process (no thread the interpreter would join at exit is left), in a
plain subprocess, and through the command line with every way a run calls environments
(one after another, ``--env_workers``, the asynchronous producer thread and process, tools).
Also small defects of the same issue: ``--env_kwargs`` with ``--tools``, and why ``eval
--env`` skipped rows.

A call that never returns makes any finite wait decisive: the subprocesses get a generous
timeout and no duration is compared with a threshold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from posttrain.episodes import EnvError, EnvSpec, Episode, ToolEnv
from posttrain.episodes.env import step_all


class Blocked:
    """A row with ``block`` waits in ``step`` until the test ends (``release``); any other
    row's episode ends at once with reward 1."""

    release: threading.Event

    def __init__(self, row):
        self.block = row.get("block", False)

    def reset(self):
        return "go"

    def step(self, text):
        if self.block:
            self.release.wait()
        return None, 1.0, True


@pytest.fixture
def release():
    """The event the blocked calls wait on, set when the test ends: nothing outlives it."""
    event = threading.Event()
    Blocked.release = event
    before = set(threading.enumerate())
    yield before
    event.set()


def _holding(before: set) -> list[threading.Thread]:
    """Threads the interpreter would join at exit (not daemons, not the main thread) that
    the test started, or that posttrain named."""
    return [t for t in threading.enumerate() if not t.daemon
            and t is not threading.main_thread()
            and (t not in before or t.name.startswith("posttrain"))]


def test_a_step_past_its_timeout_is_an_error_and_leaves_no_thread_to_join(release):
    ep = Episode(EnvSpec(Blocked, {}, 0.3, "Blocked"), {"block": True}, 5)
    assert ep.reset() == "go"
    with pytest.raises(EnvError) as e:
        ep.step("x")
    assert str(e.value) == ("env Blocked on row 5, turn 1: step() raised TimeoutError: did not "
                            "return within 0.3 s")
    assert _holding(release) == []
    # the next episode gets a fresh worker (a generous timeout: this call must not run out)
    ok = Episode(EnvSpec(Blocked, {}, 60.0, "Blocked"), {}, 6)
    assert ok.reset() == "go" and ok.step("x") == (None, 1.0, True)


def test_step_all_past_its_timeout_keeps_the_order_and_leaves_no_thread_to_join(release):
    # (the free steps share the blocked one's 2 s: a trivial call on a started thread)
    spec = EnvSpec(Blocked, {}, 2.0, "Blocked")
    eps = [Episode(spec, {"block": b}, i + 1) for i, b in enumerate([False, True, False])]
    for ep in eps:
        ep.reset()
    got = step_all(eps, ["x"] * 3, workers=4)
    assert got[0] == (None, 1.0, True) and got[2] == (None, 1.0, True)
    assert isinstance(got[1], EnvError)
    assert str(got[1]) == ("env Blocked on row 2, turn 1: step() raised TimeoutError: did not "
                           "return within 2 s")
    assert _holding(release) == []
    # the abandoned pool is replaced: the next turn runs
    more = [Episode(EnvSpec(Blocked, {}, 60.0, "Blocked"), {}, i) for i in (7, 8)]
    assert step_all(more, ["x", "x"], workers=4) == [(None, 1.0, True)] * 2


def test_a_tool_past_its_timeout_is_its_error_line_and_leaves_no_thread_to_join(release):
    def never(x):
        release_event.wait()

    release_event = Blocked.release
    env = ToolEnv({"prompt": "p"}, {"never": never, "add": lambda a, b: a + b}, "plain",
                  error_reward=-0.5, timeout=1.0)  # (add, a trivial call, has 1 s too)
    msg, reward, done = env.step("call: never(1)\ncall: add(2, 3)")
    assert msg == {"role": "tool", "content": "error: never: TimeoutError: did not return "
                                              "within 1 s\n5"}
    assert reward == -0.5 and not done
    # and inside --env_workers threads: each its own worker, each its own timeout
    spec = EnvSpec(ToolEnv, {"tools": {"never": never}, "timeout": 0.3}, 0.0, "tools")
    eps = [Episode(spec, {"prompt": "p"}, i) for i in (1, 2)]
    got = step_all(eps, ["call: never(0)"] * 2, workers=2)
    assert [m["content"] for m, _, _ in got] == ["error: never: TimeoutError: did not "
                                                 "return within 0.3 s"] * 2
    assert _holding(release) == []


def test_an_error_that_is_a_timeout_of_the_environment_is_its_own():
    """A TimeoutError the environment raises itself is its error, not the call's timeout."""
    class Raises:
        def __init__(self, row):
            pass

        def reset(self):
            return "go"

        def step(self, text):
            raise TimeoutError("the sandbox did not answer")

    spec = EnvSpec(Raises, {}, 5.0, "Raises")
    ep = Episode(spec, {}, 1)
    ep.reset()
    with pytest.raises(EnvError, match=r"TimeoutError: the sandbox did not answer$"):
        ep.step("x")
    got = step_all([Episode(spec, {}, 1), Episode(spec, {}, 2)], ["x", "x"], workers=2)
    assert [str(e).endswith("TimeoutError: the sandbox did not answer") for e in got] == \
        [True, True]


NEVER_SCRIPT = '''
import threading
from posttrain.episodes import EnvError, EnvSpec, Episode, ToolEnv
from posttrain.episodes.env import step_all

class Never:
    def __init__(self, row):
        pass
    def reset(self):
        return "go"
    def step(self, text):
        threading.Event().wait()

spec = EnvSpec(Never, {}, 0.5, "Never")
ep = Episode(spec, {}, 1)
ep.reset()
try:
    ep.step("x")
except EnvError as e:
    print(e)
print(step_all([Episode(spec, {}, 2), Episode(spec, {}, 3)], ["x", "x"], 2)[1])
tools = ToolEnv({"prompt": "p"}, {"never": lambda: threading.Event().wait()}, timeout=0.5)
print(tools.step("call: never()")[0]["content"])
'''


def test_a_process_whose_environment_never_returns_exits():
    """The calls that never return are left behind; the script's end is the process's."""
    done = subprocess.run([sys.executable, "-c", NEVER_SCRIPT], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "env Never on row 1, turn 1: step() raised TimeoutError: did not return within 0.5 s",
        "env Never on row 3, turn 1: step() raised TimeoutError: did not return within 0.5 s",
        "error: never: TimeoutError: did not return within 0.5 s"]


# --- the command line ---------------------------------------------------------------------
NEVER_ENV = '''
import threading

class Never:
    """Asks once; its step never returns."""
    def __init__(self, row):
        pass
    def reset(self):
        return "1+1?"
    def step(self, text):
        threading.Event().wait()
'''

NEVER_TOOL = '''
import threading

import posttrain.episodes.tools as tools

# every turn calls the tool (a model this small would never write the call): a test double
tools.parse_calls = lambda text, style: [("never", [], {})]

def never():
    """Never returns."""
    threading.Event().wait()

def score(prompts, completions, **_):
    return [0.0] * len(prompts)
'''

TINY = ["--model", "builtin-episodes", "--max_steps", "2", "--prompts_per_step", "2",
        "--group_size", "2", "--max_new_tokens", "6", "--eval_every", "0",
        "--builtin_eval_size", "0", "--device", "cpu", "--tensorboard", "false",
        "--env_timeout", "1"]


def _posttrain(tmp_path, name: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m posttrain grpo`` on the tiny settings; it must exit within 120 s."""
    (tmp_path / "rows.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+1?"}) + "\n" for i in range(4)))
    return subprocess.run([sys.executable, "-m", "posttrain", "grpo", *TINY, "--output_dir",
                           str(tmp_path / name), "--data", str(tmp_path / "rows.jsonl"),
                           *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.kill
@pytest.mark.parametrize("how", [(), ("--env_workers", "4"),
                                 ("--async_staleness", "1", "--async_producer", "thread"),
                                 ("--async_staleness", "1", "--async_producer", "process")],
                         ids=["serial", "workers", "async-thread", "async-process"])
def test_a_run_whose_environment_never_returns_stops_in_one_line_and_exits(tmp_path, how):
    (tmp_path / "never.py").write_text(NEVER_ENV)
    done = _posttrain(tmp_path, "run", "--env", f"{tmp_path}/never.py:Never", *how)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr
    assert last.startswith("error: env Never on row ") and last.endswith(
        ", turn 1: step() raised TimeoutError: did not return within 1 s"), last


@pytest.mark.kill
def test_a_run_whose_tool_never_returns_finishes_and_exits(tmp_path):
    (tmp_path / "never.py").write_text(NEVER_TOOL)
    done = _posttrain(tmp_path, "run", "--tools", f"{tmp_path}/never.py:never", "--reward",
                      f"{tmp_path}/never.py:score", "--max_steps", "1", "--max_turns", "2")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "run" / "final").is_dir()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert next(r for r in rows if r.get("step") == 1)["episodes/tool_failures_mean"] == 2


# --- small defects of the same issue ------------------------------------------------------
def test_env_kwargs_with_tools_is_refused(tmp_path, capsys):
    """``--env_kwargs`` sets ``--env``'s class: with ``--tools`` it would be ignored."""
    from posttrain.cli import main
    from posttrain.config import ConfigError, RLConfig

    kw = {"tools": "t.py:f", "data": "d.jsonl", "reward": "r.py:g", "env_kwargs": '{"a": 1}'}
    cfg = RLConfig(output_dir=str(tmp_path), **kw)
    cfg.given = set(kw)
    with pytest.raises(ConfigError, match="unknown key 'env_kwargs' for --tools"):
        cfg.validate()
    assert main(["eval", "--tools", "t.py:f", "--env_kwargs", '{"a": 1}', "--data",
                 "d.jsonl", "--reward", "r.py:g"]) == 2
    assert "eval: --env_kwargs are --env's class's" in capsys.readouterr().err


ANSWERS = '''
class Answers:
    """One turn; a row with "broken" raises, any other ends with reward 0."""
    def __init__(self, row):
        self.broken = row.get("broken", False)
    def reset(self):
        return "1+1?"
    def step(self, text):
        if self.broken:
            raise KeyError("boom")
        return None, 0.0, True

def needs_answer(prompts, completions, answer, **_):
    return [float(a) for a in answer]
'''


def test_eval_says_why_it_skipped_rows(tmp_path, capsys):
    """``posttrain eval --env``: the first skipped row's error on stderr, one line naming
    the row (an environment's error, or a reward's)."""
    from posttrain.cli import main

    (tmp_path / "envs.py").write_text(ANSWERS)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in [
        {"answer": "1"}, {"answer": "1", "broken": True}, {"answer": "x"},
        {"answer": "1", "broken": True}]))
    common = ["eval", "--model", "builtin-episodes", "--env", f"{tmp_path}/envs.py:Answers",
              "--data", str(rows), "--max_new_tokens", "4", "--device", "cpu"]
    assert main(common) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["skipped"] == 2
    assert err.strip().splitlines()[-1] == (
        "eval: 2 of 4 rows skipped (counted as wrong); the first: env Answers on row 2, "
        "turn 1: step() raised KeyError: 'boom'")
    # a reward that also fails on row 3 (its answer is no number): row 2 is still the first
    assert main([*common, "--reward", f"{tmp_path}/envs.py:needs_answer"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["skipped"] == 3
    last = err.strip().splitlines()[-1]
    assert last.startswith("eval: 3 of 4 rows skipped (counted as wrong); the first: env "
                           "Answers on row 2, turn 1"), last
    # every row valid but row 3: the reward's error, named by its row
    rows.write_text("".join(json.dumps(r) + "\n" for r in [
        {"answer": "1"}, {"answer": "1"}, {"answer": "x"}]))
    assert main([*common, "--reward", f"{tmp_path}/envs.py:needs_answer"]) == 0
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("eval: 1 of 3 rows skipped (counted as wrong); the first: row 3: "
                           "reward 'needs_answer' raised ValueError"), last
