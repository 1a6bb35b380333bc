"""What stops a run safely: non-finite values (:class:`NonFiniteError`, raised where a loss,
a gradient norm or a weight is not finite) and the signals that ask a run to stop after its
current step (:class:`StopSignals`)."""

from __future__ import annotations

import math
import signal
import sys
import threading

import torch

from posttrain import dist


class NonFiniteError(RuntimeError):
    """A NaN or inf where training needs a finite number."""

class StopSignals:
    """SIGINT and SIGTERM ask the run to stop after the current step (a second one stops it
    at once); inside the block only, and only in the main thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, name: str = "run"):
        self.name = name
        self.received: int | None = None
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        print(f"[{self.name}] {signal.Signals(signum).name}: stopping after this step (again "
              "to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def stopping(self) -> bool:
        """Whether to stop after this step: on any rank a signal arrived (every rank decides
        alike, or the collectives of the next step would wait forever)."""

        if dist.world_size() == 1:
            return self.received is not None
        got = dist.sum_floats([float(self.received or 0), float(self.received is not None)])
        if got[1] and self.received is None:
            self.received = int(got[0] / got[1])
        return bool(got[1])

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


def check_finite_weights(models: dict[str, torch.nn.Module], step: int) -> None:
    """Refuse to save weights that hold NaN or inf (sharded weights: every rank checks its
    shards and the ranks agree)."""
    for name, model in models.items():
        params = list(model.parameters())
        bad = float(not all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p)
                                 .all()) for p in params))
        if any(hasattr(p, "to_local") for p in params):
            bad = dist.sum_floats([bad])[0]
        if bad:
            raise NonFiniteError(f"step {step}: the {name}'s weights hold NaN or inf; nothing "
                                 "was saved")


def check_step(values: dict[str, float], step: int) -> None:
    """A step's loss and gradient norm must be finite."""
    for key in ("train/loss", "train/grad_norm"):
        if key in values and not math.isfinite(values[key]):
            raise NonFiniteError(f"step {step}: {key} is {values[key]}; stopped before saving "
                                 "(lower --lr, check the data and rewards, or pass "
                                 "--on_nonfinite skip)")
