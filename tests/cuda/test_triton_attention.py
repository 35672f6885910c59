"""The Triton attention backend against the torch reference on mixed paged batches: GQA ratios
1, 3 and 8, head sizes 64 and 128, block sizes 16 and 32, lengths that do not fill a block,
decodes, fresh prefills and chunks on a cached prefix. On GPU where one is present, else under
Triton's interpreter on CPU (fp32 and fp16: the interpreter's bf16 arithmetic is broken)."""

import torch

from kiln.testing.contracts import AttentionBackendContract
from kiln_cuda.attention import TritonAttentionBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TestTritonAttentionFloat32(AttentionBackendContract):
    backend_cls = TritonAttentionBackend
    device = DEVICE
    atol = 2e-5


class TestTritonAttentionFloat16(AttentionBackendContract):
    backend_cls = TritonAttentionBackend
    dtype = torch.float16
    device = DEVICE
    atol = 2e-3
