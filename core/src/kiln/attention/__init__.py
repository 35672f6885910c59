"""Attention over the paged KV cache: the backend interface and the torch reference."""

from kiln.attention.base import AttentionBackend, AttentionBackendSpec, BatchLayout

__all__ = ["AttentionBackend", "AttentionBackendSpec", "BatchLayout"]
