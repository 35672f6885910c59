"""Mixture-of-experts weights in the CPU matmul kernels' layout: each expert's (N, K) slice of a
fp32 ``kiln.models.moe.FusedMoE``'s stacked ``w13`` / ``w2`` tiled once, as the linear layers are
(``tiled_weights``: integer blocks where the values came from them, e.g. a quantized checkpoint's
experts), for ``kiln_cpu.fused_ops.fused_experts``'s one C call per layer (``csrc/experts.c``).
bf16 experts stay stacked as loaded: a C kernel reads them as they are at decode batch sizes,
oneDNN's GEMM beyond."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln_cpu.tiled_weights import TILE, TiledWeight, tiled_form


class _Tiled(ctypes.Structure):  # csrc/experts.c's Tiled: one expert's TiledWeight
    _fields_ = [("fmt", ctypes.c_int64), ("scale", ctypes.c_void_p), ("min", ctypes.c_void_p), ("q", ctypes.c_void_p)]


@dataclass(slots=True, eq=False)
class PackedExperts:
    """A stacked fp32 (experts, N, K) weight as one ``TiledWeight`` per expert, and their kernel
    arguments as ``csrc/experts.c`` reads them (built once)."""

    experts: list[TiledWeight]
    shape: tuple[int, int, int]  # of the stacked weight it replaced
    int8_activations: int = 0  # block-format experts multiply in integers: TiledLinear's modes
    kernel_args: ctypes.Array = field(init=False)

    def __post_init__(self) -> None:
        self.kernel_args = (_Tiled * len(self.experts))(*(_Tiled(*w.kernel_args) for w in self.experts))


def use_packed_experts(model: nn.Module, int8_activations: int = 0) -> int:
    """Tile every fp32 stacked expert weight pair (``w13``, ``w2`` of 3 dims) of ``model``'s
    modules, freeing each original; returns how many modules changed. An intermediate size
    that is not a multiple of 16 (a gate tile and its up tile) stays stacked for the reference.
    ``int8_activations``: how experts in integer blocks multiply (``tiled_matmul``'s modes)."""
    swapped = 0
    with torch.no_grad():
        for module in model.modules():
            stacked = {n: p for n, p in module.named_parameters(recurse=False) if n in ("w13", "w2") and p.dim() == 3}
            if len(stacked) != 2 or any(p.dtype != torch.float32 for p in stacked.values()):
                continue
            if stacked["w2"].shape[2] % TILE:
                continue
            forms = {n: [tiled_form(w) for w in p.detach()] for n, p in stacked.items()}
            if any(f is None for fs in forms.values() for f in fs):
                continue
            integers = any(f.fmt in (4, 6, 8) for fs in forms.values() for f in fs)  # else nothing to multiply in int8
            for name, experts in forms.items():
                del module._parameters[name]
                mode = int8_activations if integers else 0
                setattr(module, name, PackedExperts(experts, tuple(stacked[name].shape), mode))
            swapped += 1
    return swapped
