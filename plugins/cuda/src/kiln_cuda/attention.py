"""``TritonAttentionBackend``: paged attention for mixed prefill/decode batches in one Triton kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kiln.interfaces.attention import AttentionBackend, BatchLayout
from kiln_cuda import kernels

# Keys per inner-loop tile of the attention kernels.
TILE = 32
# Split-KV decode: slices per sequence (at most; a power of two), used while decodes x kv heads
# leave the GPU idle.
SPLITS = 8
SPLIT_KV_MAX_WORK = 128
# The kernels' window where a layer has none: wider than any position.
NO_WINDOW = 2**30
# Queries and keys per tile of the encoder kernel (tl.dot needs at least 16).
ENCODER_BLOCK = 32
# Rows of (query token, head) per program of the paged kernel: the query heads of one KV head for
# as many tokens of a request as fit (at least one token, and at least 16 rows for tl.dot).
QUERY_ROWS = 32


@dataclass(slots=True)
class TritonMetadata:
    slot_mapping: torch.Tensor  # (tokens,) int64, -1 = padding
    block_table: torch.Tensor  # (reqs, max_blocks) int32
    token_pos: torch.Tensor  # (tokens,) int32: each query token's absolute position (its KV length - 1)
    # The paged kernel's query tiles: runs of up to QUERY_ROWS // GROUP tokens of one request (at least one).
    tile_seq: torch.Tensor  # (tiles,) int32: the request
    tile_first: torch.Tensor  # (tiles,) int32: its first token
    tile_len: torch.Tensor  # (tiles,) int32: how many tokens
    block_size: int
    all_decode: bool  # one query token per request
    # Split-KV decode's slices per sequence: no more than give each a tile of keys (eager batches,
    # whose longest sequence is known), SPLITS under a decode graph (its grid is fixed).
    splits: int = SPLITS


class TritonAttentionBackend(AttentionBackend):
    """Cache layout ``(2, blocks, block_size, kv_heads, head_dim)`` (the reference's)."""

    name = "triton"
    supports_decode_graphs = True
    supports_sliding_window = True
    supports_logit_softcap = True
    cache_dtypes = (torch.float8_e4m3fn, torch.float8_e5m2)

    @classmethod
    def supports(cls, *, head_dim: int, dtype: torch.dtype, block_size: int) -> bool:
        return head_dim % 16 == 0 and block_size % 16 == 0

    @property
    def _group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def _block_m(self) -> int:
        return max(QUERY_ROWS, triton.next_power_of_2(self._group))

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        device = layout.slot_mapping.device
        query_lens = torch.tensor(layout.query_lens_cpu, device=device)
        token_seq = torch.repeat_interleave(torch.arange(layout.num_reqs, device=device), query_lens)
        starts = layout.query_start_loc[:-1].long()
        offset = torch.arange(layout.num_tokens, device=device) - starts[token_seq]
        token_pos = layout.context_lens.long()[token_seq] + offset
        # Tiles on the host, from the query lengths it already has: request, first token, length.
        per_tile = self._block_m // self._group
        tiles, first = [], 0
        for req, n in enumerate(layout.query_lens_cpu):
            tiles += [(req, first + i, min(per_tile, n - i)) for i in range(0, n, per_tile)]
            first += n
        tile_seq, tile_first, tile_len = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).T.contiguous().to(device)
        return TritonMetadata(
            layout.slot_mapping, layout.block_table, token_pos.to(torch.int32), tile_seq,
            tile_first, tile_len, layout.block_size, layout.num_decode_reqs == layout.num_reqs,
            min(SPLITS, triton.next_power_of_2(max(1, triton.cdiv(layout.max_seq_len, TILE)))),
        )  # fmt: skip

    def graph_metadata(self, block_table, seq_lens, slot_mapping, block_size) -> TritonMetadata:
        # The kernels' grids depend only on the token count, fixed per graph size: a tile per decode.
        ids = torch.arange(seq_lens.shape[0], dtype=torch.int32, device=seq_lens.device)
        return TritonMetadata(slot_mapping, block_table, seq_lens - 1, ids, ids, torch.ones_like(ids), block_size, True)

    def forward(
        self, q, k, v, kv_cache, metadata: TritonMetadata, *, layer_idx, scale, sliding_window=None, logit_softcap=None
    ):
        tokens = q.shape[0]
        block_d = triton.next_power_of_2(self.head_dim)
        if tokens:
            block_h = triton.next_power_of_2(self.num_kv_heads)
            per = kernels.rows_per_program(block_h * block_d)
            kernels.reshape_and_cache_kernel[(triton.cdiv(tokens, per),)](
                k, v, kv_cache, metadata.slot_mapping, tokens, k.stride(0), v.stride(0), kv_cache.stride(0),
                1.0 / self.k_scale, 1.0 / self.v_scale,
                KVN=self.num_kv_heads, BLOCK_H=block_h, D=self.head_dim, BLOCK_D=block_d, TOKENS=per,
            )  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if tokens:
            self._attend(q, kv_cache, out, metadata, scale * self.k_scale, sliding_window, logit_softcap)
        if self.v_scale != 1.0:  # scores are of stored keys (k_scale above), the output of stored values
            out.mul_(self.v_scale)
        return out

    def _attend(self, q, kv_cache, out, metadata: TritonMetadata, scale, sliding_window, logit_softcap) -> None:
        """One launch of the paged kernel over the metadata's query tiles. Small decode batches split each
        sequence's keys into ``metadata.splits`` slices (flash-decoding), combined by a second launch."""
        tokens, heads = q.shape[0], self.num_heads
        split = metadata.all_decode and metadata.splits > 1 and tokens * self.num_kv_heads <= SPLIT_KV_MAX_WORK
        splits = metadata.splits if split else 1
        block_d = triton.next_power_of_2(self.head_dim)
        parts = [out] * 3  # unused without slices
        if split:
            part_max = torch.empty(tokens, heads, splits, dtype=torch.float32, device=q.device)
            parts = [torch.empty(*part_max.shape, block_d, dtype=torch.float32, device=q.device), part_max,
                     torch.empty_like(part_max)]  # fmt: skip
        kernels.paged_attention_kernel[(metadata.tile_seq.shape[0], self.num_kv_heads, splits)](
            q, kv_cache, out, *parts, metadata.tile_seq, metadata.tile_first, metadata.tile_len, metadata.token_pos,
            metadata.block_table, metadata.block_table.stride(0), q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), kv_cache.stride(0), scale, sliding_window or NO_WINDOW, logit_softcap or 0.0,
            H=heads, KVN=self.num_kv_heads, GROUP=self._group, D=self.head_dim, BLOCK_D=block_d,
            BLOCK_M=self._block_m, BS=metadata.block_size, TILE=TILE, SPLITS=splits, SOFTCAP=bool(logit_softcap),
        )  # fmt: skip
        if split:
            kernels.reduce_splits_kernel[(tokens, heads)](
                *parts, out, out.stride(0), out.stride(1), H=heads, D=self.head_dim, BLOCK_D=block_d, SPLITS=splits
            )

    def forward_encoder(self, q, k, v, layout: BatchLayout, *, scale):
        """Bidirectional attention within each sequence, in one launch (``encoder_attention_kernel``)."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if layout.num_tokens:
            grid = (layout.num_reqs, self.num_heads, triton.cdiv(layout.max_query_len, ENCODER_BLOCK))
            kernels.encoder_attention_kernel[grid](
                q, k, v, out, layout.query_start_loc, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                v.stride(0), v.stride(1), out.stride(0), out.stride(1), scale,
                GROUP=self._group, D=self.head_dim,
                BLOCK_D=triton.next_power_of_2(self.head_dim), BLOCK_M=ENCODER_BLOCK, BLOCK_N=ENCODER_BLOCK,
            )  # fmt: skip
        return out
