"""Registers the ``cuda`` platform and the ``triton`` attention backend (imports happen when chosen)."""

from __future__ import annotations

import kiln
from kiln.registry import AttentionBackendSpec, PlatformSpec


def cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


@kiln.hookimpl
def register_platforms(register) -> None:
    register(PlatformSpec("cuda", "kiln_cuda.platform:CudaPlatform", is_available=cuda_present, priority=20))


@kiln.hookimpl
def register_attention_backends(register) -> None:
    register(AttentionBackendSpec("triton", "kiln_cuda.attention:TritonAttentionBackend", platforms=("cuda",)))
