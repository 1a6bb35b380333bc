"""Running one untrusted Python program: ``Sandbox.run_python`` and the levels available here.

A run gets a fresh temporary directory as its working directory and HOME (the program is
``main.py`` there), ``sys.executable -I`` on it, a minimal environment, its stdin from a
string, a new session, resource limits and a wall-clock limit, at the isolation level of the
``Sandbox`` (``isolation.py``). Its stdout and stderr are read as they come, each kept up to
a cap (the rest read and dropped). The run ends when its first process ends or at the wall
limit; then every process of the run is killed — when the trainer is root, every process of
the run's uid (detached ones too) — and waited for, and the directory removed, before the
call returns. Every wait has a deadline.

It leaves out what a program's output means (the reward code reads it) and logging: the
caller logs the level once.
"""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from posttrain.sandbox import isolation, pipes, procs, uids
from posttrain.sandbox.isolation import LEVELS, SandboxError

CLEANUP_S = 5.0
"""How long the killing of a run's processes may take before the call gives up on them."""
DRAIN_S = 0.25
"""How long output is still read once the run's processes are killed."""
PROBE_WALL_S = 30.0
"""A level's probe (a trivial program) fails if it has not finished by then."""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    cpu_s: float = 5.0
    """CPU seconds (RLIMIT_CPU, rounded up to whole seconds): SIGXCPU, then SIGKILL 1 s on."""
    wall_s: float = 10.0
    """Wall-clock seconds; then every process of the run is killed."""
    memory_mb: int = 1024
    """Address space of each process (RLIMIT_AS), MiB."""
    processes: int = 32
    """Processes and threads of the run (RLIMIT_NPROC; see ``isolation.nproc``)."""
    file_mb: int = 16
    """Largest file a process may write (RLIMIT_FSIZE), MiB."""
    open_files: int = 64
    """Open file descriptors of each process (RLIMIT_NOFILE)."""
    output_bytes: int = 65536
    """Bytes kept of stdout and of stderr each; the rest is read and discarded."""

    def __post_init__(self):
        for name, value in vars(self).items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"Limits.{name} must be a finite number > 0, got {value!r}")


@dataclass
class Result:
    """How one run ended."""

    returncode: int | None
    """The program's exit status; negative: killed by that signal; None: killed at the wall
    limit."""
    stdout: str
    """What it wrote to stdout (UTF-8, undecodable bytes replaced), up to the cap."""
    stderr: str
    """The same for stderr."""
    timed_out: bool
    """It was still running at the wall limit."""
    truncated: bool
    """Some of stdout or stderr was over the cap and discarded."""
    seconds: float
    """Wall-clock seconds from its start until all its processes were gone."""

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class Sandbox:
    """Runs untrusted Python programs at one isolation level; ``run_python`` may be called
    from several threads at once."""

    def __init__(self, isolation: str = "auto", limits: Limits = Limits()):
        self.level = _choose(isolation)
        self.limits = limits

    def run_python(self, source: str, stdin: str = "", wall_s: float | None = None) -> Result:
        wall = self.limits.wall_s if wall_s is None else wall_s
        if not (math.isfinite(wall) and wall > 0):
            raise ValueError(f"wall_s must be a finite number > 0, got {wall!r}")
        return _run(self.level, self.limits, source, stdin, wall)


# --- choosing a level -----------------------------------------------------------------------

_why_not: dict[str, str | None] = {}
_probe_lock = threading.Lock()


def available_levels() -> list[str]:
    """The levels that run a trivial program correctly here, strongest first (probed once per
    process)."""
    return [level for level in LEVELS if _reason(level) is None]


def _reason(level: str) -> str | None:
    """None if ``level`` works here, else why not (one line)."""
    with _probe_lock:
        if level not in _why_not:
            _why_not[level] = _probe(level)
        return _why_not[level]


def _choose(isolation: str) -> str:
    if isolation == "auto":
        for level in LEVELS:
            if _reason(level) is None:
                return level
        raise SandboxError("no sandbox isolation works here: " + "; ".join(
            f"{level}: {_reason(level)}" for level in LEVELS))
    if isolation not in LEVELS:
        raise SandboxError(f"sandbox isolation must be auto, {', '.join(LEVELS)}; got "
                           f"{isolation!r}")
    why = _reason(isolation)
    if why is not None:
        raise SandboxError(f"sandbox isolation {isolation!r} is not available here: {why}")
    return isolation


def _probe(level: str) -> str | None:
    why = isolation.missing(level)
    if why is not None:
        return why
    report = "import sys; print(repr((sys.prefix, sys.base_prefix, sys.version)))"
    try:
        result = _run(level, Limits(), report, "", PROBE_WALL_S)
    except (OSError, SandboxError) as e:
        return _one_line(f"a trivial program could not start: {e}")
    if result.timed_out:
        return f"a trivial program did not finish in {PROBE_WALL_S:g} s"
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return _one_line(f"a trivial program failed (status {result.returncode}): {last}")
    expected = repr((sys.prefix, sys.base_prefix, sys.version))
    if result.stdout.strip() != expected:
        return _one_line(f"the interpreter there is not this one (it reports "
                         f"{result.stdout.strip()}): it cannot read this one's files")
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


# --- one run ---------------------------------------------------------------------------------

def _run(level: str, limits: Limits, source: str, stdin: str, wall: float) -> Result:
    uid = uids.pool.take() if isolation.root() else None
    clean, directory = False, None
    try:
        directory = tempfile.mkdtemp(prefix="posttrain-sandbox-")
        script = os.path.join(directory, "main.py")
        with open(script, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(source)
        if uid is not None:
            os.chown(script, uid, uid)
            os.chown(directory, uid, uid)
        launch = isolation.launch(level, directory, script, uid, limits)
        result, clean = _execute(launch, directory, stdin.encode("utf-8", "surrogatepass"),
                                 wall, limits.output_bytes, uid, level != "rlimits")
        if level == "bwrap" and result.returncode is not None \
                and 128 < result.returncode <= 128 + 64:
            # bwrap reports a program killed by signal N as status 128 + N
            result.returncode = 128 - result.returncode
        if uid is not None and level == "rlimits":
            isolation.remove_strays(uid)
        return result
    finally:
        if directory is not None:
            _remove(directory)
        if uid is not None:
            uids.pool.give(uid, clean)


def _execute(launch: isolation.Launch, directory: str, stdin: bytes, wall: float, cap: int,
             uid: int | None, sealed: bool) -> tuple[Result, bool]:
    """Run ``launch``; returns its result and whether every process of it is gone.
    ``sealed``: the run is a pid namespace whose init the leader waits for, so once the
    leader has exited by itself no process of the run is left."""
    start = time.monotonic()
    deadline = start + wall
    proc = subprocess.Popen(launch.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=directory, env=launch.env,
                            start_new_session=True, bufsize=0)
    outputs = {proc.stdout.fileno(): pipes.Output(cap), proc.stderr.fileno(): pipes.Output(cap)}
    exited, clean, pidfd = False, False, None
    with selectors.DefaultSelector() as sel:
        try:
            pidfd = pipes.watch(sel, proc, stdin, outputs)
            exited = pipes.pump(sel, proc, outputs, deadline)
        finally:
            if pidfd is not None:  # (readable from now on: it would spin the drain below)
                sel.unregister(pidfd)
            clean = _stop(proc, uid, exited, sealed)
            pipes.pump(sel, None, outputs, time.monotonic() + DRAIN_S)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                with contextlib.suppress(OSError):
                    stream.close()
            if pidfd is not None:
                os.close(pidfd)
    out, err = outputs.values()
    return Result(proc.returncode if exited else None, out.text(), err.text(), not exited,
                  out.truncated or err.truncated, time.monotonic() - start), clean


def _stop(proc: subprocess.Popen, uid: int | None, exited: bool, sealed: bool) -> bool:
    """Kill every process of the run that is left and wait for them; True when all are
    gone. The leader is reaped last: until then its pid, and so its process group's id,
    cannot name another process. A sealed run whose leader exited needs no search for its
    uid's processes: the kernel killed them all before the leader could exit."""
    deadline = time.monotonic() + CLEANUP_S
    fds = []
    if not exited:  # the wrappers' children: a namespace's first process, set up as root
        fds = [fd for p in procs.descendants(proc.pid) if (fd := procs.kill(p)) is not None]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    clean = True
    if uid is not None and not (exited and sealed):
        clean = procs.kill_uid(uid, deadline)
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        clean = False
    return procs.wait_gone(fds, deadline) and clean


def _remove(directory: str) -> None:
    """Remove the run directory, whatever modes the program left in it."""
    try:
        shutil.rmtree(directory)
    except FileNotFoundError:
        return
    except OSError:  # a directory made read-only (or unreadable): open everything up first
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o700)
        for top, dirs, _ in os.walk(directory):  # (it lists a directory after this loop's turn)
            for d in dirs:
                with contextlib.suppress(OSError):
                    if not os.path.islink(os.path.join(top, d)):
                        os.chmod(os.path.join(top, d), 0o700)
        shutil.rmtree(directory, ignore_errors=True)


if sys.platform != "linux":  # pragma: no cover
    raise ImportError("posttrain.sandbox needs Linux (/proc, namespaces, rlimits)")
