"""Mixture-of-experts weights in the CPU matmul kernel's layout: each expert's (N, K) slice of a
fp32 ``kiln.models.moe.FusedMoE``'s stacked ``w13`` / ``w2`` tiled once for the C kernel, as the
linear layers are (``tiled_weights``). ``kiln_cpu.fused_ops.fused_experts`` then runs each chosen
expert's two matmuls through them. bf16 experts stay stacked as loaded: a C kernel reads them
as they are at decode batch sizes (``csrc/experts.c``), oneDNN's GEMM beyond."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln_cpu.tiled_weights import TiledWeight, tiled_form, tiled_matmul


@dataclass(slots=True, eq=False)
class PackedExperts:
    """A stacked fp32 (experts, N, K) weight as one ``TiledWeight`` per expert:
    ``experts(e, rows)`` is ``rows @ W[e].T``."""

    experts: list[TiledWeight]
    shape: tuple[int, int, int]  # of the stacked weight it replaced

    def __call__(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return tiled_matmul(self.experts[e], rows, None)


def use_packed_experts(model: nn.Module) -> int:
    """Tile every fp32 stacked expert weight pair (``w13``, ``w2`` of 3 dims) of ``model``'s
    modules, freeing each original; returns how many modules changed."""
    swapped = 0
    with torch.no_grad():
        for module in model.modules():
            stacked = {n: p for n, p in module.named_parameters(recurse=False) if n in ("w13", "w2") and p.dim() == 3}
            if len(stacked) != 2 or any(p.dtype != torch.float32 for p in stacked.values()):
                continue
            forms = {n: [tiled_form(w) for w in p.detach()] for n, p in stacked.items()}
            if any(f is None for fs in forms.values() for f in fs):
                continue
            for name, experts in forms.items():
                del module._parameters[name]
                setattr(module, name, PackedExperts(experts, tuple(stacked[name].shape)))
            swapped += 1
    return swapped
