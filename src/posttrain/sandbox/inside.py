"""The ``namespaces`` level's set-up, run as the first process inside fresh namespaces.

``unshare`` (util-linux) makes the namespaces (mount, network, pid, ipc, uts; a user namespace
too when the trainer is not root) and starts this file as their pid 1, still privileged
there. It then, with plain system calls:

1. starts a new session, so the program cannot signal the ``unshare`` process's group;
2. mounts fresh size-capped tmpfs over ``/tmp``, ``/var/tmp`` and ``/dev/shm``, and over the
   directories that hide things (the trainer's home; as root, any directory on the way to the
   interpreter that others may not enter), binding back from descriptors opened first the
   paths under them that the run needs (the interpreter's directories, the run directory);
3. remounts every other mount read-only, so the run directory and the fresh tmpfs are the
   only places the program can write;
4. sets the resource limits, empties the capability bounding set, drops to the run's uid when
   it has one (the trainer is root) and sets no_new_privs, so the program holds no
   privilege and gains none by executing anything;
5. executes the interpreter on the program, which becomes pid 1: when it ends, the kernel
   kills every other process of the namespace.

It is run as ``python -I -S inside.py CONFIG`` (the trainer's dict through ``marshal``, in
hex) and imports only ``ctypes`` and ``resource``: ``json`` and ``signal`` would double its
start-up. The trainer does not import it. It leaves out everything the trainer decides
(paths, limits, the uid); an error ends it with status 125 and one line on stderr.
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
SIGKILL = 9

# A remount must repeat the flags a less privileged namespace inherited locked, or it is
# refused; these are the ones mountinfo spells out.
LOCKABLE = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
            "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
# Kernel file systems: not the program's to write as an unprivileged uid, and some refuse a
# remount; /proc is the pid namespace's own (unshare --mount-proc).
PSEUDO = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs",
          "securityfs", "pstore", "bpf", "configfs", "fusectl", "binfmt_misc", "autofs",
          "hugetlbfs", "efivarfs", "selinuxfs", "rpc_pipefs", "nsfs"}
libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of the set-up failed; its message is the one line the trainer gets."""


def call(name: str, result: int, what: str) -> None:
    if result != 0:
        raise SetupError(f"{name} {what}: {os.strerror(ctypes.get_errno())}")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    def b(s):
        return None if s is None else s.encode()
    call("mount", libc.mount(b(source), b(target), b(fstype), ctypes.c_ulong(flags), b(data)),
         target)


def under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def mount_tmpfs(target: str, mode: str, size_mb: int) -> None:
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},size={size_mb}m")


def cover_and_rebind(cfg: dict) -> tuple[set[str], set[str]]:
    """Step 2; returns the mount points the program may write, and all those made here."""
    fresh = [p for p in cfg["tmpfs"] if os.path.isdir(p)]
    rebind = [p for p in cfg["expose"] if any(under(p, c) for c in cfg["covers"] + fresh)]
    # O_PATH descriptors keep the directories reachable once a tmpfs hides their paths; the
    # bind below goes through /proc/self/fd, which names the directory, not the path.
    held = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in [*rebind, cfg["run"]]}
    for path in cfg["covers"]:
        mount_tmpfs(path, "0755", 1)
    for path in fresh:
        mount_tmpfs(path, "1777", cfg["tmpfs_mb"])
    for path, fd in held.items():
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    writable = {cfg["run"], *fresh}
    return writable, writable | set(cfg["covers"]) | set(rebind)


def unescape(field: str) -> str:
    """A mountinfo path: a space, tab, newline or backslash is written as \\ and 3 octal
    digits."""
    head, *rest = field.split("\\")
    return head + "".join(chr(int(p[:3], 8)) + p[3:] for p in rest)


def mounts() -> list[tuple[str, set[str], str]]:
    """(mount point, its per-mount options, file system type) from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            out.append((unescape(fields[4]), set(fields[5].split(",")), right.split()[0]))
    return out


def read_only_elsewhere(writable: set[str], ours: set[str], hiding: list[str]) -> None:
    """Step 3: every mount read-only except the program's own and the kernel's."""
    for point, options, fstype in mounts():
        if point in writable or fstype in PSEUDO or "ro" in options:
            continue
        if point not in ours and any(under(point, h) for h in hiding):
            continue  # under a fresh tmpfs: its path now names something else
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, bit in LOCKABLE.items():
            if name in options:
                flags |= bit
        try:
            mount(None, point, None, flags)
        except SetupError:
            # A mount another one hides: its path leads elsewhere, and what it leads to is
            # read-only by now (mountinfo lists a parent first), or to nothing.
            if reachable_and_writable(point):
                raise


def reachable_and_writable(path: str) -> bool:
    try:
        return not os.statvfs(path).f_flag & os.ST_RDONLY
    except OSError:
        return False


def limit_and_drop(cfg: dict) -> None:
    """Step 4."""
    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        call("prctl", libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0),
             f"CAPBSET_DROP {cap}")
    uid = cfg["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        # A change of credentials clears the parent-death signal unshare --kill-child set.
        call("prctl", libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(SIGKILL), 0, 0, 0),
             "PDEATHSIG")
    call("prctl", libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), 0, 0, 0), "NO_NEW_PRIVS")


def main(argv: list[str]) -> None:
    cfg = marshal.loads(bytes.fromhex(argv[1]))
    try:
        os.setsid()
        writable, ours = cover_and_rebind(cfg)
        read_only_elsewhere(writable, ours, cfg["covers"] + cfg["tmpfs"])
        limit_and_drop(cfg)
        os.chdir(cfg["run"])
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except (SetupError, OSError) as e:
        sys.stderr.write(f"sandbox set-up failed: {e}\n")
        sys.stderr.flush()
        os._exit(125)


if __name__ == "__main__":
    main(sys.argv)
