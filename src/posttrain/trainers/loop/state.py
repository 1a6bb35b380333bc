"""A run's whole state on disk and back: models, optimisers, RNG states, the job's own
state, the metrics window and the budgets' totals, written atomically with the manifest
last (the files themselves: :mod:`.checkpoint`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import load_file, save_file

from posttrain import dist
from posttrain.trainers.loop import checkpoint as ckpt
from posttrain.trainers.loop.guards import check_finite_weights
from posttrain.trainers.loop.job import Job, Totals
from posttrain.trainers.loop.metrics import Window
from posttrain.trainers.trained import full_states


def save_checkpoint(path: Path, job: Job, step: int, window: Window, run_id: str,
                    cfg, totals: Totals | None = None) -> None:
    """Everything a resume needs, written atomically with its manifest last (see
    :mod:`.checkpoint`)."""
    check_finite_weights(job.models(), step)
    states = full_states(job)  # sharded models: gathered on rank 0 (every rank takes part)
    optimizer_states = [o.state_for_save() for o in job.optimizers]
    meta, tensors = job.state()  # (every rank: a job may gather its ranks' parts)
    if not dist.is_main():
        dist.barrier()  # rank 0 writes; every rank goes on once it has
        return

    def write(tmp: Path) -> None:
        job.save(tmp, states)
        for o, sd in zip(job.optimizers, optimizer_states, strict=True):
            ckpt.save_optimizer(sd, tmp / f"optimizer-{o.name}")
        rng_meta, rng_tensors = ckpt.rng_state()
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
