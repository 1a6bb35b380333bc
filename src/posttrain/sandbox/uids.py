"""The uids runs get when the trainer is root: one each, from 61000-61127 (which must be
unused on the machine), so that RLIMIT_NPROC counts the run's processes alone, the program
cannot touch the trainer's files or processes, and "every process of this uid" is the whole
run, detached children included.

A uid is held across threads and processes through an exclusive ``flock`` on its file in a
root-only directory (``/run/posttrain-sandbox``). It leaves out killing (``procs.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import grp
import os
import pwd
import stat
import tempfile
import threading
import time
from collections import deque

from posttrain.sandbox import procs
from posttrain.sandbox.isolation import SandboxError

UID_FIRST, UID_COUNT = 61000, 128
"""61000-61127."""


class UidPool:
    """The uids runs get when the trainer is root, one per run at a time, across threads and
    processes: a uid is held by an exclusive ``flock`` on its file in a root-only directory
    (released by the kernel if the holder dies). The file is non-empty while a run of that
    uid may have processes: a holder that died leaves it so, and the next one kills them
    first. A uid with a passwd or group entry is never used. The uid used longest ago comes
    next: a run's killed orphans are zombies until init reaps them, and count against the
    process limit of the next run of their uid until then."""

    def __init__(self, first: int = UID_FIRST, count: int = UID_COUNT):
        self.first, self.count = first, count
        self._lock = threading.Lock()
        self._uids: deque[int] | None = None  # looked up on first use, not on import
        self._files: dict[int, int] = {}
        self._busy: set[int] = set()

    def take(self) -> int:
        with self._lock:
            if self._uids is None:
                self._uids = deque(u for u in range(self.first, self.first + self.count)
                                   if not _named(u))
            for uid in list(self._uids):
                if uid not in self._busy and self._claim(uid):
                    self._busy.add(uid)
                    self._uids.remove(uid)
                    self._uids.append(uid)
                    return uid
        raise SandboxError(f"all {self.count} sandbox uids from {self.first} are held by "
                           "runs of this or other processes, or named in passwd/group")

    def give(self, uid: int, clean: bool) -> None:
        """Hand ``uid`` back; ``clean``: no process of it is left."""
        with self._lock:
            fd = self._files[uid]
            if clean:
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            self._busy.discard(uid)

    def forget(self) -> None:
        """In a child made by fork: the parent's lock files are shared with it (one open
        file each, and one flock), so it closes them unlocked and starts its own."""
        for fd in self._files.values():
            os.close(fd)
        self._lock = threading.Lock()
        self._files, self._busy = {}, set()

    def _claim(self, uid: int) -> bool:
        fd = self._files.get(uid)
        if fd is None:
            fd = self._files[uid] = os.open(os.path.join(_lock_dir(), str(uid)),
                                            os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if os.pread(fd, 1, 0) and not procs.kill_uid(uid, time.monotonic() + 5):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        os.pwrite(fd, b"1", 0)
        return True


def _named(uid: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


@functools.cache
def _lock_dir() -> str:
    """A directory only root may write, for the uids' lock files."""
    base = "/run" if os.path.isdir("/run") else tempfile.gettempdir()
    path = os.path.join(base, "posttrain-sandbox")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise SandboxError(f"{path} must be a directory only root may write")
    return path


pool = UidPool()
"""The process's one pool."""
os.register_at_fork(after_in_child=pool.forget)
