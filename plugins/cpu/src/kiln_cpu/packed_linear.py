"""bf16 matmuls on weights prepacked once for oneDNN (``Platform.process_weights``).

``F.linear`` on a plain bf16 weight reorders it on every call; at decode batch
sizes that costs as much as the multiply (measured on this project's machines:
a 576x576 projection for 16 tokens, 106 us plain vs 74 us prepacked, identical
results). The packed layout keeps the same number of elements, so memory does
not grow.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
from torch import nn

logger = logging.getLogger("kiln.cpu")

# The batch size oneDNN tunes the packed layout for; 256 was as fast as any
# other hint for 1-16 tokens and within 10% of plain F.linear at 2048.
BATCH_HINT = 256


@cache
def prepacking_works() -> bool:
    """oneDNN with bf16 support is present, and a packed matmul matches ``F.linear``."""
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        w = torch.randn(24, 16).bfloat16()
        x = torch.randn(3, 16).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return torch.equal(got, nn.functional.linear(x, w))
    except (RuntimeError, AttributeError) as exc:
        logger.info("oneDNN prepacking unavailable: %s", exc)
        return False


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight, BATCH_HINT))
            self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
