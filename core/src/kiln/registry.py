"""What plugins register, without importing any of it (no torch here).

Each registration hook hands the registry a *spec* or a *lazy reference*: a
``"package.module:attr"`` string or a function that imports inside. Nothing a
plugin provides is imported until the engine chooses it, so ``kiln plugins`` and
``kiln --help`` import no torch and no device library.

One table per kind (``Registry.platforms``, ``Registry.attention_backends``...),
each ``name -> spec or lazy reference``. When two plugins register the same
name, the registration pluggy calls first wins (the plugin loaded later, or
one marked ``tryfirst``) and a warning names both.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("kiln.plugins")

LazyRef = str | Callable[[], object]  # "package.module:attr", or a function that imports inside

KINDS = (
    "platforms",
    "attention_backends",
    "models",
    "guided_backends",
    "tool_parsers",
    "reasoning_parsers",
    "chat_templates",
)


def load_ref(ref: LazyRef) -> Any:
    """Resolve a lazy reference: ``"pkg.mod:attr"`` is imported, a function is called."""
    if isinstance(ref, str):
        module, _, attr = ref.partition(":")
        obj = importlib.import_module(module)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
        return obj
    return ref()


@dataclass(frozen=True, slots=True)
class PlatformSpec:
    """How to find a platform without importing it (``register_platforms``).

    ``factory`` resolves to a ``kiln.interfaces.platform.Platform`` subclass or
    instance. ``is_available`` must be cheap and must not initialise the device;
    ``priority`` orders platforms for ``--device auto`` (highest wins).
    """

    name: str
    factory: LazyRef
    is_available: Callable[[], bool]
    priority: int = 0


@dataclass(frozen=True, slots=True)
class AttentionBackendSpec:
    """An attention backend (``register_attention_backends``).

    ``factory`` resolves to a ``kiln.interfaces.attention.AttentionBackend``
    subclass; ``platforms`` are the ``Platform.name`` values it runs on (``"*"``:
    any). The engine skips a backend whose platforms do not include the chosen one.
    """

    name: str
    factory: LazyRef
    platforms: tuple[str, ...]

    def runs_on(self, platform: str) -> bool:
        return "*" in self.platforms or platform in self.platforms


@dataclass(slots=True)
class PluginInfo:
    """One loaded plugin: where it came from and what it registered, by kind."""

    name: str
    distribution: str | None = None
    version: str | None = None
    registered: dict[str, list[str]] = field(default_factory=dict)


@dataclass(slots=True)
class Registry:
    """Everything registered, one table per kind, with who registered each entry."""

    platforms: dict[str, PlatformSpec] = field(default_factory=dict)
    attention_backends: dict[str, AttentionBackendSpec] = field(default_factory=dict)
    models: dict[str, LazyRef] = field(default_factory=dict)  # HF architecture -> model class
    guided_backends: dict[str, LazyRef] = field(default_factory=dict)
    tool_parsers: dict[str, LazyRef] = field(default_factory=dict)
    reasoning_parsers: dict[str, LazyRef] = field(default_factory=dict)
    chat_templates: dict[str, Any] = field(default_factory=dict)  # name -> Jinja source or loader
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # plugin name -> why it failed to load
    owners: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, name) -> plugin

    def table(self, kind: str) -> dict[str, Any]:
        if kind not in KINDS:
            raise KeyError(f"unknown registry kind {kind!r}; kinds: {', '.join(KINDS)}")
        return getattr(self, kind)

    def get(self, kind: str, name: str) -> Any:
        return self.table(kind)[name]

    def names(self, kind: str) -> list[str]:
        return sorted(self.table(kind))

    def add(self, kind: str, name: str, value: Any, plugin: str) -> None:
        """Record ``plugin``'s registration; the first registration of a name wins."""
        owner = self.owners.get((kind, name))
        if owner is not None:
            logger.warning("%s %r is registered by both %r and %r; using %r's", kind, name, owner, plugin, owner)
            return
        self.table(kind)[name] = value
        self.owners[(kind, name)] = plugin
        info = self.plugins.get(plugin)
        if info is not None:
            info.registered.setdefault(kind, []).append(name)
