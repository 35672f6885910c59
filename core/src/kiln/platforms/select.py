"""Choosing the platform for ``--device``."""

from __future__ import annotations

import logging

from kiln.interfaces.platform import Platform
from kiln.plugins import PLATFORM_PLUGINS
from kiln.registry import PlatformSpec, Registry, load_ref

logger = logging.getLogger("kiln.platforms")

DEVICE_ALIASES = {"ascend": "npu", "gpu": "cuda"}


def select_platform(device: str, registry: Registry) -> Platform:
    """The platform named by ``device``, or the available one with the highest priority for ``auto``.

    Raises ``ValueError`` naming the plugin to install when the device is unknown or absent.
    """
    specs: dict[str, PlatformSpec] = registry.platforms
    device = DEVICE_ALIASES.get(device, device)
    if device == "auto":
        available = [s for s in specs.values() if _probe(s)]
        if not available:
            raise ValueError("--device auto: no platform is available; install one, e.g. `pip install kiln-plugin-cpu`")
        spec = max(available, key=lambda s: s.priority)
    else:
        spec = specs.get(device)
        hint = PLATFORM_PLUGINS.get(device)
        if spec is None:
            install = f"install it with `pip install {hint}`" if hint else "no known plugin provides it"
            known = ", ".join(sorted(specs)) or "none"
            raise ValueError(f"--device {device}: no platform {device!r} is installed ({install}); installed: {known}")
        if not _probe(spec):
            raise ValueError(
                f"--device {device}: the {device} platform is installed but no {device} device is available "
                f"on this machine (check drivers and visible devices, or use --device auto)"
            )
    platform = load_ref(spec.factory)
    platform = platform() if isinstance(platform, type) else platform
    logger.info("using platform %s", platform.name)
    return platform


def _probe(spec: PlatformSpec) -> bool:
    try:
        return bool(spec.is_available())
    except Exception as exc:  # a probe that crashes means "not available", with a reason in the log
        logger.warning("platform %s probe failed: %s", spec.name, exc)
        return False
