"""The output directory of a run: what may be written into it, what a resume starts from.

- A fresh run into a directory that holds a finished run (``final/`` or checkpoints) stops
  with an error before anything is loaded or written, unless ``overwrite`` (which removes
  that run, saying what) or ``resume_from``. A directory with only an earlier run's
  ``metrics.jsonl`` (a run that failed) keeps it as ``metrics.prev-<n>.jsonl``.
- Temporary directories of checkpoint writes that never finished are removed at start.
- ``resume_from`` names a checkpoint, or a run directory (its latest complete checkpoint);
  the checkpoint must verify against its manifest, its config must equal this run's but for
  ``max_steps``, and ``max_steps`` must be past its step.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from posttrain import config as config_mod
from posttrain.config import ConfigError
from posttrain.trainers import checkpoint as ckpt


def output_dir(cfg) -> Path:
    return Path(cfg.output_dir or f"runs/{cfg.run_name}")


def check_output_dir(cfg) -> None:
    """Before anything is loaded: clean unfinished writes, and refuse (or, with overwrite,
    remove) a finished run unless resuming."""
    out = output_dir(cfg)
    if not out.is_dir():
        if out.exists():
            raise ConfigError(f"output_dir {out} is a file, not a directory")
        return
    for p in ckpt.clean_partial(out):
        print(f"removed {p}: a checkpoint write that never finished", flush=True)
    if cfg.resume_from:
        return
    finished = sorted(p for p in (*out.glob("checkpoint-*"), out / "final") if p.is_dir())
    if not finished:
        return
    names = ", ".join(p.name + "/" for p in finished)
    if not cfg.overwrite:
        raise ConfigError(f"{out} holds a run ({names}): pass --overwrite true to replace it, "
                          f"--resume_from {out} to continue it, or another --output_dir")
    removed = finished + [p for p in (*out.glob("metrics*.jsonl"), out / "config.yaml",
                                      out / "tensorboard") if p.exists()]
    for p in removed:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    print(f"overwrite: removed {', '.join(str(p) for p in removed)}", flush=True)


def prepare_output(cfg) -> Path:
    """Create the directory and write the resolved ``config.yaml``; a fresh run moves an
    earlier run's ``metrics.jsonl`` aside to ``metrics.prev-<n>.jsonl``."""
    out = output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    if not cfg.resume_from and metrics.exists() and metrics.stat().st_size:
        n = 1
        while (out / f"metrics.prev-{n}.jsonl").exists():
            n += 1
        metrics.rename(out / f"metrics.prev-{n}.jsonl")
        print(f"{metrics} held an earlier run's metrics: moved to metrics.prev-{n}.jsonl",
              flush=True)
    config_mod.dump(cfg, out / "config.yaml")
    return out


def resolve_resume(cfg) -> Path | None:
    """The checkpoint ``cfg.resume_from`` names (a run directory: its latest complete
    checkpoint), verified and checked against ``cfg``; ``cfg.resume_from`` is set to it."""
    if not cfg.resume_from:
        return None
    p = Path(cfg.resume_from)
    if not p.exists():
        raise FileNotFoundError(f"resume_from={p}: no such checkpoint or run directory")
    if not (p / ckpt.STATE).exists() and not (p / ckpt.MANIFEST).exists():
        latest = ckpt.latest_complete(p)
        if latest is None:
            raise ckpt.CheckpointError(f"resume_from={p}: no complete checkpoint-<step>/ "
                                       "there to resume from")
        print(f"resume_from={p}: its latest complete checkpoint is {latest.name}", flush=True)
        p = latest
    manifest = ckpt.verify(p)
    if manifest.get("format") != ckpt.FORMAT:
        raise ckpt.CheckpointError(f"resume_from={p}: a checkpoint of format "
                                   f"{manifest.get('format')} (this release reads {ckpt.FORMAT})")
    ckpt.check_resume(p, manifest, cfg)
    cfg.resume_from = str(p)
    return p
