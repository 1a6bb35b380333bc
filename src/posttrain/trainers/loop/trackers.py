"""Experiment trackers (``--report_to``): TensorBoard, Weights & Biases, MLflow, trackio.

Each tracker gets what ``metrics.jsonl`` gets (the same keys, the same steps), the resolved
config once, and the sample tables (``--log_samples_every``) in its own table type. Each
library is imported only when named. The tracker's run is keyed by the posttrain run's id
(kept in every checkpoint), so a resumed run continues the same tracker run:

- **tensorboard** — events under ``OUTPUT_DIR/tensorboard``; a table is a Markdown text.
- **wandb** — run id = the posttrain run id, ``resume="allow"``; files under
  ``WANDB_DIR/wandb`` where ``WANDB_DIR`` is set, else ``OUTPUT_DIR/wandb``.
  ``WANDB_MODE=offline`` works without an account (``wandb sync`` uploads later);
  ``WANDB_PROJECT`` names the project (default ``posttrain``). Rows are
  logged against a ``step`` metric of their own, so the rows a killed run wrote after its
  last checkpoint stay beside the resumed run's.
- **mlflow** — the store ``MLFLOW_TRACKING_URI`` names, else a local SQLite store
  ``OUTPUT_DIR/mlflow.db`` with its artifacts in ``OUTPUT_DIR/mlartifacts``; experiment
  ``MLFLOW_EXPERIMENT_NAME`` (default ``posttrain``); the run is found again by its tag
  ``posttrain.run_id``. Tables are ``log_table`` artifacts ``samples/step-<S>.json``.
- **trackio** — project ``TRACKIO_PROJECT`` (default ``posttrain``), stored where trackio
  stores (``TRACKIO_DIR``); run name ``<output dir>-<run id>``, ``resume="allow"``.

Only the main rank writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path


def parse(report_to: str) -> list[str]:
    """The tracker names in ``report_to`` (comma-separated; ``none`` or empty: none)."""
    names = [n.strip().lower() for n in (report_to or "").split(",") if n.strip()]
    return [n for n in names if n != "none"]


def check(report_to: str) -> str | None:
    """The problem with ``report_to`` in one line, or None: an unknown name, or a tracker
    whose package is not installed."""
    for name in parse(report_to):
        if name not in TRACKERS:
            return f"report_to: unknown tracker {name!r} (choose from {', '.join(TRACKERS)})"
        if importlib.util.find_spec(name) is None:
            return (f"report_to={name} needs the {name} package, which is not installed: "
                    f"pip install 'posttrain[trackers]' (or pip install {name})")
    return None


def _finite(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(v)}


def _text(v) -> str:
    return "" if v is None else str(v)


def _columns(rows: list[dict]) -> tuple[list[str], list[list]]:
    """A table's column names (the first row's keys) and its rows as lists."""
    cols = list(rows[0])
    return cols, [[r.get(c) for c in cols] for r in rows]


class Tracker:
    """One tracker's run, started from ``(out, run_id, config)``: ``log`` a row of metrics,
    ``table`` a step's samples (never empty), ``close``."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def table(self, step: int, rows: list[dict]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoard(Tracker):
    def __init__(self, out: Path, run_id: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(out / "tensorboard"))

    def log(self, step, metrics):
        for k, v in _finite(metrics).items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def table(self, step, rows):
        cols, data = _columns(rows)
        cell = lambda v: _text(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
        md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data]
        self.w.add_text("sample_table", "\n".join(md), step)
        self.w.flush()

    def close(self):
        self.w.close()


class WandB(Tracker):
    def __init__(self, out: Path, run_id: str, config: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "posttrain"),
                              id=run_id, name=out.name, resume="allow",
                              dir=os.environ.get("WANDB_DIR") or str(out), config=config)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step, metrics):
        self.run.log({**_finite(metrics), "step": step})

    def table(self, step, rows):
        cols, data = _columns(rows)
        self.run.log({"sample_table": self.wandb.Table(columns=cols, data=data), "step": step})

    def close(self):
        self.run.finish()


class MLflow(Tracker):
    TAG = "posttrain.run_id"

    def __init__(self, out: Path, run_id: str, config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # per table
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        local = not uri  # the run directory's own store, artifacts beside it
        uri = uri or f"sqlite:///{out.resolve()}/mlflow.db"
        self.client = c = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "posttrain")
        exp = c.get_experiment_by_name(name)
        exp_id = (exp.experiment_id if exp is not None else c.create_experiment(
            name, artifact_location=(out.resolve() / "mlartifacts").as_uri() if local
            else None))
        found = c.search_runs([exp_id], filter_string=f"tags.`{self.TAG}` = '{run_id}'",
                              max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            c.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = c.create_run(exp_id, tags={self.TAG: run_id},
                                       run_name=out.name).info.run_id
            params = [Param(k, _text(v)[:6000]) for k, v in config.items()]
            for i in range(0, len(params), 100):
                c.log_batch(self.run_id, params=params[i:i + 100])
            c.log_dict(self.run_id, config, "config.json")

    def log(self, step, metrics):
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        items = [Metric(k, v, ms, step) for k, v in _finite(metrics).items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def table(self, step, rows):
        cols, data = _columns(rows)
        self.client.log_table(self.run_id, {c: [row[j] for row in data]
                                            for j, c in enumerate(cols)},
                              f"samples/step-{step:06d}.json")

    def close(self):
        self.client.set_terminated(self.run_id)


class Trackio(Tracker):
    """(trackio prints its notes on stdout, where the command's JSON goes: they go to
    stderr.)"""

    def __init__(self, out: Path, run_id: str, config: dict):
        import trackio

        self.trackio = trackio
        with contextlib.redirect_stdout(sys.stderr):
            self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "posttrain"),
                                    name=f"{out.name}-{run_id[:8]}", config=config,
                                    resume="allow")

    def log(self, step, metrics):
        with contextlib.redirect_stdout(sys.stderr):
            self.trackio.log(_finite(metrics), step=step)

    def table(self, step, rows):
        cols, data = _columns(rows)
        t = self.trackio.Table(columns=cols, data=data)
        with contextlib.redirect_stdout(sys.stderr):
            self.trackio.log({"sample_table": t}, step=step)

    def close(self):
        with contextlib.redirect_stdout(sys.stderr):
            self.trackio.finish()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow, "trackio": Trackio}
"""The trackers by name, each named as its package."""


def config_dict(cfg) -> dict:
    """The resolved config as plain values (what ``config.yaml`` holds)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def open_trackers(cfg, out: Path, run_id: str) -> list[Tracker]:
    """The trackers ``cfg.report_to`` names, plus TensorBoard when ``cfg.tensorboard`` is set
    and it is installed (the default, unchanged)."""
    names = parse(getattr(cfg, "report_to", ""))
    if (getattr(cfg, "tensorboard", False) and "tensorboard" not in names
            and importlib.util.find_spec("tensorboard") is not None):
        names.insert(0, "tensorboard")
    config = config_dict(cfg) if names else {}
    opened: list[Tracker] = []
    for name in names:
        try:
            opened.append(TRACKERS[name](out, run_id, config))
        except Exception as e:  # before the first step: nothing is lost by stopping here
            for t in opened:
                t.close()
            raise TrackerError(f"report_to={name}: the tracker did not start "
                               f"({type(e).__name__}: {e})") from e
    return opened


class TrackerError(ValueError):
    """A tracker named in ``report_to`` could not start its run (a setup error: no
    account, an unreachable server)."""
