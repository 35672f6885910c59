"""The reference attention backend: plain torch, one request at a time.

Slow but obviously right; every other backend is tested against it.
"""

from __future__ import annotations

import torch

from kiln.interfaces.attention import (
    AttentionBackend,
    BatchLayout,
    attend_mask,
    attention,
    gather_kv,
    write_kv_cache,
)


class TorchRefAttentionBackend(AttentionBackend):
    name = "torch_ref"
    supports_sliding_window = True
    supports_logit_softcap = True

    def forward(
        self, q, k, v, kv_cache, metadata: BatchLayout, *, layer_idx, scale, sliding_window=None, logit_softcap=None
    ):
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.zeros_like(q)
        bs = metadata.block_size
        starts = metadata.query_start_loc.tolist()
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            q_start, q_end = starts[i], starts[i + 1]
            q_len = q_end - q_start
            context = seq_len - q_len
            num_blocks = -(-seq_len // bs)
            key, value = gather_kv(kv_cache, metadata.block_table[i, :num_blocks].long(), seq_len)
            # Query j (position context + j) sees keys 0..context + j (the last w of them with a window).
            q_pos = torch.arange(context, seq_len, device=q.device)
            mask = attend_mask(q_pos, torch.arange(seq_len, device=q.device), sliding_window)
            o = attention(
                q[q_start:q_end].transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), mask, scale, logit_softcap
            )
            out[q_start:q_end] = o.transpose(0, 1)
        return out
