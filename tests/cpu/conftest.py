"""Fixtures of the CPU plugin's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def march_cache_dir(tmp_path_factory: pytest.TempPathFactory, march: str) -> Path:
    """A ``KILN_CACHE_DIR`` for the C kernels built with ``-march={march}`` (the test's parameter):
    one per level for the whole run, both xdist workers included, so that each level compiles once
    (about 14 s a build here) however many tests check its kernels. Builds land by atomic rename,
    so two workers building at once is safe."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, above each worker's own
    path = base / f"kernels-{march}"
    path.mkdir(exist_ok=True)
    return path
