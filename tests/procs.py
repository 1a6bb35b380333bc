"""Child processes for the tests, ended with what they started when their time is up."""

from __future__ import annotations

import signal
import subprocess

GRACE_S = 60
"""How long a timed-out child has, after SIGTERM, to end what it started: torchrun sends
its workers (each in a session of its own, out of reach of a signal to its group) SIGTERM
and SIGKILL 30 s later; posttrain stops the servers it launched."""


def run(args: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)``,
    except past ``timeout``: ``subprocess.run`` SIGKILLs the child alone, which leaves
    torchrun's workers running (a hung collective spins for the rest of the suite, loading
    every test after it). Here the child is sent SIGTERM first and given
    :data:`GRACE_S` to end its workers, then killed; ``TimeoutExpired`` as before."""
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate(timeout=GRACE_S)
            raise subprocess.TimeoutExpired(args, timeout, out, err) from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
