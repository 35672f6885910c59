"""CPU attention over the paged cache with batched ``scaled_dot_product_attention``.

* Decodes (one query token each) run as one SDPA call per layer: their blocks are
  gathered into a padded (reqs, kv_heads, len, dim) tensor and a key-padding mask
  hides the tail. GQA needs no K/V copies: the query heads sharing a KV head
  become that head's "query length".
* Prefills with nothing cached use the new K/V directly (causal SDPA); chunks
  that continue a cached prefix gather their context from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.attention.base import AttentionBackend, BatchLayout, gather_kv, write_kv_cache


@dataclass(slots=True)
class CpuMetadata:
    layout: BatchLayout
    decode_blocks: torch.Tensor | None  # (num_decodes, max_blocks) int64
    decode_mask: torch.Tensor | None  # (num_decodes, 1, 1, max_len) bool, True = attend
    prefills: list[tuple[int, int, int, int, torch.Tensor]]  # q_start, q_end, context, seq_len, block ids


class CpuSdpaBackend(AttentionBackend):
    name = "cpu_sdpa"

    def build_metadata(self, layout: BatchLayout) -> CpuMetadata:
        nd, bs = layout.num_decode_reqs, layout.block_size
        decode_blocks = decode_mask = None
        if nd:
            lens = layout.seq_lens_cpu[:nd]
            max_len = max(lens)
            width = -(-max_len // bs)
            decode_blocks = layout.block_table[:nd, :width].long()
            decode_mask = (torch.arange(width * bs) < layout.seq_lens[:nd, None].cpu()).view(nd, 1, 1, -1)
        starts = layout.query_start_loc.tolist()
        prefills = []
        for i in range(nd, layout.num_reqs):
            seq_len = layout.seq_lens_cpu[i]
            context = seq_len - layout.query_lens_cpu[i]
            blocks = layout.block_table[i, : -(-seq_len // bs)].long() if context else None
            prefills.append((starts[i], starts[i + 1], context, seq_len, blocks))
        return CpuMetadata(layout, decode_blocks, decode_mask, prefills)

    def forward(self, q, k, v, kv_cache, metadata: CpuMetadata, *, layer_idx, scale):
        write_kv_cache(k, v, kv_cache, metadata.layout.slot_mapping)
        out = torch.empty_like(q)
        if metadata.decode_blocks is not None:
            nd = metadata.decode_blocks.shape[0]
            out[:nd] = self._decode(q[:nd], kv_cache, metadata, scale)
        for q_start, q_end, context, seq_len, blocks in metadata.prefills:
            qi = q[q_start:q_end].transpose(0, 1)
            if context == 0:
                o = F.scaled_dot_product_attention(
                    qi, k[q_start:q_end].transpose(0, 1), v[q_start:q_end].transpose(0, 1),
                    is_causal=True, scale=scale, enable_gqa=True,
                )
            else:
                key, value = gather_kv(kv_cache, blocks, seq_len)
                mask = torch.arange(seq_len)[None, :] <= torch.arange(context, seq_len)[:, None]
                o = F.scaled_dot_product_attention(
                    qi, key.transpose(0, 1), value.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
                )
            out[q_start:q_end] = o.transpose(0, 1)
        return out

    def _decode(self, q, kv_cache, metadata: CpuMetadata, scale):
        nd = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        kv = kv_cache[:, metadata.decode_blocks]  # (2, nd, blocks, block_size, hkv, d)
        key = kv[0].flatten(1, 2).transpose(1, 2)  # (nd, hkv, len, d)
        value = kv[1].flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.view(nd, hkv, group, d), key, value, attn_mask=metadata.decode_mask, scale=scale
        )
        return o.reshape(nd, self.num_heads, d)
