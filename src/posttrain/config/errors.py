"""The error a bad configuration raises, and the check that raises it: a module of its own,
so that the config modules (:mod:`.base`, :mod:`.offline`, :mod:`.rl`) import them without
importing the package that imports them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration key or value, with a message meant for the user."""


def check(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)
