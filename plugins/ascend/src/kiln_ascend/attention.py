"""``AscendAttentionBackend``: torch_npu's fused attention over the paged cache.

* KV writes: ``torch_npu._npu_reshape_and_cache`` (padding slots, -1, are skipped).
* Decodes: ``npu_incre_flash_attention`` (IFA) reading K/V through ``block_table``; in graph
  mode (torchair) ATB's ``_npu_paged_attention``, whose sequence lengths are a tensor, so one
  compiled graph per gear serves every step (IFA takes them as a host list, which a graph
  compiled with static shapes would freeze).
* Prefills and chunks: ``npu_fused_infer_attention_score`` per request on its gathered K/V, with
  the right-down causal mode (``sparse_mode=3`` and the 2048x2048 mask), which also covers
  chunked prefill and prefix-cache hits (queries attend to the whole cached context).
Precision arguments come from ``kiln_ascend.precision``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.interfaces.attention import AttentionBackend, BatchLayout
from kiln_ascend.precision import PrecisionModes

RIGHT_DOWN_CAUSAL = 3
MASK_SIZE = 2048


@dataclass(slots=True)
class AscendMetadata:
    layout: BatchLayout
    slots: torch.Tensor  # int32, as the ATB op wants


@dataclass(slots=True)
class AscendGraphMetadata:
    """A padded pure-decode step inside a torchair graph: tensors only."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor  # int32
    slots: torch.Tensor  # int32


class AscendAttentionBackend(AttentionBackend):
    """Cache layout ``(2, blocks, block_size, kv_heads, head_dim)``: each plane is the
    ``(nb, bs, KVN, D)`` the torch_npu ops read (viewed as ``(nb, bs, KVN*D)`` for IFA)."""

    name = "ascend"
    supports_decode_graphs = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, dtype, cache_dtype)
        self.precision = PrecisionModes.from_env()
        self._mask: torch.Tensor | None = None

    @classmethod
    def supports(cls, *, head_dim: int, dtype: torch.dtype, block_size: int) -> bool:
        return block_size in (64, 128) and head_dim % 16 == 0 and head_dim <= 512

    def build_metadata(self, layout: BatchLayout) -> AscendMetadata:
        return AscendMetadata(layout, layout.slot_mapping.to(torch.int32))

    def graph_metadata(self, block_table, seq_lens, slot_mapping, block_size) -> AscendGraphMetadata:
        return AscendGraphMetadata(block_table, seq_lens, slot_mapping.to(torch.int32))

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.device != device:
            self._mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)
        return self._mask

    def forward(self, q, k, v, kv_cache, metadata: AscendMetadata | AscendGraphMetadata, *, layer_idx, scale):
        import torch_npu

        key_cache, value_cache = kv_cache[0], kv_cache[1]
        num_blocks, bs = key_cache.shape[:2]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        torch_npu._npu_reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache, metadata.slots)
        out = torch.empty_like(q)
        if isinstance(metadata, AscendGraphMetadata):
            torch_npu._npu_paged_attention(
                q.contiguous(), key_cache, value_cache, kv_heads, heads, scale,
                metadata.block_table, metadata.seq_lens, out,
            )  # fmt: skip
            return out
        layout = metadata.layout
        nd = layout.num_decode_reqs
        if nd:
            decoded = torch_npu.npu_incre_flash_attention(
                q[:nd].reshape(nd, 1, heads, dim),
                key_cache.view(num_blocks, bs, kv_heads * dim),
                value_cache.view(num_blocks, bs, kv_heads * dim),
                block_table=layout.block_table[:nd],
                actual_seq_lengths=layout.seq_lens_cpu[:nd],
                num_heads=heads,
                scale_value=scale,
                input_layout="BSND",
                num_key_value_heads=kv_heads,
                block_size=bs,
                inner_precise=self.precision.decode(),
            )
            out[:nd] = decoded.view(nd, heads, dim)
        starts = layout.query_start_loc.tolist()
        for i in range(nd, layout.num_reqs):
            seq_len, n = layout.seq_lens_cpu[i], layout.query_lens_cpu[i]
            blocks = layout.block_table[i, : -(-seq_len // bs)].long()
            keys = key_cache[blocks].flatten(0, 1)[:seq_len]
            values = value_cache[blocks].flatten(0, 1)[:seq_len]
            attended, _ = torch_npu.npu_fused_infer_attention_score(
                q[starts[i] : starts[i + 1]].unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                atten_mask=self.causal_mask(q.device),
                actual_seq_lengths=[n],
                actual_seq_lengths_kv=[seq_len],
                num_heads=heads,
                num_key_value_heads=kv_heads,
                scale=scale,
                input_layout="BSND",
                sparse_mode=RIGHT_DOWN_CAUSAL,
                inner_precise=self.precision.prefill(on_cached_prefix=seq_len > n),
            )
            out[starts[i] : starts[i + 1]] = attended[0]
        return out
