"""Registers the ``npu`` platform and the ``ascend`` attention backend without importing torch_npu."""

from __future__ import annotations

import importlib.util
from functools import cache

import kiln
from kiln.registry import AttentionBackendSpec, PlatformSpec


@cache
def npu_present() -> bool:
    """torch_npu imports and reports a device (checked once, so the device is initialised once)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available() and torch.npu.device_count() > 0)
    except Exception:  # a broken CANN install must not take other platforms down
        return False


@kiln.hookimpl
def register_platforms(register) -> None:
    register(PlatformSpec("npu", "kiln_ascend.platform:NpuPlatform", is_available=npu_present, priority=30))


@kiln.hookimpl
def register_attention_backends(register) -> None:
    register(AttentionBackendSpec("ascend", "kiln_ascend.attention:AscendAttentionBackend", platforms=("npu",)))
