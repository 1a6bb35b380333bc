"""The run loop: seeding and the process settings, the output directory, the learning-rate
schedule (a function of the step, so a resumed run continues it exactly), the progress bar
with live metrics, and the cadences — every ``log_every`` steps a metrics row and a progress
line, every ``eval_every`` an evaluation, every ``save_every`` a checkpoint — then the final
evaluation and ``final/``. Signals stop it after a step with a checkpoint."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import time
import uuid
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from posttrain import dist, fast
from posttrain.trainers.loop import checkpoint as ckpt
from posttrain.trainers.loop import rundir, state
from posttrain.trainers.loop.guards import (
    NonFiniteError,
    StopSignals,
    check_finite_weights,
    check_step,
)
from posttrain.trainers.loop.job import Job, Totals
from posttrain.trainers.loop.metrics import MetricsWriter, Window, strict_json
from posttrain.trainers.trained import full_states

console = Console(stderr=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def lr_lambda(schedule: str, warmup: int, total: int):
    """The multiplier of the peak learning rate at (0-based) step ``step``."""
    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return fn


def start_run(cfg) -> Path | None:
    """What every run does before it loads a model: the process settings, the seeds, the
    output directory checked (:mod:`.rundir`) and the checkpoint to resume from verified;
    returns that checkpoint (or None)."""
    from posttrain.models import pick_device

    fast.prepare_process(cfg)
    dist.init(pick_device(cfg.device), required=cfg.parallel == "fsdp")
    dist.set_context(getattr(cfg, "context_parallel", 1))
    if not dist.is_main():  # rank 0 alone prints and writes
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- for the life of the process
    seed_everything(cfg.seed)
    resume = rundir.resolve_resume(cfg)
    rundir.check_output_dir(cfg, resume)
    return resume


def _log_row(cfg, job: Job, writer: MetricsWriter, window: Window, step: int, total: int,
             lr: float, t_start: float, totals: Totals) -> dict[str, float]:
    """The row of ``step`` (the window's means on a log step, an evaluation on an eval step),
    written; the window is reset by the caller."""
    row: dict[str, float] = {}
    if step % cfg.log_every == 0 or step == total:
        row.update(window.means())
        row.update({"train/lr": lr, "time/elapsed_s": time.perf_counter() - t_start,
                    **totals.row()})
        skipped = sum(o.skipped for o in job.optimizers)
        if skipped:
            row["optim/nonfinite_skipped"] = skipped
    if cfg.eval_every and step % cfg.eval_every == 0 and step != total:
        row.update(job.evaluate())
    if row:
        writer.write(step, row)
    return row


MAX_SKIPPED_IN_A_ROW = 10
"""With on_nonfinite=skip: this many consecutive steps without an update stop the run (it
would otherwise end having learned nothing and say nothing)."""


def _skipped(job: Job) -> int:
    return sum(o.skipped for o in job.optimizers)


class _Run:
    """One run's mutable bookkeeping: where it writes, its id, the window, the totals and
    the last value of every metric."""

    def __init__(self, cfg, job: Job):
        self.cfg, self.job = cfg, job
        self.out = rundir.output_dir(cfg)
        self.window, self.totals = Window(), Totals()
        self.step0, self.run_id = 0, uuid.uuid4().hex
        self.last: dict[str, float] = {}
        self.t_start = time.perf_counter()

    def resume(self) -> None:
        """Restore the checkpoint ``resume_from`` names, and cut ``metrics.jsonl`` back to
        its step."""
        cfg, path = self.cfg, Path(self.cfg.resume_from)
        self.step0 = state.load_checkpoint(path, self.job, self.window, self.totals)
        self.run_id = json.loads((path / ckpt.MANIFEST).read_text())["run_id"]
        if dist.is_main():  # one writer: another rank's repair would orphan rank 0's file
            ckpt.truncate_metrics(self.out / "metrics.jsonl", self.step0)
            ckpt.truncate_metrics(self.out / "samples.jsonl", self.step0)
        dist.barrier()
        print(f"[{self.job.name}] resumed from {cfg.resume_from} at step {self.step0}",
              file=sys.stderr, flush=True)

    def checkpoint(self, step: int) -> Path:
        path = self.out / f"checkpoint-{step}"
        state.save_checkpoint(path, self.job, step, self.window, self.run_id, self.cfg,
                              self.totals)
        return path


def run(cfg, job: Job, total_steps: int) -> dict[str, float]:
    """Run ``job`` for ``total_steps`` steps (see the module docstring); returns the last
    value of every metric logged."""
    r = _Run(cfg, job)
    if dist.is_main():
        rundir.prepare_output(cfg, Path(cfg.resume_from) if cfg.resume_from else None)
    dist.barrier()
    if cfg.resume_from:
        r.resume()
    try:
        writer = MetricsWriter(r.out, cfg, r.run_id)
    except Exception:  # a tracker that did not start: the job's engine still closes
        job.close()
        raise
    start: dict[str, float] = {}
    final: dict[str, float] = {}
    try:
        with StopSignals(job.name) as stop:
            if r.step0 == 0:
                seed_everything(cfg.seed)  # models are loaded: training starts from the seed
            if job.eval_at_start and r.step0 == 0:
                start = job.evaluate()
                if start:
                    writer.write(0, start)
                    print(strict_json({"step": 0, **start}), flush=True)
            total_steps = _steps(r, writer, stop, total_steps)
            final = _finish(r, writer, stop, total_steps)
    finally:
        writer.close()
        job.close()
    if start:
        print(strict_json({"step": total_steps, **{f"start/{k[5:]}": v for k, v in start.items()
                                                   if k.startswith("eval/")}, **final}),
              flush=True)
    return r.last


def _steps(r: _Run, writer: MetricsWriter, stop: StopSignals, total_steps: int) -> int:
    """The steps from the resumed one on, with the progress bar, the progress lines and the
    checkpoints; returns the last step (earlier than ``total_steps`` when a budget is
    spent)."""
    cfg, job = r.cfg, r.job
    schedule = lr_lambda(cfg.lr_schedule, int(cfg.warmup_ratio * total_steps), total_steps)
    interactive = console.is_terminal and dist.is_main()
    progress = Progress(TextColumn(f"[bold]{job.name}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                        console=console, disable=not interactive)
    t_loop = time.perf_counter()
    with progress:
        task = progress.add_task(job.name, total=total_steps, completed=r.step0, info="")
        for step in range(r.step0 + 1, total_steps + 1):
            spent = _one_step(r, writer, step, total_steps, schedule)
            if spent and step < total_steps:  # the budget ends the run here
                total_steps = step
                progress.update(task, total=step)
            progress.advance(task)
            if step % cfg.log_every == 0 or step == total_steps:
                info = "  ".join(f"{label} {_short(r.last[key])}"
                                 for label, key in job.progress_keys
                                 if isinstance(r.last.get(key), (int, float)))
                progress.update(task, info=info)
                if not interactive and dist.is_main():
                    per_step = (time.perf_counter() - t_loop) / (step - r.step0)
                    left = _clock(per_step * (total_steps - step))
                    print(f"[{job.name}] step {step}/{total_steps}  {info}  left {left}",
                          file=sys.stderr, flush=True)
            if stop.stopping() and step != total_steps:
                _stop(r, step, stop.received)
            if cfg.save_every and step % cfg.save_every == 0 and step != total_steps:
                r.checkpoint(step)
            if step == total_steps:
                break
    return total_steps


def _short(v: float) -> str:
    """A progress value in a few characters: 3 decimals below 100, none above."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3f}"


def _clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _finish(r: _Run, writer: MetricsWriter, stop: StopSignals, total_steps: int
            ) -> dict[str, float]:
    """The final evaluation and ``final/`` (weights checked first); a signal that came
    during the last step still gets ``final/``, then the exit status it asks for."""
    job, final = r.job, {}
    stopped = stop.stopping()
    if not stopped:  # a signal here: the steps are done, write final/ now
        final = job.evaluate()
        if final:
            writer.write(total_steps, final)
            r.last.update(final)
    check_finite_weights(job.models(), total_steps)
    states = full_states(job)
    if dist.is_main():
        ckpt.write_atomically(r.out / "final", lambda tmp: (
            job.save(tmp, states), ckpt.write_manifest(tmp, total_steps, r.run_id, r.cfg)))
    dist.barrier()
    if stopped:
        raise SystemExit(128 + stop.received)
    return final


def _one_step(r: _Run, writer: MetricsWriter, step: int, total: int, schedule) -> bool:
    """Step ``step``: the scheduled learning rates, the job's step, its checks, the metrics
    window and row; returns whether the budget (``max_tokens``, ``max_seconds``) is spent
    (this step is then the last: its row is written whatever ``log_every``)."""
    cfg, job = r.cfg, r.job
    t0 = time.perf_counter()
    lrs = [o.set_lr(schedule(step - 1)) for o in job.optimizers]
    skipped = _skipped(job)
    try:
        result = job.step(step)
    except NonFiniteError as e:
        raise NonFiniteError(f"step {step}: {e}") from None
    if cfg.on_nonfinite == "raise":
        check_step({**result.values, **{k: v / max(result.units, 1)
                                        for k, v in result.sums.items()}}, step)
    seconds = time.perf_counter() - t0
    if cfg.max_seconds and dist.world_size() > 1:  # one clock for the budget: every rank
        seconds = dist.sum_floats([seconds])[0] / dist.world_size()  # stops at one step
    r.totals.add(result.tokens, seconds)
    if r.totals.spent(cfg):
        total = step
    if _skipped(job) == skipped:  # a step whose update was left out has no metrics
        job.skipped_in_a_row = 0
        r.window.add(result, seconds)
    else:
        job.skipped_in_a_row = getattr(job, "skipped_in_a_row", 0) + 1
        if job.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise NonFiniteError(f"step {step}: {job.skipped_in_a_row} steps in a row had a "
                                 "non-finite gradient and were skipped; stopped (lower --lr, "
                                 "check the data and rewards)")
    row = _log_row(cfg, job, writer, r.window, step, total, lrs[0] if lrs else 0.0,
                   r.t_start, r.totals)
    if result.samples:
        writer.write_samples(step, result.samples)
    r.last.update(row)
    if step % cfg.log_every == 0 or step == total:
        r.window = Window()
    return total == step


def _stop(r: _Run, step: int, signum: int):
    """A checkpoint of ``step``, one line with the resume command, exit 128 + signal."""
    path = r.checkpoint(step)
    name = signal.Signals(signum).name
    if dist.is_main():
        print(f"[{r.job.name}] {name}: stopped after step {step}, checkpoint {path}; resume "
              f"with: posttrain {r.cfg.COMMAND} --config {r.out / 'config.yaml'} "
              f"--resume_from {path}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)
