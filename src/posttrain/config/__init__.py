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
import inspect
import itertools
import textwrap
import types
import typing
from dataclasses import fields
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A bad configuration key or value, with a message meant for the user."""


def check(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok``."""
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


from posttrain.config.base import RunConfig  # noqa: E402  (the classes use check above)
from posttrain.config.offline import DPOConfig, OfflineConfig, RMConfig, SFTConfig  # noqa: E402
from posttrain.config.rl import PPOConfig, RLConfig  # noqa: E402

__all__ = ["ConfigError", "DPOConfig", "OfflineConfig", "PPOConfig", "RLConfig", "RMConfig",
           "RunConfig", "SFTConfig", "apply", "check", "dump", "field_docs", "load",
           "parse_overrides"]
