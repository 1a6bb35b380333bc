"""Process-level settings: glibc keeps freed memory for reuse once asked to."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys, torch
from posttrain.fast.memory import keep_freed_memory
ok = keep_freed_memory() if sys.argv[1] == "keep" else None
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
x = torch.ones(4 << 20)  # 16 MiB, touched
before = rss()
del x
print(ok, before - rss())
"""


def _released(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables")
def test_keep_freed_memory_stops_returning_blocks_to_the_kernel():
    import ctypes

    if not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("not glibc")
    ok, kept_released = _released("keep")
    _, default_released = _released("default")
    assert ok == "True"
    # by default the 16 MiB block is unmapped on free; kept, it stays for the next step
    assert default_released >= 12 << 20
    assert kept_released < 2 << 20
