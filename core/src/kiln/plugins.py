"""Plugin loading and the registry of everything plugins provide.

Plugins are modules with ``@kiln.hookimpl`` functions, found through the ``kiln``
entry-point group (or registered directly, e.g. by tests). Each registration
hook is called once, per plugin, with a ``register`` callback bound to that
plugin, so ``kiln plugins`` can say who registered what.

``KILN_LOAD_PLUGINS`` (comma-separated entry-point names; empty = none) limits
which installed plugins load; ``KILN_TRACE_PLUGINS=1`` logs every hook call.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from kiln import hookspecs
from kiln.platforms.base import LazyRef

logger = logging.getLogger("kiln.plugins")

ENTRY_POINT_GROUP = "kiln"
# Which distribution brings which platform, for "install X" messages.
PLATFORM_PLUGINS = {"cpu": "kiln-plugin-cpu", "cuda": "kiln-plugin-cuda", "npu": "kiln-plugin-ascend"}
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


@dataclass(slots=True)
class PluginInfo:
    name: str
    distribution: str | None = None
    version: str | None = None
    registered: dict[str, list[str]] = field(default_factory=dict)


@dataclass(slots=True)
class Registry:
    """name -> spec or lazy factory, per kind, with who registered each."""

    items: dict[str, dict[str, Any]] = field(default_factory=lambda: {k: {} for k in KINDS})
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # plugin name -> why it failed to load

    def get(self, kind: str, name: str) -> Any:
        return self.items[kind][name]

    def names(self, kind: str) -> list[str]:
        return sorted(self.items[kind])


class PluginManager:
    """Wraps ``pluggy.PluginManager``; builds the ``Registry`` once, at start-up."""

    def __init__(self, load_entrypoints: bool = True) -> None:
        self.pm = pluggy.PluginManager("kiln")
        self.pm.add_hookspecs(hookspecs)
        self.info: dict[str, PluginInfo] = {}
        self.errors: dict[str, str] = {}
        self.register(importlib.import_module("kiln.builtin_plugin"), name="builtin", distribution="kiln-core")
        if load_entrypoints:
            self.load_entrypoints()
        if os.environ.get("KILN_TRACE_PLUGINS"):
            self.pm.trace.root.setwriter(lambda msg: logger.info("%s", msg.rstrip()))
            self.pm.enable_tracing()
        self.pm.check_pending()
        self._registry: Registry | None = None

    def register(self, plugin: object, name: str, distribution: str | None = None, version: str | None = None) -> None:
        self.pm.register(plugin, name=name)
        if version is None and distribution is not None:
            version = _dist_version(distribution)
        self.info[name] = PluginInfo(name, distribution, version)
        self._registry = None

    def load_file(self, path: str) -> str:
        """Register the ``@kiln.hookimpl`` functions of a Python file as a plugin (``--tool-parser-plugin``)."""
        name = f"file:{os.path.abspath(path)}"
        if self.pm.has_plugin(name):
            return name
        spec = importlib.util.spec_from_file_location(f"kiln_file_plugin_{abs(hash(name))}", path)
        if spec is None or not os.path.isfile(path):
            raise ValueError(f"{path}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.register(module, name=name)
        return name

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self.info.pop(name, None)
        self._registry = None

    def load_entrypoints(self) -> None:
        # NOTE: pluggy's load_setuptools_entrypoints stops at the first plugin that
        # fails to import; we load each entry point ourselves so a broken plugin is
        # reported by name and the rest still load.
        allowed = os.environ.get("KILN_LOAD_PLUGINS")
        allow = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if (allow is not None and ep.name not in allow) or self.pm.has_plugin(ep.name):
                continue
            dist = ep.dist.name if ep.dist else None
            try:
                module = ep.load()
                self.register(module, name=ep.name, distribution=dist, version=ep.dist.version if ep.dist else None)
            except Exception as exc:  # a broken plugin must not take the engine down
                self.errors[ep.name] = f"{type(exc).__name__}: {exc}"
                logger.warning("plugin %r (%s) failed to load and is skipped: %s", ep.name, dist, exc)

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = self._collect()
        return self._registry

    def _collect(self) -> Registry:
        reg = Registry(errors=dict(self.errors))
        for info in self.info.values():
            info.registered.clear()
        for kind in KINDS:
            hook = getattr(self.pm.hook, f"register_{kind}")
            # Registration order: built-ins first, so an installed plugin may override them.
            for impl in hook.get_hookimpls():
                info = self.info[impl.plugin_name]
                try:
                    impl.function(register=_registrar(reg, kind, info))
                except Exception as exc:
                    reg.errors[impl.plugin_name] = f"register_{kind}: {type(exc).__name__}: {exc}"
                    logger.warning("plugin %r failed in register_%s: %s", impl.plugin_name, kind, exc)
        reg.plugins = dict(self.info)
        return reg

    def update_engine_config(self, config: Any) -> None:
        self.pm.hook.update_engine_config(config=config)

    def register_commands(self, cli: Any) -> None:
        self.pm.hook.register_commands(cli=cli)


def _registrar(reg: Registry, kind: str, info: PluginInfo) -> Callable[..., None]:
    def register(name_or_spec: Any, factory: Any = None) -> None:
        if factory is None:  # a spec object carrying its own name
            name, value = name_or_spec.name, name_or_spec
        else:
            name, value = name_or_spec, factory
        reg.items[kind][name] = value
        info.registered.setdefault(kind, []).append(name)

    return register


def _dist_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


_default: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, loading installed plugins on first use."""
    global _default
    if _default is None:
        _default = PluginManager()
    return _default
