"""The metrics of a run: the window of steps since the last logged row (:class:`Window`)
and the writer of ``metrics.jsonl`` (strict JSON, one row per logged step) and
``samples.jsonl``, mirrored to the run's trackers."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from posttrain import dist
from posttrain.trainers.loop import trackers
from posttrain.trainers.loop.job import StepResult

log = logging.getLogger(__name__)


def strict_json(record: dict) -> str:
    """``record`` as strict JSON: a value that is not a finite number becomes null."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                       for k, v in record.items()}, allow_nan=False)


class MetricsWriter:
    """Appends one JSON object per logged step to ``metrics.jsonl`` and a step's sample table
    to ``samples.jsonl`` (one object per sample), mirrored to the run's trackers
    (:mod:`.trackers`). Only the main rank writes."""

    def __init__(self, output_dir: Path, cfg=None, run_id: str = ""):
        main = dist.is_main()
        self.path = output_dir / "metrics.jsonl"
        self.samples_path = output_dir / "samples.jsonl"
        self.file = self.path.open("a") if main else open(os.devnull, "w")  # noqa: SIM115
        self.samples = None
        try:
            self.trackers = (trackers.open_trackers(cfg, output_dir, run_id) if main and cfg
                             else [])
        except Exception:
            self.file.close()
            raise

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """One row of strict JSON: a value that is not a finite number is written as null."""
        self.file.write(strict_json({"step": step, **metrics}) + "\n")
        self.file.flush()
        self._each(lambda t: t.log(step, metrics))

    def write_samples(self, step: int, rows: list[dict]) -> None:
        """A step's sample table: one line per sample in ``samples.jsonl``, and a table in
        each tracker."""
        if not dist.is_main() or not rows:
            return
        if self.samples is None:
            self.samples = self.samples_path.open("a")
        for row in rows:
            self.samples.write(strict_json({"step": step, **row}) + "\n")
        self.samples.flush()
        self._each(lambda t: t.table(step, rows))

    def _each(self, call) -> None:
        """``call`` on every tracker; one that fails is dropped with a warning (the run and
        its own files go on)."""
        for t in list(self.trackers):
            try:
                call(t)
            except Exception as e:  # a tracker's network or disk, not the run's
                self.trackers.remove(t)
                log.warning("%s failed (%s: %s): no longer logging to it", type(t).__name__,
                            type(e).__name__, e)

    def close(self) -> None:
        self.file.close()
        if self.samples is not None:
            self.samples.close()
        self._each(lambda t: t.close())


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
