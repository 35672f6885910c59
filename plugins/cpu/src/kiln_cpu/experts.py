"""Mixture-of-experts weights in the CPU matmul kernels' layouts: each expert's (N, K) slice of a
``kiln.models.moe.FusedMoE``'s stacked ``w13`` / ``w2`` converted once, as the linear layers are:
fp32 tiled for the C kernel (``tiled_weights``), bf16 prepacked for oneDNN (``packed_linear``).
``kiln_cpu.fused_ops.fused_experts`` then runs each chosen expert's two matmuls through them: at
the few rows an expert gets per decode step, plain ``F.linear`` on the stacked weight was 2-3x
slower (it streams or reorders the whole weight on every call)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kiln_cpu.packed_linear import BATCH_HINT, prepacking_works
from kiln_cpu.tiled_weights import tiled_form, tiled_matmul


@dataclass(slots=True, eq=False)
class PackedExperts:
    """A stacked (experts, N, K) weight as one packed weight per expert, and the matmul that
    reads that form: ``experts(e, rows)`` is ``rows @ W[e].T``."""

    experts: list
    matmul: Callable[[object, torch.Tensor], torch.Tensor]
    shape: tuple[int, int, int]  # of the stacked weight it replaced

    def __call__(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return self.matmul(self.experts[e], rows)


def _packed_bf16(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)


def _bf16_matmul(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")


def _packer(dtype: torch.dtype) -> tuple[Callable, Callable] | None:
    if dtype == torch.float32:
        return tiled_form, lambda w, rows: tiled_matmul(w, rows, None)
    if dtype == torch.bfloat16 and prepacking_works():
        return _packed_bf16, _bf16_matmul
    return None


def use_packed_experts(model: nn.Module) -> int:
    """Convert every stacked expert weight pair (``w13``, ``w2`` of 3 dims) of ``model``'s modules
    whose dtype has a kernel here, freeing each original; returns how many modules changed."""
    swapped = 0
    with torch.no_grad():
        for module in model.modules():
            stacked = {n: p for n, p in module.named_parameters(recurse=False) if n in ("w13", "w2") and p.dim() == 3}
            packer = _packer(next(iter(stacked.values())).dtype) if len(stacked) == 2 else None
            if packer is None:
                continue
            forms = {n: [packer[0](w) for w in p.detach()] for n, p in stacked.items()}
            if any(f is None for fs in forms.values() for f in fs):
                continue
            for name, experts in forms.items():
                del module._parameters[name]
                setattr(module, name, PackedExperts(experts, packer[1], tuple(stacked[name].shape)))
            swapped += 1
    return swapped
