"""What a user names on the command line as ``module:Name`` or ``path/to/file.py:Name``: a
reward function, an environment class, a tool."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def load_object(spec: str, what: str, noun: str = "Name"):
    """``module:Name`` or ``path/to/file.py:Name`` → the object it names. A file is run as
    a module registered under a name of its own (dataclasses and typing look their module
    up in ``sys.modules``). Errors name ``what`` and ``spec``."""
    if ":" not in spec:
        raise ValueError(f"{what} {spec!r}: expected module:{noun} or file.py:{noun}")
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target)
        if not path.exists():
            raise FileNotFoundError(f"{what} {spec!r}: no file {target}")
        module_name = f"posttrain_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        mod_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[module_name] = module
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    obj = getattr(module, name, None)
    if obj is None:
        raise ValueError(f"{what} {spec!r}: {target} has no {noun} {name!r}")
    return obj
