"""The Triton attention backend against the torch reference on mixed paged batches: GQA ratios
1, 3 and 8, head sizes 64 and 128, block sizes 16 and 32, lengths that do not fill a block,
decodes, fresh prefills and chunks on a cached prefix, with and without a sliding window. On GPU where one is present, else under
Triton's interpreter on CPU (fp32 and fp16: the interpreter's bf16 arithmetic is broken)."""

import pytest
import torch

from kiln.testing.contracts import AttentionBackendContract
from kiln_cuda.attention import TritonAttentionBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TestTritonAttentionFloat32(AttentionBackendContract):
    backend_cls = TritonAttentionBackend
    device = DEVICE
    atol = 2e-5


class TestTritonAttentionFloat16(AttentionBackendContract):
    """fp16 storage, fp32 arithmetic: every batch at both head sizes, GQA 3 and block 16 (the
    layouts' full product runs in fp32 above; the interpreter takes seconds per case)."""

    backend_cls = TritonAttentionBackend
    dtype = torch.float16
    device = DEVICE
    atol = 2e-3

    @pytest.mark.parametrize("head_dim", [64, 128])
    @pytest.mark.parametrize("batch", range(4))
    def test_matches_reference(self, head_dim, batch):
        super().test_matches_reference((6, 2), head_dim, 16, batch)

    @pytest.mark.parametrize("batch", [2, 3])
    def test_sliding_window_matches_reference(self, batch):
        super().test_sliding_window_matches_reference(batch, 7)


class Fp8CacheContract(AttentionBackendContract):
    """``--kv-cache-dtype fp8``: K/V stored in fp8 with per-tensor scales (2 and 0.5 here, so a
    missing multiply or divide shows), attention in fp32. One head layout and block size: the
    interpreter is slow, and the layouts are covered above."""

    backend_cls = TritonAttentionBackend
    device = DEVICE
    atol = 2e-5
    k_scale, v_scale = 2.0, 0.5

    @pytest.mark.parametrize("batch", [1, 3])
    def test_matches_reference(self, batch):
        super().test_matches_reference((6, 2), 64, 16, batch)

    @pytest.mark.parametrize("block_size", [16])
    def test_decode_graph_path(self, block_size):
        super().test_decode_graph_path(block_size)

    def test_sliding_window_matches_reference(self):
        super().test_sliding_window_matches_reference(3, 17)

    def test_decode_graph_path_sliding_window(self):
        super().test_decode_graph_path_sliding_window(4)


class TestTritonAttentionFp8E4M3(Fp8CacheContract):
    cache_dtype = torch.float8_e4m3fn


class TestTritonAttentionFp8E5M2(Fp8CacheContract):
    cache_dtype = torch.float8_e5m2
