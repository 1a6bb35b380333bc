"""The metrics of a run: the window of steps since the last logged row (:class:`Window`)
and the writer of ``metrics.jsonl`` (strict JSON, one row per logged step) mirrored to
TensorBoard when it is installed."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from posttrain import dist
from posttrain.trainers.loop.job import StepResult


def strict_json(record: dict) -> str:
    """``record`` as strict JSON: a value that is not a finite number becomes null."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                       for k, v in record.items()}, allow_nan=False)


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl, mirrored to TensorBoard."""

    def __init__(self, output_dir: Path, tensorboard: bool):
        self.path = output_dir / "metrics.jsonl"
        self.file = self.path.open("a") if dist.is_main() else open(os.devnull, "w")  # noqa: SIM115
        self.tb = None
        if tensorboard and dist.is_main():
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(output_dir / "tensorboard"))
            except ImportError:
                pass

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """One row of strict JSON: a value that is not a finite number is written as null."""
        self.file.write(strict_json({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class Window:
    """The metrics of the steps since the last logged row. A per-step value is averaged over
    the steps that reported it (an RL step whose policy did not train reports no loss)."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.units = 0.0
        self.values: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, r: StepResult, seconds: float) -> None:
        for k, v in r.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.units += r.units
        for k, v in {**r.values, "time/step_s": seconds}.items():
            self.values[k] = self.values.get(k, 0.0) + v
            self.counts[k] = self.counts.get(k, 0) + 1

    def means(self) -> dict[str, float]:
        out = {k: v / max(self.units, 1) for k, v in self.sums.items()}
        out.update({k: v / self.counts[k] for k, v in self.values.items()})
        return out

    def state(self) -> dict:
        return {"sums": self.sums, "units": self.units, "values": self.values,
                "counts": self.counts}

    def load(self, s: dict) -> None:
        self.sums, self.units = s["sums"], s["units"]
        self.values, self.counts = s["values"], s["counts"]
