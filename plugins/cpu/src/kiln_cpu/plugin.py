"""Entry point of kiln-plugin-cpu: registers the ``cpu`` platform and its attention backend."""

from __future__ import annotations

from kiln import hookimpl
from kiln.registry import AttentionBackendSpec, PlatformSpec


@hookimpl
def register_platforms(register):
    # Always available; lowest priority so any accelerator wins `--device auto`.
    register(PlatformSpec("cpu", "kiln_cpu.platform:CpuPlatform", is_available=lambda: True, priority=0))


@hookimpl
def register_attention_backends(register):
    register(AttentionBackendSpec("cpu", "kiln_cpu.attention:CpuAttentionBackend", ("cpu",)))
