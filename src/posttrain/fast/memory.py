"""Process-level memory settings the trainers apply on start-up (with fast and
keep_freed_memory on)."""

from __future__ import annotations

import ctypes
import sys

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper bound on 64-bit systems
_NEVER_TRIM = 2**31 - 1  # bytes; the largest value mallopt's int takes

_applied = False


def keep_freed_memory() -> bool:
    """Have glibc's ``malloc`` keep the memory the process frees, for reuse, instead of handing
    it back to the kernel; returns whether the setting is in effect (Linux with glibc).

    PyTorch's CPU allocator is plain ``malloc``. A training step allocates its activations,
    frees them in the backward pass, and allocates them again next step. With glibc's
    defaults, blocks above a (dynamic) threshold are ``mmap``-ed and unmapped on free, and
    free memory at the top of the heap is trimmed, so every step touches fresh pages and pays
    a page fault, with zeroing, per 4 KiB (expensive in virtual machines). Here blocks up to
    32 MiB come from the heap and the heap is never trimmed: pages are faulted once, in the
    first step. The process's resident memory then stays at its peak, which is what a
    training run's peak already is. It changes no result; what it saves is measured by
    ``benchmarks/grpo_speed.py`` (docs/benchmarks.md).
    Process-wide and applied once; it does not apply to CUDA memory, which PyTorch caches
    itself.
    """
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library the interpreter runs on
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only; musl has no such tunables
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1 and ok
    _applied = ok
    return ok
