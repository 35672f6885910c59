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
    seq_lens: torch.Tensor  # (reqs,) int32
    token_pos: torch.Tensor  # (tokens,) int32: each query token's absolute position (its KV length - 1)
    # The paged kernel's query tiles: runs of up to ``tile_tokens`` tokens of one request.
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
    def _block_m(self) -> int:
        return max(QUERY_ROWS, triton.next_power_of_2(self.num_heads // self.num_kv_heads))

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        device = layout.slot_mapping.device
        query_lens = torch.tensor(layout.query_lens_cpu, device=device)
        token_seq = torch.repeat_interleave(torch.arange(layout.num_reqs, device=device), query_lens)
        starts = layout.query_start_loc[:-1].long()
        offset = torch.arange(layout.num_tokens, device=device) - starts[token_seq]
        token_pos = layout.context_lens.long()[token_seq] + offset
        # Tiles on the host, from the query lengths it already has: request, first token, length.
        per_tile = self._block_m // (self.num_heads // self.num_kv_heads)
        tiles, first = [], 0
        for req, n in enumerate(layout.query_lens_cpu):
            tiles += [(req, first + i, min(per_tile, n - i)) for i in range(0, n, per_tile)]
            first += n
        tile_seq, tile_first, tile_len = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).T.contiguous().to(device)
        return TritonMetadata(
            layout.slot_mapping, layout.block_table, layout.seq_lens, token_pos.to(torch.int32), tile_seq,
            tile_first, tile_len, layout.block_size, layout.num_decode_reqs == layout.num_reqs,
            min(SPLITS, triton.next_power_of_2(max(1, triton.cdiv(layout.max_seq_len, TILE)))),
        )  # fmt: skip

    def graph_metadata(self, block_table, seq_lens, slot_mapping, block_size) -> TritonMetadata:
        # The kernels' grids depend only on the token count, fixed per graph size: a tile per decode.
        ids = torch.arange(seq_lens.shape[0], dtype=torch.int32, device=seq_lens.device)
        return TritonMetadata(
            slot_mapping, block_table, seq_lens, seq_lens - 1, ids, ids, torch.ones_like(ids), block_size, True
        )

    def forward(
        self, q, k, v, kv_cache, metadata: TritonMetadata, *, layer_idx, scale, sliding_window=None, logit_softcap=None
    ):
        tokens = q.shape[0]
        block_d = triton.next_power_of_2(self.head_dim)
        if tokens:
            kernels.reshape_and_cache_kernel[(tokens, self.num_kv_heads)](
                k, v, kv_cache, metadata.slot_mapping, k.stride(0), v.stride(0), kv_cache.stride(0),
                1.0 / self.k_scale, 1.0 / self.v_scale, KVN=self.num_kv_heads, D=self.head_dim, BLOCK_D=block_d,
            )  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        scale = scale * self.k_scale  # scores of stored keys; v_scale applies to the output below
        window = sliding_window or NO_WINDOW
        cap = dict(softcap=logit_softcap or 0.0, SOFTCAP=bool(logit_softcap))
        if tokens and metadata.all_decode and tokens * self.num_kv_heads <= SPLIT_KV_MAX_WORK:
            self._split_kv_decode(q, kv_cache, out, metadata, scale, window, block_d, cap)
        elif tokens:
            kernels.paged_attention_kernel[(metadata.tile_seq.shape[0], self.num_kv_heads)](
                q, kv_cache, out, metadata.tile_seq, metadata.tile_first, metadata.tile_len, metadata.token_pos,
                metadata.block_table, metadata.block_table.stride(0), q.stride(0), q.stride(1), out.stride(0),
                out.stride(1), kv_cache.stride(0), scale, window,
                KVN=self.num_kv_heads, GROUP=self.num_heads // self.num_kv_heads, D=self.head_dim,
                BLOCK_D=block_d, BLOCK_M=self._block_m, BS=metadata.block_size, TILE=TILE, **cap,
            )  # fmt: skip
        if self.v_scale != 1.0:
            out.mul_(self.v_scale)
        return out

    def forward_encoder(self, q, k, v, layout: BatchLayout, *, scale):
        """Bidirectional attention within each sequence, in one launch (``encoder_attention_kernel``)."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if layout.num_tokens:
            grid = (layout.num_reqs, self.num_heads, triton.cdiv(layout.max_query_len, ENCODER_BLOCK))
            kernels.encoder_attention_kernel[grid](
                q, k, v, out, layout.query_start_loc, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                v.stride(0), v.stride(1), out.stride(0), out.stride(1), scale,
                GROUP=self.num_heads // self.num_kv_heads, D=self.head_dim,
                BLOCK_D=triton.next_power_of_2(self.head_dim), BLOCK_M=ENCODER_BLOCK, BLOCK_N=ENCODER_BLOCK,
            )  # fmt: skip
        return out

    def _split_kv_decode(
        self, q, kv_cache, out, metadata: TritonMetadata, scale: float, window: int, block_d: int, cap: dict
    ) -> None:
        """Flash-decoding for small decode batches: one program per (decode, KV head, slice), then a reduction."""
        tokens, heads, splits = q.shape[0], self.num_heads, metadata.splits
        group = heads // self.num_kv_heads
        part_acc = torch.empty(tokens, heads, splits, block_d, dtype=torch.float32, device=q.device)
        part_max = torch.empty(tokens, heads, splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        kernels.paged_decode_split_kernel[(tokens, self.num_kv_heads, splits)](
            q, kv_cache, metadata.seq_lens, metadata.block_table, part_acc, part_max, part_sum,
            metadata.block_table.stride(0), q.stride(0), q.stride(1), kv_cache.stride(0), scale, window,
            H=heads, KVN=self.num_kv_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
            D=self.head_dim, BLOCK_D=block_d, BS=metadata.block_size, TILE=TILE, SPLITS=splits, **cap,
        )  # fmt: skip
        kernels.reduce_splits_kernel[(tokens, heads)](
            part_acc, part_max, part_sum, out, out.stride(0), out.stride(1),
            H=heads, D=self.head_dim, BLOCK_D=block_d, SPLITS=splits,
        )  # fmt: skip
