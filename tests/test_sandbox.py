"""posttrain.sandbox: hostile programs at every isolation level available here, and the plain
contract (output, stdin, tracebacks, threads, errors).

Each hostile program exits 0 only if its attack worked, so "it failed" means "it was
stopped". After each one: the call returned (a hang fails; how soon after the wall limit is
measured in benchmarks/sandbox_speed.py), no process of the run is
left (each program prints its own path first; every process it forks carries that path in
its command line), its directory is gone, nothing it names is left outside it, and this
process is alive. Where a level cannot keep a promise (the rlimits level does not cut the
network, and as a non-root user shares the user's files and processes), that case is
skipped, saying so.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import uuid

import pytest

from posttrain.sandbox import Limits, Result, Sandbox, SandboxError, available_levels

LEVELS = ("bwrap", "namespaces", "rlimits")
WALL = 3.0
HANG_S = 60.0
ROOT = os.geteuid() == 0
# Small enough that the memory and process bombs stay cheap; the wall limit is generous.
LIMITS = Limits(cpu_s=10, wall_s=WALL, memory_mb=256, processes=32, file_mb=4,
                open_files=64, output_bytes=4096)
HEAD = "import os, sys, time\nprint(__file__, flush=True)\n"


@pytest.fixture(scope="module", params=LEVELS)
def box(request) -> Sandbox:
    try:
        return Sandbox(request.param, LIMITS)
    except SandboxError as e:
        pytest.skip(str(e))


@pytest.fixture
def marker() -> str:
    return f"psbx{uuid.uuid4().hex}"


def cannot(box: Sandbox, *levels: str, why: str, root_too: bool = False) -> None:
    """Skip where a level cannot keep this promise (as a non-root user, or at all)."""
    if box.level in levels and (root_too or not ROOT):
        pytest.skip(f"the {box.level} level{'' if root_too else ' as a non-root user'} "
                    f"{why}")


def call(box: Sandbox, source: str, stdin: str = "", wall_s: float = WALL) -> Result:
    """``box.run_python`` in a thread, which must return: a call still running after
    HANG_S (twenty times the wall limit) hangs. How soon after the wall limit a killed run
    returns is measured by benchmarks/sandbox_speed.py, not asserted here."""
    out: dict = {}

    def target():
        try:
            out["result"] = box.run_python(source, stdin=stdin, wall_s=wall_s)
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), f"run_python still running {HANG_S:g} s after its start"
    if "error" in out:
        raise out["error"]
    return out["result"]


def leftovers(token: str) -> list[str]:
    """Command lines, of the processes now alive, that hold ``token``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if token in line and state not in (b"Z", b"X"):
            found.append(f"{pid}: {line}")
    return found


def hostile(box: Sandbox, source: str, marker: str, dirs=(), stdin: str = "") -> Result:
    """Run a hostile program and check that it was contained (see the module docstring)."""
    result = call(box, HEAD + source, stdin=stdin)
    assert result.returncode != 0 or result.timed_out, result
    script = result.stdout.split("\n", 1)[0]
    assert script.endswith("/main.py"), result
    assert not os.path.exists(os.path.dirname(script))
    assert leftovers(script) == [] and leftovers(marker) == []
    for d in {os.path.expanduser("~"), tempfile.gettempdir(), *dirs}:
        assert not [n for n in os.listdir(d) if marker in n], d
    return result


# --- hostile programs ------------------------------------------------------------------------

def test_an_infinite_loop_is_killed_at_the_wall_limit(box, marker):
    r = hostile(box, "while True:\n    pass\n", marker)
    assert r.timed_out and r.returncode is None


def test_a_fork_bomb_is_bounded_by_the_process_limit(box, marker):
    # Linear, and stopping at 300 forks, so that a sandbox that failed to bound it cannot
    # take this machine down; each child sleeps and is left to the sandbox to kill.
    source = ("n = 0\nwhile n < 300:\n    try:\n        pid = os.fork()\n"
              "    except OSError:\n        print(n, flush=True)\n        sys.exit(3)\n"
              "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    n += 1\n"
              "print(n, flush=True)\n")
    r = hostile(box, source, marker)
    assert r.returncode == 3, r  # a fork was refused before the 300th
    if ROOT:  # a run's own uid: exactly its allowance (the interpreter is one process)
        assert int(r.stdout.split()[1]) < LIMITS.processes


def test_a_memory_bomb_runs_out_of_address_space(box, marker):
    source = "blocks = []\nwhile True:\n    blocks.append(bytearray(32 << 20))\n"
    r = hostile(box, source, marker)
    assert r.returncode == 1 and "MemoryError" in r.stderr, r


def test_filling_the_disk_stops_at_the_file_size_limit(box, marker):
    source = ("with open('fill', 'wb') as f:\n    while True:\n"
              "        f.write(b'x' * (1 << 20))\n")
    r = hostile(box, source, marker)
    assert r.returncode in (-25, 1), r  # SIGXFSZ, or EFBIG where the signal is ignored


def test_megabytes_of_output_are_capped(box, marker):
    source = ("for _ in range(64):\n    sys.stdout.write('o' * 65536)\n"
              "    sys.stderr.write('e' * 65536)\nsys.exit(1)\n")
    r = hostile(box, source, marker)
    assert r.returncode == 1 and r.truncated
    assert len(r.stdout) == len(r.stderr) == LIMITS.output_bytes
    assert set(r.stderr) == {"e"}


def test_the_trainers_environment_is_out_of_reach(box, marker, monkeypatch):
    cannot(box, "rlimits", why="shares /proc/PID/environ with the trainer's user")
    monkeypatch.setenv("POSTTRAIN_SANDBOX_SECRET", marker)
    source = (f"found = os.environ.get('POSTTRAIN_SANDBOX_SECRET', '')\n"
              f"for pid in ({os.getpid()}, os.getppid(), 1):\n    try:\n"
              f"        found += open(f'/proc/{{pid}}/environ').read()\n"
              f"    except OSError:\n        pass\n"
              f"print(found)\nsys.exit(0 if {marker!r} in found else 1)\n")
    r = hostile(box, source, marker)
    assert marker not in r.stdout


def write_attempts(paths: list[str], scratch: list[str] = ()) -> str:
    """A program that writes each of ``paths`` and ``scratch`` and succeeds if it wrote one
    of ``paths``. (Writes into a fresh /tmp of its own succeed; the test looks for them where
    the trainer sees them.)"""
    return (f"wrote = []\nfor p in {[*paths, *scratch]!r}:\n    try:\n"
            f"        open(p, 'w').write('x')\n        wrote.append(p)\n"
            f"    except OSError:\n        pass\nprint(wrote)\n"
            f"sys.exit(0 if set(wrote) & set({paths!r}) else 1)\n")


def test_the_trainers_home_is_out_of_reach(box, marker):
    cannot(box, "rlimits", why="writes wherever the user may")
    home = os.path.expanduser("~")
    hostile(box, write_attempts([f"{home}/{marker}"]), marker)


@pytest.fixture
def made(marker):
    """Make a directory beside this file (where the trainer's files are, not /tmp, which the
    stronger levels replace): ``made(mode)``; removed afterwards."""
    paths = []

    def make(mode: int) -> str:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            f".sandbox-{marker}-{len(paths)}")
        os.mkdir(path)
        os.chmod(path, mode)
        paths.append(path)
        return path

    yield make
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def test_a_directory_of_the_trainer_is_out_of_reach(box, marker, made):
    cannot(box, "rlimits", why="writes wherever the user may")
    private = made(0o755)
    hostile(box, write_attempts([f"{private}/{marker}"]), marker, dirs=[private])


def test_a_world_writable_directory_of_the_trainer_is_out_of_reach(box, marker, made):
    cannot(box, "rlimits", why="runs in the trainer's file system, world-writable "
           "directories included", root_too=True)
    shared = made(0o1777)
    hostile(box, write_attempts([f"{shared}/{marker}"]), marker, dirs=[shared])


def test_nothing_is_left_in_tmp(box, marker):
    cannot(box, "rlimits", why="cannot tell the run's files in /tmp from the user's")
    # The program cannot tell a fresh /tmp of its own from the trainer's: it exits 1 either
    # way (no path counts as a success), and the files are looked for where the trainer
    # sees them.
    scratch = ["/tmp", "/var/tmp", "/dev/shm", tempfile.gettempdir()]
    hostile(box, write_attempts([], [f"{d}/{marker}" for d in scratch]), marker, dirs=scratch)


def test_the_network_is_out_of_reach(box, marker):
    cannot(box, "rlimits", why="does not cut the network", root_too=True)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        source = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), "
                  f"timeout=1).close()\nexcept OSError as e:\n    print(e)\n    sys.exit(1)\n")
        hostile(box, source, marker)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_the_trainer_cannot_be_killed(box, marker):
    cannot(box, "rlimits", why="may signal the trainer's other processes")
    source = (f"import signal\nok = 0\nfor pid in (os.getppid(), {os.getpid()}):\n    try:\n"
              f"        os.kill(pid, signal.SIGKILL)\n        ok += 1\n"
              f"    except OSError:\n        pass\ntime.sleep(0.2)\n"
              f"sys.exit(0 if ok == 2 else 1)\n")
    hostile(box, source, marker)
    assert os.getpid() > 0  # (still here to say so)


def test_a_detached_child_is_gone_after_the_call(box, marker):
    cannot(box, "rlimits", why="cannot find a child that left its session")
    # The grandchild is a new program, named by the marker (its command line no longer
    # holds the script's path).
    source = ("if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        os.execv(sys.executable, [sys.executable, '-c', "
              f"'import time; time.sleep(30)', {marker!r}])\n"
              "    os._exit(0)\ntime.sleep(0.5)\nsys.exit(3)\n")
    r = hostile(box, source, marker)
    assert r.returncode == 3 and not r.timed_out, r


def test_a_crash_in_native_code(box, marker):
    r = hostile(box, "import ctypes\nctypes.string_at(0)\n", marker)
    assert r.returncode == -11, r


def test_a_read_only_mess_is_removed(box, marker):
    source = ("os.makedirs('a/b')\nopen('a/b/f', 'w').close()\nos.chmod('a/b', 0o500)\n"
              "os.chmod('a', 0o000)\nos.chmod('.', 0o500)\nsys.exit(1)\n")
    hostile(box, source, marker)


# --- the plain contract ----------------------------------------------------------------------

def test_a_correct_program_passes_with_its_output(box):
    source = ("import os, sys\nprint('hello', sys.flags.isolated, os.getcwd() == "
              "os.environ['HOME'], sorted(os.listdir('.')), sorted(os.environ))\n")
    r = call(box, source)
    assert r.passed and not r.truncated and r.stderr == "", r
    assert r.stdout == "hello 1 True ['main.py'] ['HOME', 'LANG', 'PATH'" + (
        ", 'PWD'" if box.level == "bwrap" else "") + "]\n"


def test_the_program_may_use_temporary_files(box):
    source = ("import tempfile\nfor d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
              "    with tempfile.NamedTemporaryFile(dir=d) as f:\n        f.write(b'x')\n"
              "print('ok')\n")
    r = call(box, source)
    assert r.passed and r.stdout == "ok\n", r


def test_stdin_reaches_the_program(box):
    text = "line one\nzwei ü\n" + "x" * 200_000 + "\n"
    r = call(box, "import sys\ndata = sys.stdin.read()\nprint(len(data), data[:16])\n",
             stdin=text)
    assert r.passed and r.stdout == f"{len(text)} line one\nzwei ü\n\n", r


def test_a_failing_assert_gives_status_1_and_its_traceback(box):
    r = call(box, "def f():\n    assert 1 + 1 == 3, 'arithmetic'\nf()\n")
    assert r.returncode == 1 and not r.passed and not r.timed_out
    assert "Traceback" in r.stderr and "AssertionError: arithmetic" in r.stderr


def test_concurrent_calls_each_get_their_own_result(box):
    results: dict[int, list[Result]] = {}

    def worker(i: int) -> None:
        results[i] = [box.run_python(f"import sys\nprint({i} * 1000 + int(sys.stdin.read()))",
                                     stdin=str(j)) for j in range(3)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert not any(t.is_alive() for t in threads)
    for i in range(4):
        assert [r.stdout for r in results[i]] == [f"{i * 1000 + j}\n" for j in range(3)]
        assert all(r.passed for r in results[i])


# --- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_a_level_not_available_here_is_refused_in_one_line(level):
    if level in available_levels():
        pytest.skip(f"{level} is available here")
    with pytest.raises(SandboxError) as e:
        Sandbox(level)
    assert "\n" not in str(e.value) and level in str(e.value)


def test_an_unknown_level_is_refused_in_one_line():
    with pytest.raises(SandboxError, match="must be auto, bwrap, namespaces, rlimits") as e:
        Sandbox("docker")
    assert "\n" not in str(e.value)


def test_auto_takes_the_strongest_level():
    levels = available_levels()
    if not levels:
        pytest.skip("no level is available here")
    assert Sandbox().level == levels[0]


def test_limits_are_checked():
    with pytest.raises(ValueError, match=r"Limits\.memory_mb"):
        Limits(memory_mb=0)
