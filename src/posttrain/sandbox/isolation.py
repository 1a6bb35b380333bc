"""The isolation levels: the command line each one wraps around the interpreter, and what
each needs from this machine.

- ``bwrap``: bubblewrap builds a new root from read-only binds of the system directories and
  the interpreter's, a writable bind of the run directory, fresh /tmp, /var/tmp, /dev/shm,
  /proc and /dev, in new pid, network, ipc, uts (and cgroup) namespaces; as root without a
  user namespace (one would map the program to root outside, where RLIMIT_NPROC does not
  apply), the program then drops to the run's uid through setpriv. Not root: a user
  namespace too (``--unshare-all``).
- ``namespaces``: ``unshare`` makes new mount, network, pid, ipc and uts namespaces (and a
  user namespace when not root); ``inside.py`` then mounts, limits and drops privileges.
  (setpriv sets unshare's parent-death signal: bwrap has --die-with-parent.)
- ``rlimits``: resource limits (prlimit), a clean environment, a temporary directory and a
  process group; as root, the run's own unprivileged uid (setpriv).

Resource limits are set by ``prlimit`` before the wrapper (``bwrap``, ``rlimits``) or by
``inside.py`` (``namespaces``). This module leaves out running, reading output and killing
(``run.py``, ``pipes.py``, ``procs.py``), the uids (``uids.py``), and whether a level really
works here (``run.py`` probes it).
"""

from __future__ import annotations

import functools
import marshal
import math
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.sandbox import procs

if TYPE_CHECKING:
    from posttrain.sandbox.run import Limits

LEVELS = ("bwrap", "namespaces", "rlimits")
"""Strongest first."""
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")
"""World-writable places: fresh tmpfs in the bwrap and namespaces levels."""
INSIDE = str(Path(__file__).with_name("inside.py"))
NEEDS = {"bwrap": ("bwrap", "prlimit", "setpriv"), "namespaces": ("unshare", "setpriv"),
         "rlimits": ("prlimit", "setpriv")}


class SandboxError(RuntimeError):
    """A level that is not available here, or a run the sandbox could not start."""


@dataclass(frozen=True)
class Launch:
    """How one run is started."""

    argv: list[str]
    """The command: the wrappers, then the interpreter on the program."""
    env: dict[str, str]
    """The whole environment it starts with."""


def root() -> bool:
    return os.geteuid() == 0


def environment(directory: str) -> dict[str, str]:
    """None of the trainer's variables: a minimal PATH, HOME = the run directory."""
    return {"PATH": SAFE_PATH, "HOME": directory, "LANG": "C.UTF-8"}


@functools.cache
def tool(name: str) -> str | None:
    return shutil.which(name)


@functools.cache
def interpreter_dirs() -> tuple[str, ...]:
    """The directories the interpreter reads: its prefixes (a virtual environment's and the
    base installation's) and those of each link on the way to the executable, outermost
    only."""
    dirs = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    link = os.path.abspath(sys.executable)
    for _ in range(40):
        dirs.add(os.path.dirname(link))
        if not os.path.islink(link):
            break
        link = os.path.join(os.path.dirname(link), os.readlink(link))
    dirs |= {os.path.realpath(d) for d in dirs}
    found = sorted(d for d in dirs if os.path.isdir(d) and d != "/")
    return tuple(d for d in found if not any(inside(d, o) and d != o for o in found))


def inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def closed_ancestor(path: str) -> str | None:
    """The outermost directory above ``path`` that others may not enter (no o+x): what keeps
    an unprivileged uid from reaching it."""
    parts = Path(path).parts
    for i in range(2, len(parts)):
        above = str(Path(*parts[:i]))
        if not os.stat(above).st_mode & stat.S_IXOTH:
            return above
    return None


def missing(level: str) -> str | None:
    """Why ``level`` cannot work here, as far as can be told without running it."""
    for name in NEEDS[level]:
        if tool(name) is None:
            package = "bubblewrap" if name == "bwrap" else "util-linux"
            return f"{name} is not on PATH (package {package})"
    if level == "rlimits" and root():
        for d in (*interpreter_dirs(), tempfile.gettempdir()):
            closed = closed_ancestor(d)
            if closed:
                return (f"as root a run drops to an unprivileged uid, which cannot reach "
                        f"{d} (the interpreter's, or the temporary directory): {closed} is "
                        "closed to others")
    return None


def rlimits(limits: Limits, nproc: int) -> dict[str, tuple[int, int]]:
    """The resource limits by ``resource`` name, (soft, hard). The CPU limit's hard value is
    a second above the soft one: SIGXCPU first, then SIGKILL."""
    cpu = max(1, math.ceil(limits.cpu_s))
    mb = 1 << 20
    return {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (int(limits.memory_mb * mb),) * 2,
            "RLIMIT_NPROC": (int(nproc),) * 2, "RLIMIT_FSIZE": (int(limits.file_mb * mb),) * 2,
            "RLIMIT_NOFILE": (int(limits.open_files),) * 2, "RLIMIT_CORE": (0, 0)}


def nproc(limits: Limits, uid: int | None) -> int:
    """RLIMIT_NPROC counts every task of the real uid. A run's own uid has nothing else; the
    trainer's uid (not root) has the trainer's threads and the user's other processes, so
    the run gets those plus its own allowance: a looser bound, but one the program cannot
    exceed."""
    if uid is not None:
        return limits.processes
    return procs.user_tasks(os.getuid()) + limits.processes


def prlimit(limits: Limits, uid: int | None) -> list[str]:
    flags = {"RLIMIT_CPU": "cpu", "RLIMIT_AS": "as", "RLIMIT_NPROC": "nproc",
             "RLIMIT_FSIZE": "fsize", "RLIMIT_NOFILE": "nofile", "RLIMIT_CORE": "core"}
    values = rlimits(limits, nproc(limits, uid))
    return [tool("prlimit"), *(f"--{flags[k]}={s}:{h}" for k, (s, h) in values.items()), "--"]


def drop(uid: int) -> list[str]:
    """setpriv to ``uid``: no groups, no capabilities (bounding set included), and
    no_new_privs, so no set-uid or file-capability program gives any back."""
    return [tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]


def launch(level: str, directory: str, script: str, uid: int | None,
           limits: Limits) -> Launch:
    env = environment(directory)
    program = [sys.executable, "-I", script]
    if level == "rlimits":
        # The parent-death signal takes the program down with the trainer's thread.
        setpriv = drop(uid) if uid is not None else [tool("setpriv"), "--no-new-privs"]
        argv = [*prlimit(limits, uid), *setpriv, "--pdeathsig=KILL", "--", *program]
    elif level == "namespaces":
        argv = _unshare(directory, uid, limits, env, program)
    else:
        argv = _bwrap(directory, uid, limits, env, program)
    return Launch(argv, env)


def _scratch_mb(limits: Limits) -> int:
    """Each fresh tmpfs holds a few files of the largest size a program may write."""
    return 4 * limits.file_mb


def _unshare(directory: str, uid: int | None, limits: Limits, env: dict[str, str],
             program: list[str]) -> list[str]:
    home = os.path.expanduser("~")
    covers = {home} if home != "/" and os.path.isdir(home) else set()
    if uid is not None:  # the run's uid must reach the interpreter and its directory
        covers |= {c for d in (*interpreter_dirs(), directory) if (c := closed_ancestor(d))}
    covers = {c for c in covers if not any(inside(c, s) for s in SCRATCH)}
    covers = sorted(c for c in covers if not any(inside(c, o) and c != o for o in covers))
    config = {"run": directory, "uid": uid, "rlimits": rlimits(limits, nproc(limits, uid)),
              "tmpfs": list(SCRATCH), "tmpfs_mb": _scratch_mb(limits), "covers": covers,
              "expose": list(interpreter_dirs()), "argv": program, "env": env}
    user = [] if uid is not None else ["--user", "--map-root-user"]
    # unshare outlives the trainer unless told; when it dies, --kill-child takes pid 1, and
    # pid 1 the rest of the namespace.
    return [tool("setpriv"), "--pdeathsig=KILL", "--", tool("unshare"), *user, "--mount",
            "--net", "--pid", "--ipc", "--uts",
            "--kill-child", "--mount-proc", "--", sys.executable, "-I", "-S", INSIDE,
            marshal.dumps(config).hex()]


def _system_binds() -> list[str]:
    out = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):  # a merged /usr: /bin -> usr/bin
            out += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            out += ["--ro-bind", name, name]
    return out


def _bwrap(directory: str, uid: int | None, limits: Limits, env: dict[str, str],
           program: list[str]) -> list[str]:
    if uid is None:
        unshare = ["--unshare-all"]
        setpriv = []
    else:  # no user namespace: see the module's docstring
        # Kept until setpriv drops them all: uid and groups, the bounding set, and entering
        # the run directory (bwrap's --chdir, as root, into a directory of the run's uid).
        caps = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_DAC_OVERRIDE")
        unshare = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                   "--unshare-cgroup-try", "--cap-drop", "ALL",
                   *(a for c in caps for a in ("--cap-add", c))]
        setpriv = drop(uid)
    size = str(_scratch_mb(limits) << 20)
    scratch = [a for d in SCRATCH for a in ("--perms", "1777", "--size", size, "--tmpfs", d)]
    dirs = [d for d in interpreter_dirs() if not any(inside(d, s) for s in ("/usr", "/etc"))]
    # bwrap makes the directories above a bind 0700, which the run's uid could not enter.
    system = ("/usr", "/etc", *SCRATCH)
    above = sorted({str(p) for d in [*dirs, directory] for p in Path(d).parents
                    if str(p) != "/" and not any(inside(str(p), s) for s in system)},
                   key=lambda p: p.count("/"))
    binds = [*(a for p in above for a in ("--perms", "0755", "--dir", p)),
             *(a for d in dirs for a in ("--ro-bind", d, d))]
    setenv = [a for k, v in env.items() for a in ("--setenv", k, v)]
    return [*prlimit(limits, uid), tool("bwrap"), *unshare, "--die-with-parent",
            "--new-session", "--clearenv", *setenv, *_system_binds(), "--proc", "/proc",
            "--dev", "/dev", *scratch, *binds, "--bind", directory, directory,
            "--chdir", directory, "--", *setpriv, *program]


def remove_strays(uid: int) -> None:
    """The rlimits level as root: what the run's uid left in the usual world-writable
    directories (at their top level; deeper or elsewhere is not looked for)."""
    for top in {tempfile.gettempdir(), *SCRATCH}:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass
