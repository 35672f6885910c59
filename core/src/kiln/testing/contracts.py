"""Contract suites that every implementation of a core interface must pass.

Plugin authors subclass a contract in their own tests::

    class TestMyBackend(AttentionBackendContract):
        backend_cls = MyBackend
        dtype, atol = torch.float16, 2e-3
"""

from __future__ import annotations

import random
from typing import ClassVar

import pytest
import torch

from kiln.attention.base import AttentionBackend, BatchLayout, DecodeGraphInputs
from kiln.attention.torch_ref import TorchRefAttentionBackend


def random_layout(
    rng: random.Random, block_size: int, num_blocks: int, shapes: list[tuple[int, int]], device: str = "cpu"
) -> tuple[BatchLayout, int]:
    """A layout for requests given as (context_len, query_len), decodes (query 1) first,
    with blocks drawn at random from ``1..num_blocks-1`` (block 0 is the null block)."""
    shapes = sorted(shapes, key=lambda s: s[1] != 1)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + q) // block_size))] for c, q in shapes]
    layout = BatchLayout.build(tables, [c for c, _ in shapes], [q for _, q in shapes], block_size, device)
    return layout, layout.num_tokens


# (context_len, query_len) per request: decodes, fresh prefills, chunks on a cached
# prefix, lengths that do not fill a block, single-token prefills.
BATCHES = [
    [(0, 7)],
    [(5, 1), (33, 1), (0, 1)],
    [(16, 1), (0, 19), (31, 2)],
    [(40, 1), (3, 1), (0, 33), (17, 16), (64, 5)],
]


class AttentionBackendContract:
    """Compares ``backend_cls`` with the torch reference on mixed paged batches."""

    backend_cls: ClassVar[type[AttentionBackend]]
    dtype: ClassVar[torch.dtype] = torch.float32
    atol: ClassVar[float] = 1e-5
    device: ClassVar[str] = "cpu"

    @pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa8"])
    @pytest.mark.parametrize("head_dim", [64, 128])
    @pytest.mark.parametrize("block_size", [16, 32])
    @pytest.mark.parametrize("batch", range(len(BATCHES)))
    def test_matches_reference(self, heads, head_dim, block_size, batch):
        num_heads, num_kv_heads = heads
        if not self.backend_cls.supports(head_dim=head_dim, dtype=self.dtype, block_size=block_size):
            pytest.skip("unsupported shape")
        rng = random.Random(batch * 1000 + head_dim + block_size)
        torch.manual_seed(batch)
        num_blocks = 64
        layout, num_tokens = random_layout(rng, block_size, num_blocks, BATCHES[batch], self.device)
        ref = TorchRefAttentionBackend(num_heads, num_kv_heads, head_dim, self.dtype)
        backend = self.backend_cls(num_heads, num_kv_heads, head_dim, self.dtype)
        # Both caches start with the same (random) history for the cached contexts.
        ref_cache = torch.randn(ref.kv_cache_shape(num_blocks, block_size), dtype=self.dtype, device=self.device)
        cache = torch.empty(backend.kv_cache_shape(num_blocks, block_size), dtype=self.dtype, device=self.device)
        backend.reference_view(cache).copy_(ref_cache)
        q = torch.randn(num_tokens, num_heads, head_dim, dtype=self.dtype, device=self.device)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=self.dtype, device=self.device)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=self.dtype, device=self.device)
        scale = head_dim**-0.5
        expected = ref.forward(q, k, v, ref_cache, ref.build_metadata(layout), layer_idx=0, scale=scale)
        got = backend.forward(q, k, v, cache, backend.build_metadata(layout), layer_idx=0, scale=scale)
        torch.testing.assert_close(got.float(), expected.float(), atol=self.atol, rtol=self.atol)
        # New K/V landed in the same slots.
        torch.testing.assert_close(backend.reference_view(cache).float(), ref_cache.float(), atol=0, rtol=0)

    @pytest.mark.parametrize("block_size", [16, 32, 64, 128])
    def test_decode_graph_path(self, block_size):
        """``graph_metadata`` on a decode step padded with empty rows gives the reference's
        output for the real rows and writes no padding row's K/V."""
        heads, kv_heads, head_dim = 6, 2, 64
        if not self.backend_cls.supports_decode_graphs:
            pytest.skip("no decode-graph path")
        if not self.backend_cls.supports(head_dim=head_dim, dtype=self.dtype, block_size=block_size):
            pytest.skip("unsupported shape")
        torch.manual_seed(block_size)
        num_blocks, size, max_blocks = 16, 5, 8
        layout, n = random_layout(random.Random(block_size), block_size, num_blocks, BATCHES[1], self.device)
        ref = TorchRefAttentionBackend(heads, kv_heads, head_dim, self.dtype)
        backend = self.backend_cls(heads, kv_heads, head_dim, self.dtype)
        ref_cache = torch.randn(ref.kv_cache_shape(num_blocks, block_size), dtype=self.dtype, device=self.device)
        cache = torch.empty(backend.kv_cache_shape(num_blocks, block_size), dtype=self.dtype, device=self.device)
        backend.reference_view(cache).copy_(ref_cache)
        q = torch.randn(size, heads, head_dim, dtype=self.dtype, device=self.device)
        k = torch.randn(size, kv_heads, head_dim, dtype=self.dtype, device=self.device)
        v = torch.randn(size, kv_heads, head_dim, dtype=self.dtype, device=self.device)
        expected = ref.forward(q[:n], k[:n], v[:n], ref_cache, ref.build_metadata(layout), layer_idx=0, scale=0.125)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        padded = DecodeGraphInputs.pad(ids, ids, layout, size, max_blocks)
        metadata = backend.graph_metadata(padded.block_table, padded.seq_lens, padded.slot_mapping, block_size)
        got = backend.forward(q, k, v, cache, metadata, layer_idx=0, scale=0.125)
        torch.testing.assert_close(got[:n].float(), expected.float(), atol=self.atol, rtol=self.atol)
        torch.testing.assert_close(backend.reference_view(cache).float(), ref_cache.float(), atol=0, rtol=0)
