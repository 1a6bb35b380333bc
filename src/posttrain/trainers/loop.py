"""The one run loop every trainer uses: SFT, reward model, DPO and the on-policy loop.

It owns, once for all of them: seeding and the process settings, the output directory
(``config.yaml``, ``metrics.jsonl``, TensorBoard), the learning-rate schedule and warm-up
(a function of the step, so a resumed run continues it exactly), gradient clipping
(:class:`Optim`), the progress bar with live metrics, the cadences — every ``log_every``
steps one metrics row of the window's means and a progress line, every ``eval_every`` an
evaluation, every ``save_every`` a checkpoint — and checkpoints that resume bit-exactly:
models, optimisers, RNG states, the trainer's own state (data position, sampling
generator, KL coefficient, ...) and the metrics window.

A trainer is a :class:`Job`: it says what one step does and what its state is; it never
logs, checkpoints or sets a learning rate itself.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file

from posttrain import dist, fast, sharding
from posttrain.fast import sparse_rows
from posttrain.trainers import checkpoint as ckpt
from posttrain.trainers import rundir
from posttrain.trainers.guards import NonFiniteError, StopSignals, check_finite_weights, check_step
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


def adamw(params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The optimiser of every trainer: torch's AdamW, which here also steps an embedding's
    sparse row gradients (:mod:`posttrain.fast.sparse_rows`; dense gradients take torch's
    own step). The fused kernel (one launch for all parameters) also exists on CPU; it
    matters for small models, whose step is dominated by per-tensor overhead."""
    return sparse_rows.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)


class Optim:
    """AdamW over a model's trainable parameters, with its peak learning rate (the loop
    sets the scheduled rate before each step) and the run's gradient clipping."""

    def __init__(self, name: str, model: torch.nn.Module, lr: float, weight_decay: float,
                 max_grad_norm: float, on_nonfinite: str = "raise",
                 sparse_embedding: bool = False):
        self.name, self.peak_lr, self.max_grad_norm = name, lr, max_grad_norm
        self.on_nonfinite = on_nonfinite
        self.skipped = 0
        """Optimiser steps left out because the gradient norm was not finite."""
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = adamw(self.params, lr, weight_decay)
        self.sharded = sharding.is_sharded(model)
        # one process: the input embedding's gradient by rows (several ranks sum dense ones)
        self.rows = (sparse_rows.sparse_embedding_gradients(model)
                     if sparse_embedding and not self.sharded and dist.world_size() == 1
                     else None)
        """FSDP: the gradients arrive reduce-scattered (summed) in the backward."""
        # several ranks: the gradients live in one buffer, summed in one collective
        self.flat = None if self.sharded else dist.flat_gradients(self.params)
        self._views = [p.grad.data_ptr() for p in self.params] if self.flat is not None else []

    def set_lr(self, scale: float) -> float:
        for group in self.opt.param_groups:
            group["lr"] = self.peak_lr * scale
        return self.peak_lr * scale

    def state_for_save(self) -> dict | None:
        """``opt.state_dict()``, gathered whole for a sharded model (rank 0; None on the
        others); collective, so every rank calls it."""
        if self.sharded:
            return sharding.full_optimizer_state(self.model, self.opt, self.params)
        return self.opt.state_dict()

    def load(self, path: Path) -> None:
        sd = ckpt.read_optimizer(path)
        if self.sharded:  # a one-process checkpoint may hold the embedding's rows states
            sd = sparse_rows.dense_state_dict(sd, self.params)
            sharding.load_optimizer_state(self.model, self.opt, self.params, sd)
        else:
            self.opt.load_state_dict(sd)

    def step(self) -> float:
        # every rank now holds the whole step's gradient (or, sharded, its shard of it)
        if self.sharded:
            pass
        elif self.flat is not None and self._views == [
                -1 if p.grad is None else p.grad.data_ptr() for p in self.params]:
            dist.sum_flat(self.flat)  # autograd accumulated into the views, as it does
        else:
            dist.sum_gradients(self.params)
        return self._apply()

    def _apply(self) -> float:
        """Clip (when max_grad_norm > 0), step, zero the gradients; the gradient norm before
        clipping. A norm that is not finite raises :class:`NonFiniteError`, or with
        ``on_nonfinite="skip"`` leaves the step out (counted in ``skipped``)."""
        if self.rows is not None and self.rows.grad is not None:
            norm = self._clip_with_rows()
        elif self.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        else:  # the norm only (torch < 2.6 has no get_total_norm: clip at infinity)
            total = getattr(torch.nn.utils, "get_total_norm", None)
            norm = (total([p.grad for p in self.params if p.grad is not None]) if total
                    else torch.nn.utils.clip_grad_norm_(self.params, float("inf")))
        norm = float(sharding.full_tensor(norm))
        if not math.isfinite(norm):
            self.opt.zero_grad(set_to_none=self.flat is None)
            if self.on_nonfinite == "raise":
                raise NonFiniteError(f"the gradient norm of the {self.name} is {norm}; stopped "
                                     "before the update (lower --lr, check the data and "
                                     "rewards, or pass --on_nonfinite skip)")
            self.skipped += 1
            return norm
        self.opt.step()
        self.opt.zero_grad(set_to_none=self.flat is None)
        return norm

    def _clip_with_rows(self) -> torch.Tensor:
        """``clip_grad_norm_`` when the embedding's gradient is sparse: the norm counts each
        row once (duplicates summed first), and clipping scales the stored rows."""
        self.rows.grad = self.rows.grad.coalesce()
        grads = [p.grad.values() if p.grad.is_sparse else p.grad
                 for p in self.params if p.grad is not None]
        wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.to(wide)) for g in grads]))
        if self.max_grad_norm > 0 and math.isfinite(norm):
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return norm


@dataclass
class StepResult:
    """What one step reports: ``sums`` of per-unit metrics over ``units`` loss units (tokens,
    pairs), averaged over the window by unit; ``values`` per-step metrics, averaged over
    the window's steps."""

    sums: dict[str, float] = field(default_factory=dict)
    units: float = 0.0
    values: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    """Completion tokens the step sampled (RL) or trained on (offline), every rank's: the
    count ``max_tokens`` budgets."""


@dataclass
class Totals:
    """What the run has spent so far (resumable): completion tokens and the steps' seconds,
    against the ``max_tokens`` / ``max_seconds`` budgets."""

    tokens: int = 0
    train_s: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.train_s += seconds

    def spent(self, cfg) -> bool:
        return bool((cfg.max_tokens and self.tokens >= cfg.max_tokens)
                    or (cfg.max_seconds and self.train_s >= cfg.max_seconds))

    def row(self) -> dict[str, float]:
        return {"samples/tokens_total": self.tokens, "time/train_s": self.train_s}


class Job:
    """What a trainer gives the loop. ``optimizers`` are :class:`Optim` objects the job
    steps; the loop schedules their learning rates and checkpoints them."""

    name = "train"
    progress_keys: tuple[tuple[str, str], ...] = ()
    """(label, metric key) pairs shown in the progress bar and lines."""
    eval_at_start = False
    optimizers: list[Optim]

    def step(self, step: int) -> StepResult:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        return {}

    def save(self, path: Path, states: dict | None = None) -> None:
        """The models as Hugging Face directories under ``path``; ``states``: the full
        state dicts of sharded models by name (:func:`full_states`)."""
        raise NotImplementedError

    def models(self) -> dict[str, torch.nn.Module]:
        """The trained models by name (their weights are checked before every save)."""
        raise NotImplementedError

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """The job's own resumable state: JSON-able values and tensors."""
        return {}, {}

    def load_state(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        pass

    def close(self) -> None:
        pass


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
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                 for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}, allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def start_run(cfg) -> Path | None:
    """What every run does before it loads a model: the process settings, the seeds, the
    output directory checked (:mod:`.rundir`) and the checkpoint to resume from verified;
    returns that checkpoint (or None)."""
    from posttrain.models import pick_device

    fast.prepare_process(cfg)
    dist.init(pick_device(cfg.device), required=cfg.parallel == "fsdp")
    if not dist.is_main():  # rank 0 alone prints and writes
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- for the life of the process
    seed_everything(cfg.seed)
    resume = rundir.resolve_resume(cfg)
    rundir.check_output_dir(cfg, resume)
    return resume


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


def save_checkpoint(path: Path, job: Job, step: int, window: Window, run_id: str,
                    cfg, totals: Totals | None = None) -> None:
    """Everything a resume needs, written atomically with its manifest last (see
    :mod:`.checkpoint`)."""
    check_finite_weights(job.models(), step)
    states = full_states(job)  # sharded models: gathered on rank 0 (every rank takes part)
    optimizer_states = [o.state_for_save() for o in job.optimizers]
    if not dist.is_main():
        dist.barrier()  # rank 0 writes; every rank goes on once it has
        return

    def write(tmp: Path) -> None:
        job.save(tmp, states)
        for o, sd in zip(job.optimizers, optimizer_states, strict=True):
            ckpt.save_optimizer(sd, tmp / f"optimizer-{o.name}")
        rng_meta, rng_tensors = ckpt.rng_state()
        meta, tensors = job.state()
        save_file({**{f"rng.{k}": v for k, v in rng_tensors.items()},
                   **{f"job.{k}": v.contiguous() for k, v in tensors.items()}},
                  str(tmp / "state.safetensors"))
        (tmp / ckpt.STATE).write_text(json.dumps(
            {"format": ckpt.FORMAT, "step": step, "rng": rng_meta, "job": meta,
             "window": window.state(), "skipped": {o.name: o.skipped for o in job.optimizers},
             "totals": asdict(totals or Totals())}))
        ckpt.write_manifest(tmp, step, run_id, cfg)
    ckpt.write_atomically(path, write)
    dist.barrier()


def load_checkpoint(path: Path, job: Job, window: Window, totals: Totals | None = None) -> int:
    """Restore what :func:`save_checkpoint` wrote (the job has already loaded its models
    from ``path``); returns the step."""
    state = json.loads((path / ckpt.STATE).read_text())
    tensors = load_file(str(path / "state.safetensors"))
    for o in job.optimizers:
        o.load(path / f"optimizer-{o.name}")
        o.skipped = int(state.get("skipped", {}).get(o.name, 0))
    job.load_state(state["job"], {k[4:]: v for k, v in tensors.items() if k.startswith("job.")})
    ckpt.set_rng_state(state["rng"], {k[4:]: v for k, v in tensors.items()
                                      if k.startswith("rng.")})
    window.load(state["window"])
    if totals is not None:
        spent = state.get("totals", {})
        totals.tokens, totals.train_s = int(spent.get("tokens", 0)), float(spent.get("train_s",
                                                                                      0.0))
    return int(state["step"])


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


def _strict(record: dict) -> str:
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                       for k, v in record.items()}, allow_nan=False)


def _skipped(job: Job) -> int:
    return sum(o.skipped for o in job.optimizers)


def run(cfg, job: Job, total_steps: int) -> dict[str, float]:
    """Run ``job`` for ``total_steps`` steps (see the module docstring); returns the last
    value of every metric logged."""
    out = rundir.output_dir(cfg)
    if dist.is_main():
        rundir.prepare_output(cfg, Path(cfg.resume_from) if cfg.resume_from else None)
    dist.barrier()
    window, totals = Window(), Totals()
    step0, run_id = 0, uuid.uuid4().hex
    if cfg.resume_from:
        step0 = load_checkpoint(Path(cfg.resume_from), job, window, totals)
        run_id = json.loads((Path(cfg.resume_from) / ckpt.MANIFEST).read_text())["run_id"]
        if dist.is_main():  # one writer: another rank's repair would orphan rank 0's file
            ckpt.truncate_metrics(out / "metrics.jsonl", step0)
        dist.barrier()
        print(f"[{job.name}] resumed from {cfg.resume_from} at step {step0}", file=sys.stderr,
              flush=True)
    writer = MetricsWriter(out, cfg.tensorboard)
    schedule = lr_lambda(cfg.lr_schedule, int(cfg.warmup_ratio * total_steps), total_steps)
    last: dict[str, float] = {}
    start: dict[str, float] = {}
    final: dict[str, float] = {}
    t_start = time.perf_counter()
    interactive = console.is_terminal and dist.is_main()
    progress = Progress(TextColumn(f"[bold]{job.name}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                        console=console, disable=not interactive)
    try:
        with StopSignals(job.name) as stop:
            if step0 == 0:
                seed_everything(cfg.seed)  # models are loaded: training starts from the seed
            if job.eval_at_start and step0 == 0:
                start = job.evaluate()
                if start:
                    writer.write(0, start)
                    print(_strict({"step": 0, **start}), flush=True)
            with progress:
                task = progress.add_task(job.name, total=total_steps, completed=step0, info="")
                for step in range(step0 + 1, total_steps + 1):
                    window, spent = _one_step(cfg, job, writer, window, step, total_steps,
                                              schedule, t_start, last, totals)
                    if spent and step < total_steps:  # the budget ends the run here
                        total_steps = step
                        progress.update(task, total=step)
                    progress.advance(task)
                    if step % cfg.log_every == 0 or step == total_steps:
                        info = "  ".join(f"{label} {last[key]:.3f}"
                                         for label, key in job.progress_keys if key in last)
                        progress.update(task, info=info)
                        if not interactive and dist.is_main():
                            print(f"[{job.name}] step {step}/{total_steps}  {info}",
                                  file=sys.stderr, flush=True)
                    if stop.stopping() and step != total_steps:
                        _stop(cfg, job, out, step, window, run_id, stop.received, totals)
                    if cfg.save_every and step % cfg.save_every == 0 and step != total_steps:
                        save_checkpoint(out / f"checkpoint-{step}", job, step, window, run_id,
                                        cfg, totals)
                    if step == total_steps:
                        break
            stopped = stop.stopping()
            if not stopped:  # a signal here: the steps are done, write final/ now
                final = job.evaluate()
                if final:
                    writer.write(total_steps, final)
                    last.update(final)
            check_finite_weights(job.models(), total_steps)
            states = full_states(job)
            if dist.is_main():
                ckpt.write_atomically(out / "final", lambda tmp: (
                    job.save(tmp, states), ckpt.write_manifest(tmp, total_steps, run_id, cfg)))
            dist.barrier()
            if stopped:
                raise SystemExit(128 + stop.received)
    finally:
        writer.close()
        job.close()
    if start:
        print(_strict({"step": total_steps, **{f"start/{k[5:]}": v for k, v in start.items()
                                               if k.startswith("eval/")}, **final}), flush=True)
    return last


def _one_step(cfg, job: Job, writer: MetricsWriter, window: Window, step: int, total: int,
              schedule, t_start: float, last: dict, totals: Totals) -> tuple[Window, bool]:
    """Step ``step``: the scheduled learning rates, the job's step, its checks, the metrics
    window and row; returns the window to go on with, and whether the budget
    (``max_tokens``, ``max_seconds``) is spent (this step is then the last: its row is
    written whatever ``log_every``)."""
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
    totals.add(result.tokens, seconds)
    if totals.spent(cfg):
        total = step
    if _skipped(job) == skipped:  # a step whose update was left out has no metrics
        job.skipped_in_a_row = 0
        window.add(result, seconds)
    else:
        job.skipped_in_a_row = getattr(job, "skipped_in_a_row", 0) + 1
        if job.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise NonFiniteError(f"step {step}: {job.skipped_in_a_row} steps in a row had a "
                                 "non-finite gradient and were skipped; stopped (lower --lr, "
                                 "check the data and rewards)")
    row = _log_row(cfg, job, writer, window, step, total, lrs[0] if lrs else 0.0, t_start,
                   totals)
    last.update(row)
    return (Window() if step % cfg.log_every == 0 or step == total else window), total == step


def _stop(cfg, job: Job, out: Path, step: int, window: Window, run_id: str, signum: int,
          totals: Totals):
    """A checkpoint of ``step``, one line with the resume command, exit 128 + signal."""
    path = out / f"checkpoint-{step}"
    save_checkpoint(path, job, step, window, run_id, cfg, totals)
    name = signal.Signals(signum).name
    if dist.is_main():
        print(f"[{job.name}] {name}: stopped after step {step}, checkpoint {path}; resume with: "
              f"posttrain {cfg.COMMAND} --config {out / 'config.yaml'} --resume_from {path}",
              file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)
