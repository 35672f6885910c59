"""Old import path, kept for plugins written before ``kiln.interfaces``: the attention
interface now lives in ``kiln.interfaces.attention`` and its spec in ``kiln.registry``."""

from kiln.interfaces.attention import (
    AttentionBackend,
    BatchLayout,
    DecodeGraphInputs,
    gather_kv,
    write_kv_cache,
)
from kiln.registry import AttentionBackendSpec

__all__ = [
    "AttentionBackend",
    "AttentionBackendSpec",
    "BatchLayout",
    "DecodeGraphInputs",
    "gather_kv",
    "write_kv_cache",
]
