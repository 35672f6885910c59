"""Device platforms: the interface plugins implement, and selection by ``--device``."""

from kiln.platforms.base import GraphRunner, Platform, PlatformSpec

__all__ = ["GraphRunner", "Platform", "PlatformSpec"]
