"""Reading environment settings (``KILN_*`` and the switches of seed documents) the same way everywhere."""

from __future__ import annotations

import os


def env_number(name: str, default: float, kind: type = float) -> float:
    """The environment variable ``name`` as a finite number >= 0 of type ``kind`` (``default`` when
    unset or empty); anything else is a ``ValueError`` naming the variable. ``nan`` and ``inf`` are
    refused too: as a bound they would silently turn it off."""
    value = os.environ.get(name)
    try:
        parsed = default if value in (None, "") else kind(value)
    except ValueError:
        raise ValueError(f"{name}: expected a number, got {value!r}") from None
    if not 0 <= parsed < float("inf"):
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
    return parsed


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The environment variable ``name`` as a switch (``default`` when unset or empty); a value
    neither true (1/true/yes/on) nor false (0/false/no/off) is a ``ValueError`` naming it."""
    value = os.environ.get(name, "").strip().lower()
    if value not in _TRUE + _FALSE + ("",):
        raise ValueError(f"{name}: expected true or false, got {os.environ[name]!r}")
    return default if not value else value in _TRUE
