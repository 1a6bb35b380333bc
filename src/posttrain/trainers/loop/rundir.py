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
import sys
from pathlib import Path

from posttrain import config as config_mod
from posttrain.config import ConfigError
from posttrain.trainers.loop import checkpoint as ckpt


def output_dir(cfg) -> Path:
    return Path(cfg.output_dir or f"runs/{cfg.run_name}")


def _note(message: str) -> None:
    from posttrain import dist

    if dist.is_main():
        print(message, file=sys.stderr, flush=True)


def _finished(out: Path) -> list[Path]:
    """What a finished (or checkpointed) run left in ``out``."""
    return sorted(p for p in (*out.glob("checkpoint-*"), out / "final")
                  if p.is_dir() and ckpt._ours(p.name))


def _replaces(cfg, resume: Path | None) -> bool:
    """Whether this run writes into a directory that is not its own run's: a fresh run, or
    a resume into another directory than the checkpoint's."""
    return resume is None or output_dir(cfg).resolve() != resume.parent.resolve()


def check_output_dir(cfg, resume: Path | None) -> None:
    """Before anything is loaded: a resume with no output_dir of its own writes into the
    checkpoint's run directory; unfinished writes are finished or removed; a run into a
    directory holding another run is refused unless ``overwrite`` (which removes it only
    once the new run has loaded everything, in :func:`prepare_output`)."""
    if resume is not None and cfg.output_dir == f"runs/{cfg.run_name}" \
            and "output_dir" not in getattr(cfg, "given", ()):
        cfg.output_dir = str(resume.parent)
    out = output_dir(cfg)
    if not out.is_dir():
        if out.exists():
            raise ConfigError(f"output_dir {out} is a file, not a directory")
        return
    from posttrain import dist

    for line in (ckpt.clean_partial(out) if dist.is_main() else []):
        _note(line)
    finished = _finished(out)
    if not finished or not _replaces(cfg, resume) or cfg.overwrite:
        return
    names = ", ".join(p.name + "/" for p in finished)
    if not (out / "final").is_dir() and ckpt.latest_complete(out) is not None:
        hint = f"--resume_from {out} to continue it, --overwrite true to replace it"
    else:
        hint = "--overwrite true to replace it"
    raise ConfigError(f"{out} holds another run ({names}): pass {hint}, or another "
                      "--output_dir")


def prepare_output(cfg, resume: Path | None = None) -> Path:
    """Create the directory and write the resolved ``config.yaml``. With ``overwrite``, the
    run it replaces is removed now, when this one has loaded everything (and said what it
    removes); a fresh run moves an earlier run's ``metrics.jsonl`` aside to
    ``metrics.prev-<n>.jsonl``."""
    out = output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.overwrite and _replaces(cfg, resume) and _finished(out):
        removed = _finished(out) + [p for p in (*out.glob("metrics*.jsonl"),
                                                *out.glob("samples*.jsonl"),
                                                out / "config.yaml", out / "tensorboard")
                                    if p.exists()]
        for p in removed:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        _note(f"overwrite: removed {', '.join(str(p) for p in removed)}")
    for name in ("metrics", "samples"):
        rows = out / f"{name}.jsonl"
        if resume is None and rows.exists() and rows.stat().st_size:
            n = 1
            while (out / f"{name}.prev-{n}.jsonl").exists():
                n += 1
            rows.rename(out / f"{name}.prev-{n}.jsonl")
            _note(f"{rows} held an earlier run's {name}: moved to {name}.prev-{n}.jsonl")
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
    if p.name == "final" or (p.name == "final.tmp"):
        raise ckpt.CheckpointError(f"resume_from={p}: final/ is a finished run's model, not a "
                                   "checkpoint; resume from a checkpoint-<step>/ (or start a "
                                   "new run from it with --model)")
    if not (p / ckpt.STATE).exists() and not (p / ckpt.MANIFEST).exists():
        latest = ckpt.latest_complete(p)
        if latest is None:
            raise ckpt.CheckpointError(f"resume_from={p}: no complete checkpoint-<step>/ "
                                       "there to resume from")
        _note(f"resume_from={p}: its latest complete checkpoint is {latest.name}")
        p = latest
    manifest = ckpt.verify(p)
    if manifest.get("format") != ckpt.FORMAT or not (p / ckpt.STATE).is_file():
        raise ckpt.CheckpointError(f"resume_from={p}: not a checkpoint of this release "
                                   f"(format {manifest.get('format')}, this one reads "
                                   f"{ckpt.FORMAT})")
    ckpt.check_resume(p, manifest, cfg)
    cfg.resume_from = str(p)
    return p
