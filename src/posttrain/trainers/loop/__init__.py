"""The one run loop every trainer uses: SFT, reward model, DPO and the on-policy loop.

A trainer is a :class:`Job`: it says what one step does and what its state is; it never
logs, checkpoints or sets a learning rate itself. The loop's rooms:

- :mod:`.runner` — the loop itself: process settings and seeds, the schedule, the progress,
  the cadences (log, eval, save), the final evaluation and ``final/``, stopping on a signal;
- :mod:`.job` — what a trainer gives it and what a step reports;
- :mod:`.optim` — AdamW, gradient clipping, the non-finite check, the data-parallel sum;
- :mod:`.metrics` — the window of steps and ``metrics.jsonl`` / TensorBoard;
- :mod:`.state` — a run's state written to a checkpoint and read back, bit-exactly;
- :mod:`.checkpoint` — the files: atomic writes, manifests, verification, optimiser states;
- :mod:`.rundir` — the output directory: refusing to replace a run, resuming into it;
- :mod:`.guards` — non-finite values and the stop signals.
"""

from posttrain.trainers.loop.job import Job, StepResult, Totals
from posttrain.trainers.loop.optim import Optim, adamw
from posttrain.trainers.loop.runner import lr_lambda, run, seed_everything, start_run

__all__ = ["Job", "Optim", "StepResult", "Totals", "adamw", "lr_lambda", "run",
           "seed_everything", "start_run"]
