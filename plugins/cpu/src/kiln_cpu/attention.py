"""CPU attention over the paged cache.

The cache is head-major: (2, blocks, kv_heads, block_size, head_dim), so one
head's keys in one block are a contiguous run that the decode kernel streams
through and that gathers turn straight into SDPA's (heads, len, dim) shape.

* Decodes (one query token each), fp32 or bf16 cache: one call per layer into the
  C kernel of ``csrc/paged_attention.h``, which reads K/V in place through the
  block table. ``--kv-cache-dtype bfloat16`` stores an fp32 model's K/V in bf16
  (half the memory; values rounded once when written), computing in fp32.
* ``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``: K/V stored in a byte each (a quarter of
  an fp32 cache) at scale 1, as the engine sets no other, written through torch (its rounding);
  an fp32 model's decodes on an e5m2 cache run the C kernel (a byte widens to fp16 by a shift),
  everything else on fp8 the torch paths below.
* Decodes otherwise (fp16, e4m3 cache, odd shapes, or no C compiler): one batched SDPA call per
  layer over blocks gathered into a padded (reqs, kv_heads, len, dim) tensor,
  with a key-padding mask. GQA needs no K/V copies: the query heads sharing a KV
  head become that head's "query length".
* Prefills and prefill chunks of a bf16 model with a bf16 cache, on CPUs with
  AVX512-BF16: one call per layer into ``csrc/prefill_attention.c``, which reads
  K/V from the cache (five times torch's flash kernel on 32 prompts of 128 tokens);
  of an fp32 model, ``csrc/prefill_attention_f32.c``, which reads the prompt's own
  K/V unrounded from the step's rows and a cached prefix from the fp32 or bf16
  cache (3-10 times torch's kernel: its per-call cost on short prompts, its masked
  path on cached prefixes).
* Prefills otherwise with nothing cached use the new K/V directly (causal SDPA);
  chunks that continue a cached prefix gather their context from the cache.
* A sliding window (Mistral, some Qwen layers) masks keys more than ``w - 1``
  positions back; the C kernel and cached-prefix chunks skip blocks wholly
  before the window. Blocks are never freed for it: the cache holds every token.
* Gemma 2's soft cap (``logit_softcap``): the C kernels cap each score as they compute it; a
  step that any torch path above would run (no kernel for its shapes or dtypes) takes the
  reference computation whole instead, as every capped step did before the kernels had it.
* Encoder steps (``forward_encoder``, BERT-style models): one SDPA call over the sequences
  padded to the longest, keys past each one's end masked, unless padding would more than
  double the work; then the base class's call per sequence. (One batched call ran twice as
  fast as 32 calls of 128 tokens here.) The C kernels are for paged steps only.

The fp32 prefill kernel reads a chunk's own K/V from the step's rows, so under a bf16 cache
they are attended unrounded; the torch path reads a cached-prefix chunk's own K/V back from
the cache, rounded (the two agree wherever K/V are bf16 values, as in the contract tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kiln.interfaces.attention import (
    AttentionBackend,
    BatchLayout,
    attend_mask,
    padded_rows,
    paged_attention,
    window_start,
)
from kiln_cpu import native


@dataclass(slots=True)
class CpuMetadata:
    layout: BatchLayout
    decode_blocks: torch.Tensor | None  # (num_decodes, max_blocks) int64
    prefills: list[tuple[int, int, int, int, torch.Tensor]]  # q_start, q_end, context, seq_len, block ids
    prefill_seqs: torch.Tensor | None = None  # (prefills, 4) int64 for the native prefill kernels
    # Torch decode path: (num_decodes, 1, 1, max_len) bool, True = attend, per sliding window.
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    c_step: object = None  # a decode-only step's arguments for csrc/decode_layer.c (kiln_cpu.fused_decode)

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """Built once per step for each window the model's layers use."""
        mask = self.decode_masks.get(sliding_window)
        if mask is None:
            nd, width = self.decode_blocks.shape
            last = self.layout.seq_lens[:nd].cpu() - 1  # each decode's query position
            keys = torch.arange(width * self.layout.block_size)
            mask = self.decode_masks[sliding_window] = attend_mask(last, keys, sliding_window).view(nd, 1, 1, -1)
        return mask


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    cache_dtypes = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    supports_sliding_window = True
    supports_logit_softcap = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        self.native = native.load_kernels() if native.supports(*shape, self.dtype, self.cache_dtype) else None
        self.native_prefill = native.supports_prefill(*shape, self.dtype, self.cache_dtype)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, self.num_kv_heads, block_size, self.head_dim)

    def reference_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        return kv_cache.transpose(2, 3)

    def build_metadata(self, layout: BatchLayout) -> CpuMetadata:
        nd, bs = layout.num_decode_reqs, layout.block_size
        decode_blocks = None
        if nd:
            width = -(-max(layout.seq_lens_cpu[:nd]) // bs)
            decode_blocks = layout.block_table[:nd, :width].long()
        starts = layout.query_start_loc.tolist()
        prefills = []
        for i in range(nd, layout.num_reqs):
            seq_len = layout.seq_lens_cpu[i]
            context = seq_len - layout.query_lens_cpu[i]
            blocks = layout.block_table[i, : -(-seq_len // bs)].long() if context else None
            prefills.append((starts[i], starts[i + 1], context, seq_len, blocks))
        seqs = None
        if self.native_prefill and prefills:
            rows = [
                (q_start, q_end - q_start, context, nd + i) for i, (q_start, q_end, context, *_) in enumerate(prefills)
            ]
            seqs = torch.tensor(rows, dtype=torch.int64)
        return CpuMetadata(layout, decode_blocks, prefills, seqs)

    def forward(
        self, q, k, v, kv_cache, metadata: CpuMetadata, *, layer_idx, scale, sliding_window=None, logit_softcap=None
    ):
        if self.k_scale != 1.0 or self.v_scale != 1.0:
            raise NotImplementedError("the CPU attention stores K/V at scale 1 (no calibrated KV-cache scales)")
        if logit_softcap is not None and not self._native_caps(metadata):  # the torch paths have no soft cap
            return paged_attention(q, k, v, self.reference_view(kv_cache), metadata.layout, scale, sliding_window,
                                   logit_softcap)  # fmt: skip
        self._write(k, v, kv_cache, metadata.layout)
        out = torch.empty_like(q)
        if metadata.decode_blocks is not None:
            nd = metadata.decode_blocks.shape[0]
            if self.native is not None:
                layout = metadata.layout
                native.paged_decode_attention(
                    out[:nd], q[:nd], kv_cache[0], kv_cache[1], layout.block_table[:nd], layout.seq_lens[:nd], scale,
                    sliding_window, logit_softcap,
                )  # fmt: skip
            else:
                out[:nd] = self._decode(q[:nd], kv_cache, metadata, scale, sliding_window)
        if metadata.prefill_seqs is not None:
            layout = metadata.layout
            native.prefill_attention(
                out, q, k, v, kv_cache, layout.block_table, metadata.prefill_seqs, scale, sliding_window, logit_softcap
            )
            return out
        bs = metadata.layout.block_size
        for q_start, q_end, context, seq_len, blocks in metadata.prefills:
            # NOTE: 4-D inputs take torch's CPU flash kernel; 3-D ones fall back to the
            # (several times slower) math path.
            qi = q[q_start:q_end].transpose(0, 1)
            q_pos = torch.arange(context, seq_len)
            if context == 0:
                key, value, k_pos = k[q_start:q_end].transpose(0, 1), v[q_start:q_end].transpose(0, 1), q_pos
            else:
                skip = window_start(context, sliding_window) // bs  # blocks wholly before every query's window
                kv = kv_cache[:, blocks[skip:]].transpose(1, 2).flatten(2, 3)[:, :, : seq_len - skip * bs]
                key, value = kv[0].to(q.dtype), kv[1].to(q.dtype)  # (heads, len, dim)
                k_pos = torch.arange(skip * bs, seq_len)
            causal = context == 0 and sliding_window is None
            mask = None if causal else attend_mask(q_pos, k_pos, sliding_window)
            o = F.scaled_dot_product_attention(
                qi[None], key[None], value[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )
            out[q_start:q_end] = o[0].transpose(0, 1)
        return out

    def _native_caps(self, metadata: CpuMetadata) -> bool:
        """Whether the C kernels run every part of this step, so that they can soft-cap its scores."""
        decodes_ok = metadata.decode_blocks is None or self.native is not None
        return decodes_ok and (not metadata.prefills or metadata.prefill_seqs is not None)

    def forward_encoder(self, q, k, v, layout: BatchLayout, *, scale):
        lens, width = layout.query_lens_cpu, layout.max_query_len
        if len(lens) * width * width > 2 * sum(n * n for n in lens):
            return super().forward_encoder(q, k, v, layout, scale=scale)
        rows, mask = None, None
        if any(n != width for n in lens):
            rows = padded_rows(lens, width, q.device)
            mask = (torch.arange(width) < torch.tensor(lens)[:, None]).view(len(lens), 1, 1, width)

        def batch(x: torch.Tensor) -> torch.Tensor:  # (tokens, heads, dim) -> (seqs, heads, width, dim)
            if rows is not None:
                x = x.new_zeros(len(lens) * width, *x.shape[1:]).index_copy_(0, rows, x)
            return x.unflatten(0, (len(lens), width)).transpose(1, 2)

        o = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), attn_mask=mask, scale=scale, enable_gqa=True)
        o = o.transpose(1, 2).flatten(0, 1)
        return o if rows is None else o[rows]

    def _decode(self, q, kv_cache, metadata: CpuMetadata, scale, sliding_window):
        nd = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        kv = kv_cache[:, metadata.decode_blocks].transpose(2, 3).flatten(3, 4)  # (2, nd, hkv, len, d)
        key, value = kv[0].to(q.dtype), kv[1].to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.view(nd, hkv, group, d), key, value, attn_mask=metadata.decode_mask(sliding_window), scale=scale
        )
        return o.reshape(nd, self.num_heads, d)

    def _write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layout: BatchLayout) -> None:
        slots = layout.slot_mapping
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)  # rounded once, where the cache is narrower
        if (
            self.native is not None
            and kv_cache.dtype in native.KV_WRITERS
            and k.stride(1) == v.stride(1) == self.head_dim
        ):
            native.write_kv_cache(kv_cache, k, v, slots, layout.block_size)
            return
        keep = slots >= 0
        if not bool(keep.all()):
            k, v, slots = k[keep], v[keep], slots[keep]
        bs, heads = layout.block_size, self.num_kv_heads
        # Row of (block, head, offset) in the cache seen as (blocks * heads * block_size, dim).
        rows = ((slots // bs * heads)[:, None] + torch.arange(heads)) * bs + (slots % bs)[:, None]
        flat = kv_cache.view(2, -1, self.head_dim)
        if flat.element_size() == 1:  # index_copy_ has no fp8 kernel on the CPU: copy the bytes
            flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        flat[0].index_copy_(0, rows.flatten(), k.reshape(-1, self.head_dim))
        flat[1].index_copy_(0, rows.flatten(), v.reshape(-1, self.head_dim))
