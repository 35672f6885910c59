"""torch_npu's fused ops in place of the core's reference ops (``kiln.interfaces.model``), same arguments and results."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln_ascend.lora import add_lora
from kiln_ascend.moe import fused_experts, moe_route


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_rms_norm(x, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch_npu

    normed, _, summed = torch_npu.npu_add_rms_norm(x, residual, weight, eps)
    return normed, summed


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX rotary through ``npu_rotary_mul`` on (1, T, N, D) views, cos/sin halves duplicated."""
    import torch_npu

    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1)[None, :, None, :]
    sin = torch.cat((sin, sin), dim=-1)[None, :, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        out = torch_npu.npu_rotary_mul(x.unsqueeze(0).float(), cos, sin, rotary_mode="half")
        return out[0].to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_swiglu(x, dim=-1)


def fused_ops() -> dict[str, Callable]:
    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "rotary_embedding": rotary_embedding,
        "silu_and_mul": silu_and_mul,
        "add_lora": add_lora,
        "moe_route": moe_route,
        "fused_experts": fused_experts,
    }
