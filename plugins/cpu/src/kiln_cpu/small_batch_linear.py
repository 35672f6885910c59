"""fp32 matmuls for decode-sized batches, computed as ``W @ x.T``.

MKL's sgemm is slow when the activation side is short and wide: for a decode
step's few rows, multiplying the long weight by the transposed activations was
12-30% faster on this project's AVX2 machine (64 rows through SmolLM2's LM head
576x49152: 50.7 vs 35.6 ms; through its 576x3072 gate/up projection: 2.8 vs
2.1 ms), and slower from about 128 rows on, so prefills keep ``F.linear``.
The weight is the model's own parameter (tied embeddings stay one tensor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Fewer rows than this take the transposed product (measured crossover: 128).
_MAX_ROWS = 128


class SmallBatchLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] >= _MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.t()).t()
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous()
