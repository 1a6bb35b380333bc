"""Moving a run's pipes: its stdin from a byte string, its stdout and stderr into buffers
capped at a size (the rest read and dropped, so a program printing without end neither
blocks nor fills memory), until the process exits or a deadline — all in the calling thread,
through one selector.

The exit is seen through a pidfd (or, without pidfds, by polling ``waitid`` with WNOWAIT),
never by reaping: the caller kills what is left of the run while the leader's pid still
names it. It leaves out starting and killing processes.
"""

from __future__ import annotations

import os
import selectors
import time


class Output:
    """What one pipe brought, up to the cap."""

    def __init__(self, cap: int):
        self.data = bytearray()
        self.cap = cap
        self.truncated = False

    def take(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        if len(chunk) > max(room, 0):
            self.truncated = True

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def watch(sel, proc, stdin: bytes, outputs: dict) -> int | None:
    """Register the pipes and (where there are pidfds) the process's exit; returns the
    pidfd, to close."""
    for fd in outputs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, [proc.stdin, memoryview(stdin)])
    else:
        proc.stdin.close()
    try:  # readable once the process has exited; it is not reaped, so its pid stays its own
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return None  # no pidfds: pump() polls
    sel.register(pidfd, selectors.EVENT_READ, "exit")
    return pidfd


def exited(pid: int) -> bool:
    """Whether ``pid`` has ended, without reaping it."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return info is not None


def pump(sel, proc, outputs: dict, deadline: float) -> bool:
    """Move stdin and output until ``proc`` exits (True) or the deadline (False); with no
    ``proc``, until the pipes close or the deadline."""
    polling = proc is not None and not any(k.data == "exit" for k in sel.get_map().values())
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or (proc is None and not any(k.fd in outputs for k in
                                                  sel.get_map().values())):
            return False
        for key, _ in sel.select(min(left, 0.01) if polling else left):
            if key.data == "exit":
                if proc is not None:
                    return True
            elif key.fd in outputs:
                read(sel, key.fd, outputs[key.fd])
            else:
                write(sel, key)
        if polling and exited(proc.pid):
            return True


def read(sel, fd: int, output: Output) -> None:
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        return
    if chunk:
        output.take(chunk)
    else:
        sel.unregister(fd)


def write(sel, key) -> None:
    stream, data = key.data
    try:
        n = os.write(key.fd, data[:1 << 16])
    except BlockingIOError:
        return
    except OSError:  # the program closed its stdin (EPIPE): the rest is not wanted
        n = len(data)
    if n == len(data):
        sel.unregister(key.fd)
        stream.close()  # (through its file object: the fd is closed once, never reused here)
    else:
        key.data[1] = data[n:]
