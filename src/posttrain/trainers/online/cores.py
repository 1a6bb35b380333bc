"""How the learner and a producer process share the CPU cores (``async_cores``).

An OpenMP team waits at every barrier for its slowest thread. When the learner runs a team
of two threads on two cores and the producer computes on one of them, the thread that
shares its core holds the whole team up: a 2-thread matmul then ran at 100 GFLOP/s against
160 for one thread alone on this machine (docs/async.md). So the two never run teams that
overlap:

- ``split``: the producer takes half the cores and the learner the rest, for the whole
  run. Each side's thread count is fixed, so its rounding is, and a run stays reproducible
  and resumes bit for bit.
- ``adaptive``: as ``split``, but while the producer waits (for an environment's reply, or
  for the weights its next batch needs) the learner takes every core. The learner checks
  a flag the producer sets, before each of its modules runs, forwards and backwards. A
  reduction's rounding depends on the number of threads that split it, and here that
  number depends on timing: such a run is not bit-for-bit reproducible (as with
  ``partial_rollouts``), though its checkpoints still resume from exactly what they hold.
"""

from __future__ import annotations

import contextlib
import time

import torch

MODES = ("split", "adaptive")


def shares(cores: int) -> tuple[int, int]:
    """(the producer's threads, the learner's) out of ``cores``: half each, the learner
    the odd one; one each on one core."""
    producer = max(1, cores // 2)
    return producer, max(1, cores - producer)


class Waiting:
    """The producer's side of ``adaptive``: a flag in shared memory, up while it waits.
    Nested waits (an environment's reply inside a batch) count once."""

    def __init__(self, flag):
        self.flag = flag
        self.depth = 0

    @contextlib.contextmanager
    def __call__(self):
        self.depth += 1
        self.flag.value = 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth:
                self.flag.value = 0


class Adaptive:
    """The learner's side of ``adaptive``: before each leaf module's forward, and before
    its backward (a hook on its output), the learner takes ``all_cores`` threads while the
    producer's flag is up and ``own`` otherwise. A count is set only when it changes.
    :meth:`take_time`: the seconds spent at every core since it was last called."""

    def __init__(self, flag, own: int, all_cores: int):
        self.flag, self.own, self.all = flag, own, all_cores
        torch.set_num_threads(own)
        self.now = own
        self.since = time.perf_counter()  # (of the last switch to every core)
        self.all_s = 0.0
        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._before),
            torch.nn.modules.module.register_module_forward_hook(self._after)]

    def adapt(self, *_) -> None:
        want = self.all if self.flag.value else self.own
        if want != self.now:
            torch.set_num_threads(want)
            self._count()
            self.now = want

    def _count(self) -> None:
        t = time.perf_counter()
        if self.now == self.all and self.all != self.own:
            self.all_s += t - self.since
        self.since = t

    def take_time(self) -> float:
        self._count()
        spent, self.all_s = self.all_s, 0.0
        return spent

    def _before(self, module, args) -> None:
        if not module._modules:
            self.adapt()

    def _after(self, module, args, out) -> None:
        if module._modules or not torch.is_grad_enabled():
            return
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(self.adapt)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        torch.set_num_threads(self.own)
        self.now = self.own
