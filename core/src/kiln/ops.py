"""Old import path, kept for plugins written before ``kiln.interfaces``: the reference ops
now live in ``kiln.interfaces.model``."""

from kiln.interfaces.model import (
    REFERENCE_OPS,
    fused_add_rms_norm,
    resolve_ops,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)

__all__ = ["REFERENCE_OPS", "fused_add_rms_norm", "resolve_ops", "rms_norm", "rotary_embedding", "silu_and_mul"]
