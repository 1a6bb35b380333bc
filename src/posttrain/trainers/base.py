"""The services every offline trainer shares: seeding, batching, the optimiser and its
schedule, gradient accumulation with the loss normalised over the whole step, clipping,
evaluation, a progress bar, metrics (``metrics.jsonl`` and TensorBoard), the resolved
``config.yaml``, and checkpoints.

A trainer subclass says only how to collate examples, how many loss units (tokens or pairs)
a micro-batch holds, and its loss: a *sum* over those units plus metric sums. The loop divides
by the unit count of the whole optimiser step, so the gradient does not depend on how the
step is cut into micro-batches.
"""

from __future__ import annotations

import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file

from posttrain import config as config_mod
from posttrain.config import ConfigError
from posttrain.modeling import compile_pointwise_blocks, compile_unsupported, save_model
from posttrain.runtime import keep_freed_memory

log = logging.getLogger(__name__)
console = Console(stderr=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def lr_lambda(schedule: str, warmup: int, total: int):
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
    """The optimiser of every trainer. The fused kernel (one launch for all parameters) also
    exists on CPU; it matters for small models, whose step is dominated by per-tensor
    overhead."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)


def save_optimizer(opt: torch.optim.Optimizer, path: Path) -> None:
    """``path.safetensors`` (per-parameter state tensors) and ``path.json`` (hyper-parameter
    groups): an optimiser state without pickle."""
    sd = opt.state_dict()
    tensors = {f"{pid}.{k}": (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu()
               .contiguous()
               for pid, st in sd["state"].items() for k, v in st.items()}
    save_file(tensors, str(path.with_suffix(".safetensors")))
    path.with_suffix(".json").write_text(json.dumps(sd["param_groups"]))


def load_optimizer(opt: torch.optim.Optimizer, path: Path) -> None:
    """Restore what :func:`save_optimizer` wrote into ``opt`` (same parameters, same order)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(path.with_suffix(".safetensors"))).items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    groups = json.loads(path.with_suffix(".json").read_text())
    opt.load_state_dict({"state": state, "param_groups": groups})


def start_run(cfg, output_dir: Path) -> MetricsWriter:
    """What every training run does first: apply ``keep_freed_memory``, seed, create
    ``output_dir``, write the resolved ``config.yaml``, open the metrics writer. A resumed
    run appends to ``metrics.jsonl``; a fresh run into a directory that already has one
    moves it aside to ``metrics.prev-<n>.jsonl`` (nothing is lost, and the two runs' rows
    never mix)."""
    if cfg.keep_freed_memory and not keep_freed_memory():
        log.info("keep_freed_memory: not available here (needs Linux with glibc)")
    seed_everything(cfg.seed)
    output_dir.mkdir(parents=True, exist_ok=True)
    metrics = output_dir / "metrics.jsonl"
    if not getattr(cfg, "resume_from", None) and metrics.exists() and metrics.stat().st_size:
        n = 1
        while (output_dir / f"metrics.prev-{n}.jsonl").exists():
            n += 1
        metrics.rename(output_dir / f"metrics.prev-{n}.jsonl")
        print(f"{metrics} held an earlier run's metrics: moved to metrics.prev-{n}.jsonl",
              flush=True)
    config_mod.dump(cfg, output_dir / "config.yaml")
    return MetricsWriter(output_dir, cfg.tensorboard)


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl, mirrored to TensorBoard."""

    def __init__(self, output_dir: Path, tensorboard: bool):
        self.path = output_dir / "metrics.jsonl"
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(output_dir / "tensorboard"))
            except ImportError:
                pass

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def compile_models(cfg, models: list, device: torch.device) -> bool:
    """Apply ``cfg.compile`` to ``models`` (None entries skipped): their RMSNorm and MLP blocks
    are compiled in place (:func:`posttrain.modeling.compile_pointwise_blocks`)."""
    if not cfg.compile:
        return False
    reason = compile_unsupported(device)
    if reason is not None:
        raise ConfigError(f"compile=true: {reason}")
    models = [m for m in models if m is not None]
    for model in models:
        compile_pointwise_blocks(model)
    print(f"torch.compile: RMSNorm and MLP blocks of {len(models)} model(s); they compile on "
          "first use, then run fused", flush=True)
    return True


class Trainer:
    """Base of the offline trainers (SFT, reward model, DPO)."""

    command = "train"
    progress_keys: tuple[str, ...] = ("loss",)

    def __init__(self, cfg, model, tokenizer, train_examples: list, eval_examples: list):
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.train_examples = train_examples
        self.eval_examples = eval_examples
        self.device = next(model.parameters()).device
        self.output_dir = Path(cfg.output_dir or f"runs/{self.command}")

    # --- what a subclass provides ------------------------------------------------------------
    def collate(self, examples: list) -> dict:
        raise NotImplementedError

    def units(self, batch: dict) -> int:
        """Loss units (tokens, pairs) in a micro-batch: the step normaliser sums these."""
        raise NotImplementedError

    def loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss summed over the batch's units, and metric sums over the same units."""
        raise NotImplementedError

    def save(self, path: Path) -> None:
        save_model(self.model, self.tokenizer, path)

    # --- shared services ---------------------------------------------------------------------
    def to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    def batches(self, examples: list, batch_size: int):
        for i in range(0, len(examples), batch_size):
            yield self.to_device(self.collate(examples[i:i + batch_size]))

    def total_steps(self) -> int:
        if self.cfg.max_steps > 0:
            return self.cfg.max_steps
        per_step = self.cfg.batch_size * self.cfg.grad_accum
        return max(1, math.ceil(self.cfg.epochs * len(self.train_examples) / per_step))

    def _example_stream(self):
        """Endless shuffled passes over the training examples (seeded)."""
        gen = torch.Generator().manual_seed(self.cfg.seed)
        while True:
            for i in torch.randperm(len(self.train_examples), generator=gen).tolist():
                yield self.train_examples[i]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Unit-weighted means of the loss and metrics over the held-out examples."""
        if not self.eval_examples:
            return {}
        was_training = self.model.training
        self.model.eval()
        total, sums = 0, {}
        for batch in self.batches(self.eval_examples, self.cfg.eval_batch_size):
            loss_sum, metric_sums = self.loss(batch)
            total += self.units(batch)
            for k, v in {"loss": loss_sum, **metric_sums}.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        self.model.train(was_training)
        return {f"eval/{k}": v / max(total, 1) for k, v in sums.items()}

    def train(self) -> dict[str, float]:
        cfg = self.cfg
        writer = start_run(cfg, self.output_dir)
        steps = self.total_steps()
        # the model and, where the subclass keeps one for training, its frozen reference
        compile_models(cfg, [self.model, getattr(self, "ref_model", None)], self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = adamw(params, cfg.lr, cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(cfg.lr_schedule, int(cfg.warmup_ratio * steps), steps))
        stream = self._example_stream()
        self.model.train()
        last: dict[str, float] = {}
        t_start = time.perf_counter()
        interactive = console.is_terminal
        progress = Progress(TextColumn(f"[bold]{self.command}"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                            TimeRemainingColumn(), console=console, disable=not interactive)
        try:
            with progress:
                task = progress.add_task(self.command, total=steps, info="")
                window: dict[str, float] = {}
                window_units, step_times = 0, []
                for step in range(1, steps + 1):
                    t_step = time.perf_counter()
                    micro = [self.to_device(self.collate([next(stream)
                                                          for _ in range(cfg.batch_size)]))
                             for _ in range(cfg.grad_accum)]
                    step_units = sum(self.units(b) for b in micro)
                    sums: dict[str, torch.Tensor] = {}
                    for batch in micro:
                        loss_sum, metric_sums = self.loss(batch)
                        (loss_sum / max(step_units, 1)).backward()
                        for k, v in {"loss": loss_sum.detach(), **metric_sums}.items():
                            sums[k] = sums.get(k, 0.0) + v.detach()
                    grad_norm = torch.nn.utils.clip_grad_norm_(
                        params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
                    opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
                    for k, v in sums.items():
                        window[k] = window.get(k, 0.0) + float(v)
                    window_units += step_units
                    step_times.append(time.perf_counter() - t_step)
                    if step % cfg.log_every == 0 or step == steps:
                        record = {f"train/{k}": v / max(window_units, 1)
                                  for k, v in window.items()}
                        record.update({"train/lr": sched.get_last_lr()[0],
                                       "train/grad_norm": float(grad_norm),
                                       "time/step_s": sum(step_times) / len(step_times),
                                       "time/elapsed_s": time.perf_counter() - t_start})
                        window, window_units, step_times = {}, 0, []
                        if cfg.eval_every and step % cfg.eval_every == 0 and step != steps:
                            record.update(self.evaluate())
                        writer.write(step, record)
                        last.update(record)
                        info = "  ".join(f"{k} {record[f'train/{k}']:.3f}"
                                         for k in self.progress_keys if f"train/{k}" in record)
                        progress.update(task, info=info)
                        if not interactive:
                            print(f"[{self.command}] step {step}/{steps}  {info}",
                                  file=sys.stderr)
                    progress.advance(task)
                    if cfg.save_every and step % cfg.save_every == 0 and step != steps:
                        self.save(self.output_dir / f"checkpoint-{step}")
            final = self.evaluate()
            if final:
                writer.write(steps, final)
                last.update(final)
            self.save(self.output_dir / "final")
        finally:
            writer.close()
        return last
