"""Kiln's pytest plugin (entry point ``pytest11``): fixtures and device markers.

* ``default_model_dir``: the embedded default model as a cached Hugging Face folder.
* ``tokenizer_dir``: the tokenizer tiny models take: ``$KILN_TEST_TOKENIZER_DIR`` where set
  (the default model's tokenizer files alone, on machines without its package), else the
  default model's.
* ``tiny_model_dir(model_type, **config_overrides)``: a tiny random-weight model of that type.
* ``kiln_plugins``: a ``PluginManager`` without auto-loaded entry points, for
  registering plugins under test.
* Tests marked ``cuda`` / ``npu`` are skipped unless that device is available.
"""

from __future__ import annotations

import copy
import hashlib
import os

import pytest


def _device_available(name: str) -> bool:
    from kiln.plugins import get_plugin_manager

    spec = get_plugin_manager().registry.platforms.get(name)
    try:
        return bool(spec and spec.is_available())
    except Exception:
        return False


def pytest_configure(config: pytest.Config) -> None:
    for marker in ("cuda: needs an NVIDIA GPU", "npu: needs an Ascend NPU"):
        config.addinivalue_line("markers", marker)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for device in ("cuda", "npu"):
        marked = [item for item in items if item.get_closest_marker(device) is not None]
        if marked and not _device_available(device):
            skip = pytest.mark.skip(reason=f"no {device} device available on this machine")
            for item in marked:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from kiln.models.loader import resolve_model

    return resolve_model(None, "auto").path


@pytest.fixture(scope="session")
def tokenizer_dir(request: pytest.FixtureRequest) -> str:
    return os.environ.get("KILN_TEST_TOKENIZER_DIR") or request.getfixturevalue("default_model_dir")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str):
    from kiln.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")

    def make(model_type: str = "llama", **overrides: object) -> str:
        name = "-".join([model_type, *(f"{k}={v}" for k, v in sorted(overrides.items()))])
        if len(name) > 120:  # a folder name has 255 bytes at most
            name = f"{model_type}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"
        # A copy: transformers fills in the dicts it is given (rope parameters), which would
        # change the caller's and the next call's folder name.
        return build_tiny_model(model_type, root / name, tokenizer_dir, **copy.deepcopy(overrides))

    return make


@pytest.fixture
def kiln_plugins():
    from kiln.plugins import PluginManager

    return PluginManager(load_entrypoints=False)
