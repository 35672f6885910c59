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
    # A quantized KV cache (``--kv-cache-dtype``): the backend stores K/V in ``cache_dtype``
    # with these scales. The test draws values the cache holds exactly, so the reference
    # (in ``dtype``) must match as closely as without quantization.
    cache_dtype: ClassVar[torch.dtype | None] = None
    k_scale: ClassVar[float] = 1.0  # powers of two

    v_scale: ClassVar[float] = 1.0

    def _setup(self, heads, kv_heads, head_dim, block_size, num_blocks, num_tokens):
        """The reference and the backend under test, their caches holding the same random history,
        and random q/k/v for ``num_tokens`` tokens."""
        ref = TorchRefAttentionBackend(heads, kv_heads, head_dim, self.dtype)
        backend = self.backend_cls(
            heads, kv_heads, head_dim, self.dtype, *([self.cache_dtype] if self.cache_dtype else [])
        )
        backend.k_scale, backend.v_scale = self.k_scale, self.v_scale
        ref_cache = torch.randn(ref.kv_cache_shape(num_blocks, block_size), device=self.device)
        ref_cache = torch.stack(
            [self._representable(ref_cache[0], self.k_scale), self._representable(ref_cache[1], self.v_scale)]
        )
        cache = torch.empty(
            backend.kv_cache_shape(num_blocks, block_size), dtype=backend.cache_dtype, device=self.device
        )
        view = backend.reference_view(cache)
        view[0].copy_(ref_cache[0] / self.k_scale)
        view[1].copy_(ref_cache[1] / self.v_scale)
        q = torch.randn(num_tokens, heads, head_dim, dtype=self.dtype, device=self.device)
        k, v = (
            self._representable(torch.randn(num_tokens, kv_heads, head_dim, device=self.device), scale)
            for scale in (self.k_scale, self.v_scale)
        )
        return ref, backend, ref_cache, cache, (q, k, v)

    def _representable(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """``x`` in ``dtype``, rounded so that ``x / scale`` is exact in ``cache_dtype`` when the cache
        is quantized (with power-of-two scales, the backend's divide and multiply are then exact)."""
        if self.cache_dtype is not None:
            x = (x / scale).to(self.cache_dtype).to(torch.float32) * scale
        return x.to(self.dtype)

    def _assert_same_cache(self, backend: AttentionBackend, cache: torch.Tensor, ref_cache: torch.Tensor) -> None:
        """New K/V landed in the same slots, with the same values."""
        view = backend.reference_view(cache).float()
        torch.testing.assert_close(view[0] * self.k_scale, ref_cache[0].float(), atol=0, rtol=0)
        torch.testing.assert_close(view[1] * self.v_scale, ref_cache[1].float(), atol=0, rtol=0)

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
        ref, backend, ref_cache, cache, (q, k, v) = self._setup(
            num_heads, num_kv_heads, head_dim, block_size, num_blocks, num_tokens
        )
        scale = head_dim**-0.5
        expected = ref.forward(q, k, v, ref_cache, ref.build_metadata(layout), layer_idx=0, scale=scale)
        got = backend.forward(q, k, v, cache, backend.build_metadata(layout), layer_idx=0, scale=scale)
        torch.testing.assert_close(got.float(), expected.float(), atol=self.atol, rtol=self.atol)
        self._assert_same_cache(backend, cache, ref_cache)

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
        ref, backend, ref_cache, cache, (q, k, v) = self._setup(heads, kv_heads, head_dim, block_size, num_blocks, size)
        expected = ref.forward(q[:n], k[:n], v[:n], ref_cache, ref.build_metadata(layout), layer_idx=0, scale=0.125)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        padded = DecodeGraphInputs.pad(ids, ids, layout, size, max_blocks)
        metadata = backend.graph_metadata(padded.block_table, padded.seq_lens, padded.slot_mapping, block_size)
        got = backend.forward(q, k, v, cache, metadata, layer_idx=0, scale=0.125)
        torch.testing.assert_close(got[:n].float(), expected.float(), atol=self.atol, rtol=self.atol)
        self._assert_same_cache(backend, cache, ref_cache)
