"""Registering a plugin's parts for the length of a test."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator


@contextlib.contextmanager
def registered_attention_backend(name: str, backend: type, platforms: tuple[str, ...] = ("cpu",)) -> Iterator[None]:
    """Register ``backend`` as attention backend ``name`` in the global plugin manager (as an
    installed plugin would), and unregister it on exit."""
    from kiln import hookimpl, plugins
    from kiln.attention.base import AttentionBackendSpec

    @hookimpl
    def register_attention_backends(register):
        register(AttentionBackendSpec(name, lambda: backend, platforms))

    manager = plugins.get_plugin_manager()
    manager.register(types.SimpleNamespace(register_attention_backends=register_attention_backends), name=name)
    try:
        yield
    finally:
        manager.unregister(name=name)
