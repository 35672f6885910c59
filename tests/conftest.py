"""Shared fixtures beyond those of Kiln's own pytest plugin (kiln.testing.pytest_plugin)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def varied_prompts() -> list[list[int]]:
    """Mixed lengths: shorter than a block, exactly blocks, several blocks plus a tail."""
    return [
        [1000],
        [5, 6, 7, 8, 9] * 3,
        list(range(100, 132)),
        list(range(2000, 2077)),
        [42] * 40 + list(range(300, 313)),
    ]
