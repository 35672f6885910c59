"""The reference attention backend: plain torch, one request at a time.

Slow but obviously right; every other backend is tested against it.
"""

from __future__ import annotations

from kiln.interfaces.attention import AttentionBackend, BatchLayout, paged_attention


class TorchRefAttentionBackend(AttentionBackend):
    name = "torch_ref"
    supports_sliding_window = True
    supports_logit_softcap = True

    def forward(
        self, q, k, v, kv_cache, metadata: BatchLayout, *, layer_idx, scale, sliding_window=None, logit_softcap=None
    ):
        return paged_attention(q, k, v, kv_cache, metadata, scale, sliding_window, logit_softcap)
