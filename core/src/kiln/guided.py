"""Old import path, kept for plugins written before ``kiln.interfaces``: the guided-decoding
interface now lives in ``kiln.interfaces.guided``, the engine's manager in
``kiln.engine.guided_manager``."""

from kiln.engine.guided_manager import GuidedManager
from kiln.interfaces.guided import (
    KINDS,
    CompiledGuide,
    GuidedBackend,
    GuidedDecodingParams,
    GuideMatcher,
    UnsupportedConstraint,
    allocate_bitmask,
    apply_token_bitmask,
)

__all__ = [
    "KINDS",
    "CompiledGuide",
    "GuidedBackend",
    "GuidedDecodingParams",
    "GuideMatcher",
    "GuidedManager",
    "UnsupportedConstraint",
    "allocate_bitmask",
    "apply_token_bitmask",
]
