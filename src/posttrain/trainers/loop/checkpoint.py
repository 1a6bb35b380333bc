"""What a checkpoint holds besides the models, written without pickle: optimiser states,
RNG states and the loop's own state, and the repair of ``metrics.jsonl`` on resume.

A ``checkpoint-<step>/`` directory is written under a temporary name and renamed when
complete, so a directory with that name is never half-written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

STATE = "trainer_state.json"
FORMAT = 3
"""The checkpoint layout this module writes (1: the per-trainer checkpoints before the one
run loop; 2: without a manifest)."""


def save_optimizer(sd: dict, path: Path) -> None:
    """``path.safetensors`` (per-parameter state tensors) and ``path.json`` (hyper-parameter
    groups) of an ``optimizer.state_dict()``: an optimiser state without pickle."""
    tensors = {f"{pid}.{k}": (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu()
               .contiguous()
               for pid, st in sd["state"].items() for k, v in st.items()}
    save_file(tensors, str(path.with_suffix(".safetensors")))
    path.with_suffix(".json").write_text(json.dumps(sd["param_groups"]))


def read_optimizer(path: Path) -> dict:
    """The ``state_dict()`` :func:`save_optimizer` wrote (parameters by position)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(path.with_suffix(".safetensors"))).items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    groups = json.loads(path.with_suffix(".json").read_text())
    return {"state": state, "param_groups": groups}


def rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """Python's and torch's global RNG states (CPU, and every CUDA device)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    version, state, gauss = random.getstate()
    return {"python": [version, list(state), gauss]}, tensors


def set_rng_state(meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def write_atomically(path: Path, write) -> None:
    """Call ``write(tmp)`` on a fresh temporary directory beside ``path``, then rename it to
    ``path`` (replacing an older one)."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write(tmp)
    old = path.with_name(path.name + ".old")
    if path.exists():  # set aside, not deleted, until the new one is in place
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old)


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the rows of ``metrics.jsonl`` up to ``step`` (a resumed run rewrites the rest)
    and drop a torn last line; returns the rows kept."""
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break  # a line the killed run did not finish writing
        if row.get("step", 0) > step:
            break
        kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)  # a kill during the repair leaves the old file whole
    return len(kept)


# --- manifests: what makes a checkpoint complete -------------------------------------------------

MANIFEST = "manifest.json"
RESUMABLE_DIFFERENCES = frozenset({"max_steps", "max_tokens", "max_seconds", "resume_from",
                                   "output_dir", "overwrite",
                                   "on_nonfinite", "on_reward_error", "parallel",
                                   "cpu_offload", "tensorboard", "report_to",
                                   "log_samples_every", "log_samples", "head_init",
                                   "rollout_servers", "launch_rollout_servers",
                                   "rollout_server_devices", "rollout_server_args",
                                   "rollout_timeout", "rollout_server_startup"})
"""Config keys a resumed run may change: how far to go, where to write, what to do on a
non-finite value, how the ranks hold the model (checkpoints hold whole states, so a run
resumes on any number of ranks, ddp or fsdp), what it reports and where, and which rollout
servers sample (samples are seeded per request, whichever server draws them). Every other
key must be the checkpoint's."""


def run_config(cfg) -> dict:
    """The part of ``cfg`` a checkpoint is bound to (see :data:`RESUMABLE_DIFFERENCES`)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE_DIFFERENCES}


def config_hash(cfg) -> str:
    return hashlib.sha256(json.dumps(run_config(cfg), sort_keys=True).encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, step: int, run_id: str, cfg) -> None:
    """The last file of a checkpoint: step, run id, config (and its hash), and the size and
    SHA-256 of every other file. A directory without it was never finished."""
    files = {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}
    manifest = {"format": FORMAT, "step": step, "run_id": run_id,
                "config_hash": config_hash(cfg), "config": run_config(cfg), "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupt, or of another run or config."""


def verify(directory: Path) -> dict:
    """The manifest of a complete checkpoint whose every file matches it; otherwise a
    :class:`CheckpointError` naming the file."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory} is incomplete: no {MANIFEST} (a run stopped while "
                              "writing it, or an older release wrote it); use another checkpoint")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(f"{path}: not a readable manifest") from None
    for name, want in files.items():
        f = directory / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing from the checkpoint")
        if f.stat().st_size != want["size"]:
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes, the manifest says "
                                  f"{want['size']} (truncated or overwritten)")
        if _sha256(f) != want["sha256"]:
            raise CheckpointError(f"{f}: its checksum differs from the manifest's (corrupt or "
                                  "overwritten)")
    return manifest


def latest_complete(output_dir: Path) -> Path | None:
    """The checkpoint-<step>/ of ``output_dir`` with the highest step that verifies."""
    steps = sorted((int(p.name.split("-", 1)[1]), p) for p in output_dir.glob("checkpoint-*")
                   if p.is_dir() and p.name.split("-", 1)[1].isdigit())
    for _, p in reversed(steps):
        try:
            verify(p)
            return p
        except CheckpointError:
            continue
    return None


def check_resume(directory: Path, manifest: dict, cfg) -> None:
    """Refuse a resume whose config differs from the checkpoint's (naming the keys) or whose
    max_steps leaves nothing to do."""
    old, new = manifest.get("config", {}), run_config(cfg)
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if changed:
        listed = ", ".join(f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in changed[:6])
        raise CheckpointError(f"resume_from={directory}: the config differs from the "
                              f"checkpoint's in {listed}; only max_steps may change")
    if cfg.max_steps and cfg.max_steps <= manifest["step"]:
        raise CheckpointError(f"resume_from={directory}: max_steps {cfg.max_steps} is not past "
                              f"the checkpoint's step {manifest['step']}; nothing to do")


def _ours(name: str) -> bool:
    """A checkpoint-<step> or final directory name (nothing else is ever cleaned up)."""
    return name == "final" or (name.startswith("checkpoint-") and name[11:].isdigit())


def clean_partial(output_dir: Path) -> list[str]:
    """Finish or undo the atomic writes a killed run left (see :func:`write_atomically`):
    a complete ``X.tmp`` whose ``X`` is missing (killed between the renames) becomes ``X``,
    an older ``X.old`` goes back to ``X`` when ``X`` is missing, and the rest is removed.
    Only ``checkpoint-<step>`` and ``final`` are touched; returns what was done."""
    done = []
    for p in sorted(output_dir.glob("*.tmp")) + sorted(output_dir.glob("*.old")):
        target = p.with_name(p.name.rsplit(".", 1)[0])
        if not p.is_dir() or not _ours(target.name):
            continue
        complete = p.suffix == ".old" or (p / MANIFEST).is_file()
        if complete and not target.exists():
            if p.suffix == ".tmp":
                try:
                    verify(p)
                except CheckpointError:
                    shutil.rmtree(p)
                    done.append(f"removed {p}: a write that never finished")
                    continue
            os.replace(p, target)
            done.append(f"restored {target} from {p.name}")
        else:
            shutil.rmtree(p)
            done.append(f"removed {p}: a write that never finished")
    return done
