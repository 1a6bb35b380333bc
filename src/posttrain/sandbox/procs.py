"""A run's processes, found and killed through ``/proc``: those of one uid, and those
descended from one process.

Signals go through pidfds (Linux 5.3+; plain ``kill`` where there are none), opened and then
checked against ``/proc`` again, so a pid the kernel has handed to another process since it
was listed is never signalled. Every wait here ends at a deadline. Linux only; it leaves out
which processes belong to a run (the caller knows: a uid it gave the run, or the process it
started).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Proc:
    """One process as ``/proc`` shows it at one moment."""

    pid: int
    """Its id in this pid namespace."""
    ppid: int
    """Its parent's id."""
    alive: bool
    """False once it has exited (a zombie awaiting its parent counts as gone)."""


def _stat(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:  # gone, or /proc hides it
        return None
    # The command name may hold spaces and parentheses: the fields follow the last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    return Proc(pid, int(fields[1]), fields[0] not in (b"Z", b"X"))


def _uids(pid: int) -> tuple[int, ...]:
    """Real, effective, saved and file-system uid (not the owner of /proc/PID, which a
    process that makes itself undumpable hands to root)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            data = f.read()
    except OSError:
        return ()
    start = data.find(b"\nUid:") + 5
    return tuple(int(x) for x in data[start:data.find(b"\n", start)].split())


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def of_uid(uid: int) -> list[int]:
    """The live processes any of whose uids is ``uid``."""
    out = []
    for pid in _pids():
        if uid in _uids(pid):
            p = _stat(pid)
            if p is not None and p.alive:
                out.append(pid)
    return out


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (its children, theirs, ...), at this moment."""
    children: dict[int, list[int]] = {}
    for p in filter(None, map(_stat, _pids())):
        if p.alive:
            children.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, ()))
    return out


def kill(pid: int, still=lambda pid: True) -> int | None:
    """SIGKILL ``pid`` if ``still(pid)`` holds once it is pinned; returns its pidfd (to wait
    on) or None."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):  # no pidfds here: a plain kill, checked first
        if still(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return None
    if still(pid):
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        return fd
    os.close(fd)
    return None


def wait_gone(fds: list[int], deadline: float) -> bool:
    """Wait until each pidfd's process has exited; closes them. False at the deadline."""
    try:
        pending = list(fds)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select(pending, [], [], left)
            pending = [fd for fd in pending if fd not in ready]
        return True
    finally:
        for fd in fds:
            os.close(fd)


def kill_tree(pid: int, deadline: float) -> bool:
    """SIGKILL every live descendant of ``pid`` (not ``pid``) and wait until they are gone."""
    fds = [fd for p in descendants(pid) if (fd := kill(p)) is not None]
    return wait_gone(fds, deadline)


def kill_uid(uid: int, deadline: float) -> bool:
    """SIGKILL every process of ``uid`` until none is left; False if some outlive the
    deadline. A fork bomb cannot outrun it: a killed process forks no more, and each pass
    kills every process the previous one missed."""
    while True:
        pids = of_uid(uid)
        if not pids:
            return True
        if time.monotonic() >= deadline:
            return False
        fds = [fd for p in pids if (fd := kill(p, lambda q: uid in _uids(q))) is not None]
        if fds:
            wait_gone(fds, deadline)
        else:  # no pidfds to wait on
            time.sleep(0.005)


def user_tasks(uid: int) -> int:
    """How many tasks (threads included) ``uid`` runs now: what RLIMIT_NPROC counts."""
    total = 0
    for pid in _pids():
        if _uids(pid)[:1] == (uid,):
            with contextlib.suppress(OSError):  # gone meanwhile
                total += len(os.listdir(f"/proc/{pid}/task"))
    return total
