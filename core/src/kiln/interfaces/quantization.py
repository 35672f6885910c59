"""Quantized linear layers: the layer a model holds and the seam a platform fills.

A model builds a ``QuantLinear`` wherever its checkpoint quantizes a linear layer
(``kiln.quantization.make_linear``). The loader fills it with one canonical form,
whatever the checkpoint's format (AWQ, GPTQ, compressed-tensors):

- ``weight``: int8 (out, in). Symmetric schemes hold signed values; schemes with zero
  points hold the unsigned codes (0..15 for 4-bit). float8 (e4m3) for ``float_weights``
  schemes (fp8 checkpoints).
- ``weight_scale``: fp32 (out, groups), one per ``group_size`` inputs, or (out, 1).
- ``weight_zero``: int8 (out, groups), only for schemes with zero points.
- ``g_idx``: int32 (in,), only for GPTQ act-order checkpoints: the group of each input.

so ``w = (weight - weight_zero) * weight_scale`` per group. After loading, the
platform's ``LinearMethod`` (``Platform.linear_method``) repacks these tensors for its
kernel (``process``) and computes the layer (``apply``). ``ReferenceLinearMethod``
defines the result every platform must match.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from kiln.quantization.config import QuantScheme

__all__ = [
    "LinearMethod", "QuantLinear", "QuantScheme", "ReferenceLinearMethod", "dequantize", "expert_tensors",
    "quantize_per_token", "replace_experts", "widen",
]  # fmt: skip


class LinearMethod(ABC):
    """How a platform computes quantized linear layers of one scheme. ``takes_float_weights``:
    it computes fp8 checkpoints' float8 weights (``QuantScheme.float_weights``); a method that
    does not say so is never handed them (they are widened at load instead)."""

    takes_float_weights: bool = False

    @abstractmethod
    def process(self, layer: QuantLinear) -> None:
        """Called once after the weights are loaded: repack ``layer``'s canonical tensors
        into the kernel's layout. It may replace or delete them; ``apply`` reads what it left."""

    @abstractmethod
    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` for rows ``x`` (..., in_features), in ``x``'s dtype."""

    def process_experts(self, moe: nn.Module, experts: dict[tuple[int, str], dict[str, torch.Tensor]]) -> bool:
        """Optional: take a mixture-of-experts layer's quantized experts as they are: ``experts``
        has, for each local expert ``0..moe.num_local - 1`` and projection (``gate_proj``,
        ``up_proj``, ``down_proj``), this rank's part of the canonical
        tensors (``weight``, ``weight_scale``, and ``weight_zero`` / ``g_idx`` where the scheme
        has them). Replace ``moe.w13`` / ``moe.w2`` (the stacked weights' parameters, on the meta
        device: their shape and dtype, no memory) with what the platform's ``fused_experts`` op
        takes and return True; return False (the default) to have them widened into ``moe.w13`` /
        ``moe.w2`` in the model's dtype, on the device of ``moe.gate``. ``expert_tensors`` and
        ``replace_experts`` are the steps most platforms share."""
        return False


def expert_tensors(
    experts: dict[tuple[int, str], dict[str, torch.Tensor]], num_local: int, projections: tuple[str, ...], leaf: str
) -> list[torch.Tensor]:
    """For each of the ``num_local`` experts of ``LinearMethod.process_experts``' ``experts``, its
    ``projections``' ``leaf`` tensors joined along the outputs (``("gate_proj", "up_proj")``: gate
    rows then up rows, as ``w13`` stacks them)."""
    return [torch.cat([experts[e, p][leaf] for p in projections]) for e in range(num_local)]


def replace_experts(moe: nn.Module, w13: object, w2: object) -> None:
    """Put a platform's form of the stacked experts in place of ``moe``'s ``w13`` / ``w2`` parameters."""
    del moe._parameters["w13"], moe._parameters["w2"]
    moe.w13, moe.w2 = w13, w2


class QuantLinear(nn.Module):
    """A linear layer whose weight is quantized per ``scheme`` (tensors: see the module doc)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: QuantScheme, act_order: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.dtype = torch.get_default_dtype()  # the activations' (the model is built under its dtype)
        groups = in_features // scheme.group_size if scheme.group_size else 1
        if scheme.group_size and in_features % scheme.group_size:
            raise ValueError(f"{in_features} inputs are not a multiple of the group size {scheme.group_size}")
        codes = torch.float8_e4m3fn if scheme.float_weights else torch.int8
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=codes), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, groups, dtype=torch.float32), requires_grad=False)
        zero = None if scheme.symmetric else torch.zeros(out_features, groups, dtype=torch.int8)
        self.weight_zero = None if zero is None else nn.Parameter(zero, requires_grad=False)
        g_idx = torch.zeros(in_features, dtype=torch.int32) if act_order else None
        self.g_idx = None if g_idx is None else nn.Parameter(g_idx, requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.method: LinearMethod = ReferenceLinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.scheme.describe()}"


def _group_index(num_inputs: int, num_groups: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """The scale column each input uses: ``g_idx``, or contiguous groups."""
    return g_idx.long() if g_idx is not None else torch.arange(num_inputs) // (num_inputs // num_groups)


def group_index(layer: QuantLinear) -> torch.Tensor:
    """The scale column each of the layer's inputs uses."""
    return _group_index(layer.in_features, layer.weight_scale.shape[1], layer.g_idx)


def widen(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    """Canonical tensors widened to an (out, in) ``dtype`` weight: ``(codes - zero) * scale`` per group."""
    index = _group_index(codes.shape[1], scale.shape[1], g_idx).to(codes.device)
    q = codes.float()
    if zero is not None:
        q = q - zero.float()[:, index]
    return (q * scale[:, index]).to(dtype)


def dequantize(layer: QuantLinear, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The layer's weight widened to (out, in) ``dtype``."""
    return widen(layer.weight, layer.weight_scale, layer.weight_zero, layer.g_idx, dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` (tokens, in) as int8 with one fp32 scale per row (absmax / 127)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10)
    # Divided by a tensor: on CUDA, torch divides by a Python scalar through its reciprocal, which
    # is not IEEE division, and the kernels of every device divide exactly.
    scale = amax / torch.full_like(amax, 127.0)
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


class ReferenceLinearMethod(LinearMethod):
    """Plain torch on the canonical tensors: the weight widened per call, and for W8A8 an
    exact int32 product of per-token int8 activations. Correct on any device; slow."""

    takes_float_weights = True

    def process(self, layer: QuantLinear) -> None:
        pass

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features)
        if layer.scheme.activation_bits == 8:
            q, scale = quantize_per_token(rows)
            acc = (q.double() @ layer.weight.double().T).float()  # exact in fp64; int matmul is CPU-only
            out = (acc * scale * layer.weight_scale.T).to(x.dtype)
        else:
            out = rows @ dequantize(layer, x.dtype).T
        if layer.bias is not None:
            out = out + layer.bias.to(x.dtype)
        return out.view(*x.shape[:-1], layer.out_features)
