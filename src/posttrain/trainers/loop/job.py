"""What a trainer gives the run loop (:class:`Job`), what one of its steps reports
(:class:`StepResult`), and what the run has spent against its budgets (:class:`Totals`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from posttrain.trainers.loop.optim import Optim


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
    samples: list[dict] | None = None
    """The step's sample table (``log_samples_every``), rows of plain values; None: none."""


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
