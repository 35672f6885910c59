"""Reading Kiln's numeric environment settings (``KILN_*``) the same way everywhere."""

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
