"""Calls that may never return: an environment's construction, ``reset`` and ``step``, a
tool's function (:mod:`posttrain.episodes`), a reward term (:mod:`posttrain.rewards`), run
where they cannot hold the process.

Python cannot stop a thread, so a call past its timeout is abandoned, not ended: it
finishes, or not, in the background. It must not keep the process alive after that. The
threads of a ``concurrent.futures`` pool are joined when the interpreter exits, so a
``step`` that never returns would hold the process forever after the run's one-line error;
the threads here are daemon threads, which the interpreter leaves behind. A pool with an
abandoned call is abandoned with it: its other threads end once they are free, and the next
call gets a fresh pool.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref


class Workers:
    """``n`` daemon threads that run the submitted calls in order of submission, each
    handing back a :class:`concurrent.futures.Future`."""

    def __init__(self, n: int, name: str = "posttrain-env"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            # (the threads hold the queue, not the pool: a pool no longer referenced ends them)
            threading.Thread(target=_serve, args=(self._calls,), name=f"{name}-{i}",
                             daemon=True).start()
        self.abandon = weakref.finalize(self, _stop, self._calls, n)
        """Take no more calls: each thread ends after the calls already submitted (one in a
        call that never returns stays there, a daemon). Also run when the pool is
        collected."""

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        return future


def _serve(calls: queue.SimpleQueue) -> None:
    while True:
        call = calls.get()
        if call is None:
            return
        _run(*call)
        del call  # (an idle thread keeps no environment alive)


def _run(future: concurrent.futures.Future, fn, args: tuple) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as e:
        future.set_exception(e)
    else:
        future.set_result(result)


def _stop(calls: queue.SimpleQueue, n: int) -> None:
    for _ in range(n):
        calls.put(None)


_local = threading.local()


def timed(fn, timeout: float, *args):
    """``fn(*args)``, or TimeoutError past ``timeout`` seconds (0: no limit; the call then
    runs on the caller's thread). Each calling thread has a worker of its own, so the calls
    of ``--env_workers`` threads (tools inside their steps) run side by side, each timed
    from its own start. Past the timeout the call is abandoned with its worker."""
    if not timeout:
        return fn(*args)
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = Workers(1)
    future = pool.submit(fn, *args)
    # (wait, then look: a TimeoutError that fn raised itself is fn's error, not a timeout)
    if not concurrent.futures.wait([future], timeout).done:
        pool.abandon()
        _local.pool = None
        raise TimeoutError(f"did not return within {timeout:g} s")
    return future.result()
