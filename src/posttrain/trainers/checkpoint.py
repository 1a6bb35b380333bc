"""What a checkpoint holds besides the models, written without pickle: optimiser states,
RNG states and the loop's own state, and the repair of ``metrics.jsonl`` on resume.

A ``checkpoint-<step>/`` directory is written under a temporary name and renamed when
complete, so a directory with that name is never half-written."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

STATE = "trainer_state.json"
FORMAT = 2
"""The checkpoint layout this module writes (1: the per-trainer checkpoints before the one
run loop)."""


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
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


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
    path.write_text("".join(line + "\n" for line in kept))
    return len(kept)
