"""``AscendAttentionBackend``: torch_npu's fused attention over the paged cache.

* KV writes: ``torch_npu._npu_reshape_and_cache`` (padding slots, -1, are skipped).
* Decodes: ``npu_incre_flash_attention`` (IFA) reading K/V through ``block_table``; in graph
  mode (torchair) ATB's ``_npu_paged_attention``, whose sequence lengths are a tensor, so one
  compiled graph per gear serves every step (IFA takes them as a host list, which a graph
  compiled with static shapes would freeze).
* Prefills and chunks: ``npu_fused_infer_attention_score`` per request on its gathered K/V, with
  the right-down causal mode (``sparse_mode=3`` and the 2048x2048 mask), which also covers
  chunked prefill and prefix-cache hits (queries attend to the whole cached context).
* Sliding windows (no op above takes one for paged decodes: IFA has no band, ATB's paged op no
  mask): decodes read a compact copy of each request's last ``w`` keys, left-aligned in blocks
  of their own (``window_cache``), through the same ops, so the graph path stays tensors-only;
  prefills pass FIA an explicit banded ``(Sq, Skv)`` mask (``sparse_mode=0``) over K/V gathered
  from the first block any query's window reaches. Out-of-window blocks are never freed.
* Encoder steps (``forward_encoder``): FIA with no mask over the sequences padded into one batch.
* Soft-capped scores (Gemma 2's ``logit_softcap``; no torch_npu attention op takes a cap): plain
  torch ops on the same cache, ``kiln.interfaces.attention``'s reference per request when eager,
  and in graphs one padded batch over each request's blocks (``capped_decode``).
Precision arguments come from ``kiln_ascend.precision``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.interfaces.attention import (
    AttentionBackend,
    BatchLayout,
    attend_mask,
    padded_rows,
    paged_attention,
    window_start,
)
from kiln_ascend.precision import PrecisionModes

FULL_MASK = 0  # sparse_mode 0: the (Sq, Skv) atten_mask as given
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
    supports_sliding_window = True
    supports_logit_softcap = True

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
        self._encoder_index: tuple[BatchLayout, torch.Tensor, int] | None = None  # see _encoder_rows

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

    def forward(
        self, q, k, v, kv_cache, metadata: AscendMetadata | AscendGraphMetadata, *, layer_idx, scale,
        sliding_window=None, logit_softcap=None,
    ):  # fmt: skip
        import torch_npu

        if logit_softcap is not None and isinstance(metadata, AscendMetadata):
            # the reference's writes are plain indexing too: one pass of torch ops per request
            return paged_attention(q, k, v, kv_cache, metadata.layout, scale, sliding_window, logit_softcap)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        bs = key_cache.shape[1]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        torch_npu._npu_reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache, metadata.slots)
        if logit_softcap is not None:
            return capped_decode(q, kv_cache, metadata, scale, sliding_window, logit_softcap)
        out = torch.empty_like(q)
        if isinstance(metadata, AscendGraphMetadata):
            keys, values, table, lens = key_cache, value_cache, metadata.block_table, metadata.seq_lens
            if sliding_window is not None:
                keys, values, table, lens = window_cache(keys, values, table, lens, sliding_window)
            torch_npu._npu_paged_attention(q.contiguous(), keys, values, kv_heads, heads, scale, table, lens, out)
            return out
        layout = metadata.layout
        nd = layout.num_decode_reqs
        if nd:
            decode_keys, decode_values, table = key_cache, value_cache, layout.block_table[:nd]
            lens = layout.seq_lens_cpu[:nd]
            if sliding_window is not None:
                decode_keys, decode_values, table, _ = window_cache(
                    key_cache, value_cache, table, layout.seq_lens[:nd], sliding_window
                )
                lens = [min(s, sliding_window) for s in lens]
            decoded = torch_npu.npu_incre_flash_attention(
                q[:nd].reshape(nd, 1, heads, dim),
                decode_keys.flatten(2),  # (blocks, bs, kv_heads * dim)
                decode_values.flatten(2),
                block_table=table,
                actual_seq_lengths=lens,
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
            first = window_start(seq_len - n, sliding_window) // bs  # the first block any query's window reaches
            blocks = layout.block_table[i, first : -(-seq_len // bs)].long()
            kv_len = seq_len - first * bs
            keys = key_cache[blocks].flatten(0, 1)[:kv_len]
            values = value_cache[blocks].flatten(0, 1)[:kv_len]
            if sliding_window is None:
                mask, mode = self.causal_mask(q.device), RIGHT_DOWN_CAUSAL
            else:
                q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
                k_pos = torch.arange(first * bs, seq_len, device=q.device)
                mask, mode = ~attend_mask(q_pos, k_pos, sliding_window), FULL_MASK
            attended, _ = torch_npu.npu_fused_infer_attention_score(
                q[starts[i] : starts[i + 1]].unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                atten_mask=mask,
                actual_seq_lengths=[n],
                actual_seq_lengths_kv=[kv_len],
                num_heads=heads,
                num_key_value_heads=kv_heads,
                scale=scale,
                input_layout="BSND",
                sparse_mode=mode,
                inner_precise=self.precision.prefill(on_cached_prefix=seq_len > n),
            )
            out[starts[i] : starts[i + 1]] = attended[0]
        return out

    def forward_encoder(self, q, k, v, layout: BatchLayout, *, scale):
        """FIA with no mask (``sparse_mode=0``) over the step's sequences padded into one
        ``(B, S)`` BSND batch: the query rows of batch b see its ``actual_seq_lengths_kv[b]`` keys,
        all of them. One op call per layer, whatever the number of sequences."""
        import torch_npu

        rows, width = self._encoder_rows(layout)

        def padded(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros(layout.num_reqs * width, *x.shape[1:])
            out[rows] = x
            return out.view(layout.num_reqs, width, *x.shape[1:])

        lens = layout.query_lens_cpu
        attended, _ = torch_npu.npu_fused_infer_attention_score(
            padded(q),
            padded(k),
            padded(v),
            actual_seq_lengths=lens,
            actual_seq_lengths_kv=lens,
            num_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            scale=scale,
            input_layout="BSND",
            sparse_mode=FULL_MASK,
            inner_precise=self.precision.prefill(on_cached_prefix=False),
        )
        return attended.flatten(0, 1)[rows]

    def _encoder_rows(self, layout: BatchLayout) -> tuple[torch.Tensor, int]:
        """Each token's row in the padded batch, and the padded length; built once per step.
        NOTE: at least 2 wide: FIA with one query row per batch takes its IFA (decode) branch."""
        if self._encoder_index is None or self._encoder_index[0] is not layout:
            width = max(layout.max_query_len, 2)
            index = padded_rows(layout.query_lens_cpu, width, layout.query_start_loc.device)
            self._encoder_index = (layout, index, width)
        return self._encoder_index[1], self._encoder_index[2]


def capped_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AscendGraphMetadata,
    scale: float,
    window: int | None,
    cap: float,
) -> torch.Tensor:
    """A graph step's decodes with soft-capped scores, tensors only: every request's blocks
    gathered into one padded batch (under a window only its last ``window`` keys, through
    ``window_cache``), keys past its length masked out, each group of query heads multiplied
    with its key/value head as it is (no copy per query head)."""
    keys, values, table, lens = kv_cache[0], kv_cache[1], metadata.block_table, metadata.seq_lens
    if window is not None:
        keys, values, table, lens = window_cache(keys, values, table, lens, window)
    table, lens = table.long(), lens.long()
    reqs, kv_heads, dim = table.shape[0], keys.shape[2], keys.shape[3]
    keys, values = (c[table].flatten(1, 2).transpose(1, 2) for c in (keys, values))  # (reqs, kv_heads, len, dim)
    queries = q.view(reqs, kv_heads, -1, dim)  # query head h reads key/value head h // group
    scores = torch.tanh(queries @ keys.transpose(-1, -2) * scale / cap) * cap
    valid = torch.arange(keys.shape[2], device=q.device) < lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return (torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values).view(q.shape)


def window_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For decodes under a sliding window: each request's last ``min(seq_len, window)`` keys and
    values copied, left-aligned, into blocks of their own (request b owns blocks
    ``b * per_req ...``), with the block table and lengths (int32) to read them by. Tensor ops
    only, so it runs inside a decode graph."""
    reqs, bs = block_table.shape[0], key_cache.shape[1]
    per_req = -(-window // bs)
    lens = seq_lens.clamp(max=window).to(torch.int32)
    offsets = torch.arange(per_req * bs, device=seq_lens.device)
    # Key t of request b sits at position seq_len - len + t; the padding past len repeats the last key.
    pos = torch.minimum((seq_lens - lens)[:, None] + offsets, (seq_lens - 1)[:, None]).long()
    blocks = block_table.long().gather(1, pos // bs)
    shape = (reqs * per_req, bs, *key_cache.shape[2:])
    keys, values = key_cache[blocks, pos % bs].view(shape), value_cache[blocks, pos % bs].view(shape)
    table = torch.arange(reqs * per_req, dtype=torch.int32, device=seq_lens.device).view(reqs, per_req)
    return keys, values, table, lens
