"""Typed configuration: dataclasses with a docstring per field, loaded from YAML files and
``--key value`` command-line overrides onto the same fields.

``base`` holds what every run shares, ``offline`` the batching of SFT, RM and DPO, ``rl``
the on-policy commands. A key a command does not read is an unknown-key error that names the
closest valid key. Values are converted to the field's type and validated once, at start-up,
by each config's ``validate``, which also decides the derived values (the default
``output_dir``, say) so that nothing downstream decides them again.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import itertools
import textwrap
import types
import typing
from dataclasses import fields
from pathlib import Path

import yaml

from posttrain import pysource
from posttrain.config.errors import ConfigError, check

# --- loading ---------------------------------------------------------------------------------

def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (and its bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = pysource.parse(textwrap.dedent(pysource.class_source(klass)))
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
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}: cannot read {value!r} as {hint.__name__}") from None
    return value


# What users of other libraries (TRL, transformers' Trainer, OpenRLHF, verl) type for a key,
# suggested by name when the key is unknown (one name per setting; no silent aliases).
OTHER_NAMES = {
    "learning_rate": "lr", "lr_scheduler_type": "lr_schedule",
    "warmup_steps": "warmup_ratio", "num_train_epochs": "epochs", "num_epochs": "epochs",
    "per_device_train_batch_size": "batch_size", "train_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum", "grad_clip": "max_grad_norm",
    "logging_steps": "log_every", "save_steps": "save_every",
    "eval_steps": "eval_every", "model_name_or_path": "model", "pretrain": "model",
    "dataset": "data", "train_file": "data", "num_generations": "group_size",
    "n_samples_per_prompt": "group_size", "max_completion_length": "max_new_tokens",
    "generate_max_len": "max_new_tokens", "epsilon": "clip_low", "epsilon_high": "clip_high",
    "eps_clip": "clip_low", "init_kl_coef": "reward_kl_coef", "kl_ctl": "reward_kl_coef",
    "num_iterations": "ppo_epochs", "resume_from_checkpoint": "resume_from",
    "torch_dtype": "dtype", "bf16": "dtype",
    # posttrain's own earlier names: one switch for both parts of the sampler cache; one
    # sampling dtype for every engine
    "reuse_rollout_forward": "replay_projections",
    "vllm_dtype": "rollout_dtype",
}


def suggest(key: str, names: list[str]) -> str:
    """'; did you mean ...?' for an unknown key: another library's name for one of ours, or
    the closest of ``names``; '' when nothing is close."""
    other = OTHER_NAMES.get(key) or next(
        (OTHER_NAMES[k] for k in difflib.get_close_matches(key, list(OTHER_NAMES), n=1,
                                                           cutoff=0.85)), None)
    if other in names:
        return f"; posttrain calls it {other!r}"
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def apply(cfg, values: dict, source: str = "override"):
    """Set ``values`` on ``cfg`` with type conversion; unknown keys suggest the closest."""
    hints = typing.get_type_hints(type(cfg))
    names = [f.name for f in fields(cfg)]
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in names:
            raise ConfigError(f"unknown key {key!r} in {source}{suggest(name, names)}")
        setattr(cfg, name, _convert(name, value, hints[name]))
        given = getattr(cfg, "given", None)
        if isinstance(given, set):
            given.add(name)
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
        apply(cfg, read_yaml(config_file), source=config_file)
    if overrides:
        apply(cfg, parse_overrides(overrides), source="command line")
    cfg.validate()
    return cfg


def read_yaml(config_file: str) -> dict:
    """The mapping a YAML config file holds; every problem a :class:`ConfigError` naming the
    file (and the line, for a syntax error)."""
    path = Path(config_file)
    if not path.exists():
        raise ConfigError(f"config file {config_file} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {config_file} is a directory, not a YAML file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{config_file}: not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{config_file}{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{config_file}: expected a mapping of key: value, got "
                          f"{type(data).__name__}")
    return data


ONE_OFF_KEYS = {"overwrite": False, "resume_from": None}
"""Keys that describe one invocation, not the run: a run's config.yaml holds their defaults,
so loading it again never deletes or resumes anything by itself."""


def dump(cfg, path: str | Path) -> None:
    """``cfg`` as YAML (loadable with ``load``), one-off keys at their defaults."""
    values = {**dataclasses.asdict(cfg), **{k: v for k, v in ONE_OFF_KEYS.items()
                                            if hasattr(cfg, k)}}
    Path(path).write_text(yaml.safe_dump(values, sort_keys=False))


# (last: config.rl imports ConfigError and check from this package)
from posttrain.config.base import RunConfig, check_device  # noqa: E402
from posttrain.config.distill import DistillConfig  # noqa: E402
from posttrain.config.offline import DPOConfig, OfflineConfig, RMConfig, SFTConfig  # noqa: E402
from posttrain.config.rl import PPOConfig, RLConfig  # noqa: E402

__all__ = ["ConfigError", "DPOConfig", "DistillConfig", "OfflineConfig", "PPOConfig", "RLConfig",
           "RMConfig", "RunConfig", "SFTConfig", "apply", "check", "check_device", "dump",
           "field_docs", "load", "parse_overrides"]
