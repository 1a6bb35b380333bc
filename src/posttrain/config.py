"""Typed configuration: dataclasses with a docstring per field, loaded from YAML files and
``--key value`` command-line overrides onto the same fields.

Unknown keys are errors that name the closest valid key. Values are converted to the field's
type and validated once, at start-up, by each config's ``validate``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import textwrap
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A bad configuration key or value, with a message meant for the user."""


@dataclass
class TrainConfig:
    """Settings every trainer shares."""

    model: str = "builtin"
    """Policy to start from: a local Hugging Face directory, a hub id, or 'builtin'."""
    data: str | None = None
    """Training data: .jsonl, .parquet or a saved `datasets` directory; none = the built-in task."""
    eval_data: str | None = None
    """Held-out data in the same format; none = the built-in task's held-out split (or none)."""
    output_dir: str | None = None
    """Where metrics, config.yaml, checkpoints and final/ go; default runs/<command>."""
    seed: int = 0
    """Seed for Python, torch and data order."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    lr_schedule: str = "cosine"
    """constant, linear or cosine decay after warm-up."""
    warmup_ratio: float = 0.05
    """Share of the steps spent warming the learning rate up from 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    batch_size: int = 16
    """Examples per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimiser step; the loss is normalised over the whole step."""
    epochs: float = 1.0
    """Passes over the training data (ignored when max_steps > 0)."""
    max_steps: int = 0
    """Optimiser steps to run; 0 = derived from epochs."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping threshold; 0 = no clipping."""
    max_length: int = 512
    """Longest tokenised example (prompt + completion) allowed."""
    overlong: str = "error"
    """What to do with a longer example: error, truncate (cut the completion) or drop."""
    log_every: int = 10
    """Write metrics every this many steps."""
    eval_every: int = 0
    """Evaluate every this many steps; 0 = at the end only."""
    save_every: int = 0
    """Write checkpoint-<step>/ every this many steps; 0 = final model only."""
    eval_batch_size: int = 64
    """Examples per evaluation batch."""
    dtype: str = "float32"
    """float32, bfloat16 or float16 weights."""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto."""
    keep_freed_memory: bool = True
    """Linux/glibc: keep memory the process frees for reuse instead of returning it to the
    kernel, so each step's activations do not page-fault afresh (13% off a 25M-parameter
    GRPO update on 2 CPU cores; results unchanged; resident memory stays at its peak).
    Process-wide; false leaves malloc's defaults alone."""
    compile: bool = False
    """torch.compile the RMSNorm and MLP blocks of the trained model, its reference and
    critic (dynamic shapes; fuses their elementwise work, forward and backward). They compile
    once, on first use (about 10 s on 2 CPU cores); on one H200 it cut a 25M fp32 GRPO step by 29%,
    on 2 CPU cores it no longer pays (see the README); needs a C++ compiler (CPU) or triton
    (CUDA)."""
    trust_remote_code: bool = False
    """Run model code shipped with a checkpoint (off unless you trust its source)."""
    tensorboard: bool = True
    """Also write TensorBoard events (when tensorboard is installed)."""
    builtin_train_size: int = 4000
    """Examples generated for the built-in task's training split."""
    builtin_eval_size: int = 500
    """Examples generated for the built-in task's held-out split."""

    def validate(self) -> None:
        _check(self.lr > 0, "lr must be > 0")
        _check(self.lr_schedule in ("constant", "linear", "cosine"),
               "lr_schedule must be constant, linear or cosine")
        _check(0 <= self.warmup_ratio < 1, "warmup_ratio must be in [0, 1)")
        _check(self.batch_size >= 1 and self.grad_accum >= 1 and self.eval_batch_size >= 1,
               "batch_size, grad_accum and eval_batch_size must be ≥ 1")
        _check(self.epochs > 0 or self.max_steps > 0, "need epochs > 0 or max_steps > 0")
        _check(self.max_length >= 2, "max_length must be ≥ 2")
        _check(self.overlong in ("error", "truncate", "drop"),
               "overlong must be error, truncate or drop")
        _check(self.dtype in ("float32", "bfloat16", "float16"),
               "dtype must be float32, bfloat16 or float16")
        _check(self.max_grad_norm >= 0, "max_grad_norm must be ≥ 0")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# --- loading ---------------------------------------------------------------------------------

def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (and its bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in itertools.pairwise(body):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _convert(name: str, value, hint):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _convert(name, value, args[0])
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("true", "1", "yes", "on"):
                return True
            if text in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if hint is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if hint is float:
            return float(value)
        if hint is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: cannot read {value!r} as {hint.__name__}") from None
    return value


def apply(cfg, values: dict, source: str = "override"):
    """Set ``values`` on ``cfg`` with type conversion; unknown keys suggest the closest."""
    hints = typing.get_type_hints(type(cfg))
    names = [f.name for f in fields(cfg)]
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown key {key!r} in {source}{hint}")
        setattr(cfg, name, _convert(name, value, hints[name]))
    return cfg


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``['--lr', '1e-5', '--beta=0.1']`` → ``{'lr': '1e-5', 'beta': '0.1'}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"expected --key value, got {arg!r}")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"{arg} needs a value")
            key, value = arg[2:], args[i + 1]
            i += 2
        out[key] = value
    return out


def load(cls: type, config_file: str | None = None, overrides: list[str] | None = None):
    """A validated ``cls`` from defaults, then the YAML file, then command-line overrides."""
    cfg = cls()
    if config_file:
        path = Path(config_file)
        if not path.exists():
            raise ConfigError(f"config file {config_file} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{config_file}: expected a mapping of key: value")
        apply(cfg, data, source=config_file)
    if overrides:
        apply(cfg, parse_overrides(overrides), source="command line")
    cfg.validate()
    return cfg


def dump(cfg, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
