"""fp32 matmuls for decode-sized batches, through the C kernel of ``csrc/small_linear.c``.

With a decode step's few rows a linear layer streams its weight, and MKL's sgemm
read it at 4-10 GB/s on this project's AVX2 machine. The kernel reads each weight
value from memory once and reuses it from L1 for every row. Measured there, per
projection (576x3072 / LM head 576x49152): 16 rows 0.97 -> 0.42 ms / 30 -> 11 ms,
64 rows 2.7 -> 2.4 ms / 54 -> 31 ms. From 128 rows on sgemm is as fast or faster
(prefills), so those keep ``F.linear``. The weight is the model's own parameter
(tied embeddings stay one tensor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln_cpu import native

# Fewer rows than this take the kernel (measured crossover: about 128).
_MAX_ROWS = 128


class SmallBatchLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        shapes_ok = self.in_features % 8 == 0 and self.out_features % 4 == 0 and self.weight.is_contiguous()
        lib = native.load_kernels() if shapes_ok else None
        self.kernel = lib.small_linear_f32 if lib is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None or x.dim() != 2 or x.shape[0] >= _MAX_ROWS or x.stride(1) != 1:
            return F.linear(x, self.weight, self.bias)
        out = torch.empty(x.shape[0], self.out_features)
        bias = None if self.bias is None else self.bias.data_ptr()
        self.kernel(
            out.data_ptr(), x.data_ptr(), x.shape[0], x.stride(0), self.weight.data_ptr(), bias,
            self.in_features, self.out_features,
        )  # fmt: skip
        return out
