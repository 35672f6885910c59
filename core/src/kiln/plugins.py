"""Plugin loading: entry points and files in, a ``kiln.registry.Registry`` out.

Plugins are modules with ``@kiln.hookimpl`` functions, found through the ``kiln``
entry-point group (or registered directly, e.g. by tests). Each registration
hook is called once through pluggy's hook caller with a ``register`` callback;
the callback tells plugins apart by the hook implementation that called it, so
``kiln plugins`` can say who registered what, and ``tryfirst``/``trylast``,
wrappers and ``KILN_TRACE_PLUGINS`` work as pluggy documents them.

``KILN_LOAD_PLUGINS`` (comma-separated entry-point names; empty = none) limits
which installed plugins load; ``KILN_TRACE_PLUGINS=1`` logs every hook call.
This module imports no torch: only ``kiln.registry`` and ``kiln.hookspecs``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from types import CodeType, TracebackType
from typing import Any

import pluggy

from kiln import hookspecs
from kiln.registry import KINDS, LazyRef, PluginInfo, Registry, load_ref

__all__ = ["ENTRY_POINT_GROUP", "PLATFORM_PLUGINS", "LazyRef", "PluginManager", "get_plugin_manager", "load_ref"]

logger = logging.getLogger("kiln.plugins")

ENTRY_POINT_GROUP = "kiln"
# Which distribution brings which platform, for "install X" messages.
PLATFORM_PLUGINS = {"cpu": "kiln-plugin-cpu", "cuda": "kiln-plugin-cuda", "npu": "kiln-plugin-ascend"}


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
        """Register a module or object holding ``@kiln.hookimpl`` functions under ``name``."""
        if type(plugin).__hash__ is None:  # e.g. a SimpleNamespace: pluggy's subset_hook_caller hashes plugins
            plugin = _HashablePlugin(plugin)
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
        reg.plugins = dict(self.info)
        for kind in KINDS:
            self._call_registration_hook(reg, kind)
        return reg

    def _call_registration_hook(self, reg: Registry, kind: str) -> None:
        """Call ``register_<kind>`` through pluggy; a plugin that raises is reported and the
        hook is called again without it (its partial registrations are discarded)."""
        name = f"register_{kind}"
        excluded: list[object] = []
        while True:
            caller = self.pm.subset_hook_caller(name, excluded) if excluded else getattr(self.pm.hook, name)
            impls = {impl.function.__code__: impl.plugin_name for impl in caller.get_hookimpls()}
            attempt = Registry(plugins=reg.plugins)
            try:
                caller(register=_registrar(attempt, kind, impls))
            except Exception as exc:
                culprit = _raising_plugin(exc.__traceback__, impls)
                if culprit is None:
                    raise
                reg.errors[culprit] = f"{name}: {type(exc).__name__}: {exc}"
                logger.warning("plugin %r failed in %s: %s", culprit, name, exc)
                excluded.append(self.pm.get_plugin(culprit))
                for info in reg.plugins.values():
                    info.registered.pop(kind, None)
                continue
            for (k, entry), owner in attempt.owners.items():
                reg.table(k)[entry] = attempt.table(k)[entry]
                reg.owners[(k, entry)] = owner
            return

    def update_engine_config(self, config: Any) -> None:
        self.pm.hook.update_engine_config(config=config)

    def register_commands(self, cli: Any) -> None:
        self.pm.hook.register_commands(cli=cli)


class _HashablePlugin:
    """The attributes of an unhashable plugin object, in a hashable one."""

    def __init__(self, plugin: object) -> None:
        self.__dict__.update(vars(plugin))


def _registrar(reg: Registry, kind: str, impls: dict[CodeType, str]) -> Callable[..., None]:
    """The ``register`` callback for one call of ``register_<kind>``: ``register(spec)`` (a spec
    carrying its name) or ``register(name, factory)``, attributed to the calling plugin."""

    def register(name_or_spec: Any, factory: Any = None) -> None:
        if factory is None:
            name, value = name_or_spec.name, name_or_spec
        else:
            name, value = name_or_spec, factory
        reg.add(kind, name, value, _calling_plugin(impls))

    return register


def _calling_plugin(impls: dict[CodeType, str]) -> str:
    """The plugin whose hook implementation is the innermost caller on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in impls:
            return impls[frame.f_code]
        frame = frame.f_back
    return "unknown"


def _raising_plugin(tb: TracebackType | None, impls: dict[CodeType, str]) -> str | None:
    culprit = None
    while tb is not None:
        culprit = impls.get(tb.tb_frame.f_code, culprit)
        tb = tb.tb_next
    return culprit


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
