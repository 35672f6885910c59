"""Old import path, kept for plugins written before ``kiln.interfaces``: the platform
interface now lives in ``kiln.interfaces.platform`` and its spec in ``kiln.registry``."""

from kiln.interfaces.platform import GraphRunner, Platform, measure_peak_memory
from kiln.registry import LazyRef, PlatformSpec

__all__ = ["GraphRunner", "LazyRef", "Platform", "PlatformSpec", "measure_peak_memory"]
