"""The ``AttentionBackend`` interface and the backend-neutral batch layout.

``kiln.testing.contracts.AttentionBackendContract`` checks an implementation.

Every step the model runner flattens the scheduled requests into one token
stream (decodes first, then prefills and prefill chunks) and describes it with a
``BatchLayout``; each backend turns that into its own metadata once per step and
then serves every layer.

    tokens:          | d0 | d1 | p0 p0 p0 p0 | p1 p1 |
    query_start_loc:  0    1    2             6       8
    seq_lens:         7    3    4             9        (KV length after this step)
    context_lens:     6    2    0             7        (already in the cache)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class BatchLayout:
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32
    seq_lens: torch.Tensor  # (num_reqs,) int32: tokens in the KV cache after this step
    context_lens: torch.Tensor  # (num_reqs,) int32: tokens already cached before this step
    block_table: torch.Tensor  # (num_reqs, max_blocks_per_req) int32, padded with 0
    slot_mapping: torch.Tensor  # (num_tokens,) int64; -1 marks padding tokens
    num_decode_reqs: int  # the first num_decode_reqs requests have exactly one query token
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so backends can loop or size buffers without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @classmethod
    def build(
        cls,
        block_rows: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device | str,
    ) -> BatchLayout:
        """Describe requests (decodes first) by their block ids, tokens already cached,
        and tokens computed this step."""
        slots: list[int] = []
        starts, seq_lens = [0], []
        for ids, context, n in zip(block_rows, context_lens, query_lens):
            slots.extend(ids[p // block_size] * block_size + p % block_size for p in range(context, context + n))
            starts.append(starts[-1] + n)
            seq_lens.append(context + n)
        width = max(len(r) for r in block_rows)  # one tensor from padded rows: a row at a time cost ~10 us each
        table = torch.tensor(
            [[*row] + [0] * (width - len(row)) for row in block_rows], dtype=torch.int32, device=device
        )
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode_reqs=sum(1 for n in query_lens if n == 1),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=seq_lens,
        )

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass(slots=True)
class DecodeGraphInputs:
    """The inputs of one decode step run as a graph: ``size`` decodes, padded rows included.

    Shapes are fixed per size (the block table is as wide as ``max_model_len`` needs),
    so a captured or compiled graph can be replayed with new values. Padded rows have
    token 0 at position 0, slot -1 (no KV write), sequence length 1 and a zero block row.
    """

    input_ids: torch.Tensor  # (size,) int64
    positions: torch.Tensor  # (size,) int64
    block_table: torch.Tensor  # (size, max_blocks_per_req) int32
    seq_lens: torch.Tensor  # (size,) int32: KV length after this step
    slot_mapping: torch.Tensor  # (size,) int64

    @classmethod
    def empty(cls, size: int, max_blocks: int, device: torch.device | str) -> DecodeGraphInputs:
        """``size`` padding rows."""
        return cls(
            input_ids=torch.zeros(size, dtype=torch.int64, device=device),
            positions=torch.zeros(size, dtype=torch.int64, device=device),
            block_table=torch.zeros(size, max_blocks, dtype=torch.int32, device=device),
            seq_lens=torch.ones(size, dtype=torch.int32, device=device),
            slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=device),
        )

    @classmethod
    def pad(
        cls, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout, size: int, max_blocks: int
    ) -> DecodeGraphInputs:
        """Pad a pure-decode step (``layout.num_reqs <= size``) to ``size`` rows."""
        n = layout.num_reqs
        inputs = cls.empty(size, max_blocks, input_ids.device)
        inputs.input_ids[:n] = input_ids
        inputs.positions[:n] = positions
        inputs.block_table[:n, : layout.block_table.shape[1]] = layout.block_table
        inputs.seq_lens[:n] = layout.seq_lens
        inputs.slot_mapping[:n] = layout.slot_mapping
        return inputs

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.positions, self.block_table, self.seq_lens, self.slot_mapping


class AttentionBackend(ABC):
    """Writes a step's K/V into the paged cache and computes attention for a mixed batch.

    Registered as a ``kiln.registry.AttentionBackendSpec``; the engine builds it as
    ``cls(num_heads, num_kv_heads, head_dim, dtype, cache_dtype)`` for this rank's heads
    (``cache_dtype`` is ``dtype`` unless ``--kv-cache-dtype`` chose one of ``cache_dtypes``).

    Contract (checked by ``kiln.testing.contracts``):
      * ``forward`` writes the K/V of *all* tokens of the step before reading any,
        so a request may attend to blocks another request fills in the same step
        (prefix-cache hits on blocks still being computed).
      * Query token j of request i sits at position ``context_lens[i] + j`` and sees
        keys at positions ``<= context_lens[i] + j`` (causal).
      * With ``sliding_window=w`` (a per-layer argument of ``forward``), a query at position
        p sees only keys at positions k with ``p - k < w``: itself and the w - 1 before it,
        as Hugging Face's sliding-window mask. The rule is positional, so it holds alike for
        prefills, chunks on a cached prefix and decodes. Backends that do not implement it
        leave ``supports_sliding_window`` False; models with a window then refuse them.
      * With ``logit_softcap=c`` (Gemma 2, passed only by layers that have one), scores are
        squashed to ``c * tanh(score / c)`` before the mask and softmax (``attention`` below).
        Backends that do not implement it leave ``supports_logit_softcap`` False; such models
        then refuse them.
      * Padding tokens (slot -1) are neither written nor attended from.
      * ``forward_encoder`` (encoder models: BERT, XLM-RoBERTa) is bidirectional attention within
        each sequence of the step (sequences delimited by ``layout.query_start_loc``): every query
        sees every key of its own sequence and none of another's; no KV cache is read or written.
        The default here runs torch SDPA per sequence; backends override it with their kernels,
        or set ``supports_encoder`` False (encoder models then refuse them).
    """

    name: ClassVar[str]
    supports_decode_graphs: ClassVar[bool] = False  # implements ``graph_metadata``
    supports_sliding_window: ClassVar[bool] = False  # honours ``forward(..., sliding_window=w)``
    supports_logit_softcap: ClassVar[bool] = False  # honours ``forward(..., logit_softcap=c)``
    supports_encoder: ClassVar[bool] = True  # implements ``forward_encoder`` (the default does)
    # Cache dtypes the backend stores besides the compute dtype (``--kv-cache-dtype``): values
    # are written as ``k / k_scale`` in that dtype and read back as ``stored * k_scale``.
    cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.cache_dtype = cache_dtype or dtype
        self.k_scale = self.v_scale = 1.0  # per-tensor KV-cache scales (1.0: no calibration)

    @classmethod
    def supports(cls, *, head_dim: int, dtype: torch.dtype, block_size: int) -> bool:
        """Whether this backend can run the given shape (the engine falls back otherwise)."""
        return True

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache; the default is (2, blocks, block_size, kv_heads, head_dim)."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def reference_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache as a (2, blocks, block_size, kv_heads, head_dim) view, the reference
        layout; lets the contract suite seed and compare caches of any layout."""
        return kv_cache

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src[i]`` to ``dst[i]`` in one layer's cache (beam search forks a
        sequence whose last block is partly filled). The default works on ``reference_view``."""
        view = self.reference_view(kv_cache)
        view[:, dst] = view[:, src]

    def build_metadata(self, layout: BatchLayout) -> object:
        """Backend-private metadata built once per step and passed to every layer."""
        return layout

    def graph_metadata(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor, block_size: int
    ) -> object:
        """Metadata for a pure-decode step inside a captured or compiled graph (one query token
        per row; see ``DecodeGraphInputs``). Build it from these tensors only: host values
        (lists, ``.item()``, ``.tolist()``) would be frozen into the graph at capture time.
        Backends that implement it set ``supports_decode_graphs = True``."""
        raise NotImplementedError(f"attention backend {self.name!r} has no decode-graph path")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
        *,
        layer_idx: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Return the attention output, shaped like ``q``. ``sliding_window`` is this layer's
        window, None for full causal attention; models pass it only for windowed layers, and
        only to backends whose ``supports_sliding_window`` is True."""

    def forward_encoder(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,
        layout: BatchLayout,
        *,
        scale: float,
    ) -> torch.Tensor:
        """Bidirectional attention within each sequence of ``layout`` (an encoder step: every
        request's whole prompt, nothing cached); returns the output shaped like ``q``."""
        out = torch.empty_like(q)
        start = 0
        for n in layout.query_lens_cpu:  # host lengths: no device sync
            # NOTE: 4-D inputs take torch's flash kernels (on CPU too); 3-D ones the math path.
            qi, ki, vi = (t[start : start + n].transpose(0, 1)[None] for t in (q, k, v))
            o = F.scaled_dot_product_attention(qi, ki, vi, scale=scale, enable_gqa=True)
            out[start : start + n] = o[0].transpose(0, 1)
            start += n
        return out


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into a (2, blocks, block_size, heads, dim) cache; slot -1 is skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    if not kv_cache.is_contiguous():  # another layout's reference view: write through its indices
        bs = kv_cache.shape[2]
        blocks, offsets = slot_mapping // bs, slot_mapping % bs
        kv_cache[0, blocks, offsets], kv_cache[1, blocks, offsets] = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        return
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def padded_rows(query_lens: list[int], width: int, device: torch.device | str) -> torch.Tensor:
    """(num_tokens,) int64: each token's row once the step's sequences are padded to ``width``
    tokens each (token j of sequence i -> ``i * width + j``), for backends that batch them."""
    rows = [i * width + j for i, n in enumerate(query_lens) for j in range(n)]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def window_start(position: int, sliding_window: int | None) -> int:
    """The first key position a query at ``position`` sees (0 without a window)."""
    return 0 if sliding_window is None else max(0, position - sliding_window + 1)


def attend_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """(queries, keys) bool, True where a query at ``q_pos`` attends a key at ``k_pos``:
    causal, and within ``sliding_window`` when there is one."""
    delta = q_pos[:, None] - k_pos[None, :]
    mask = delta >= 0
    return mask if sliding_window is None else mask & (delta < sliding_window)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Reference attention over (..., heads, len, dim) tensors (key/value heads shared by groups
    of query heads); ``mask`` is True where a query attends a key. Without a soft cap this is
    torch's SDPA; with one, scores are written out: ``c * tanh(q.k * scale / c)``, masked,
    softmax in fp32, as Gemma 2's reference computes them."""
    if logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / logit_softcap) * logit_softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: BatchLayout,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """The reference computation of ``AttentionBackend.forward`` (the ``torch_ref`` backend's),
    one request at a time, on a cache in the reference layout (a backend passes its
    ``reference_view``): writes the step's K/V, then attends each request's queries to its keys."""
    write_kv_cache(k, v, kv_cache, layout.slot_mapping)
    out = torch.zeros_like(q)
    bs = layout.block_size
    starts = layout.query_start_loc.tolist()
    for i, seq_len in enumerate(layout.seq_lens_cpu):
        q_start, q_end = starts[i], starts[i + 1]
        context = seq_len - (q_end - q_start)
        key, value = gather_kv(kv_cache, layout.block_table[i, : -(-seq_len // bs)].long(), seq_len)
        key, value = key.to(q.dtype), value.to(q.dtype)  # a narrower cache (--kv-cache-dtype) widens back
        # Query j (position context + j) sees keys 0..context + j (the last w of them with a window).
        q_pos = torch.arange(context, seq_len, device=q.device)
        mask = attend_mask(q_pos, torch.arange(seq_len, device=q.device), sliding_window)
        o = attention(
            q[q_start:q_end].transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), mask, scale, logit_softcap
        )
        out[q_start:q_end] = o.transpose(0, 1)
    return out


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous (length, heads, dim) K and V of one request from its blocks."""
    kv = kv_cache[:, block_ids].flatten(1, 2)[:, :length]
    return kv[0], kv[1]
