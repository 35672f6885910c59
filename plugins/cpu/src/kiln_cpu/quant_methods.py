"""Quantized linear layers on the CPU (``Platform.linear_method``).

Every scheme goes into the 4/8-bit tiles of the GGUF Q4_1/Q8_0 path (``tiled_weights``): a
scale, and for 4 bits an offset, per 32 inputs, so groups of any multiple of 32 fit exactly;
act-order (GPTQ ``g_idx``) sorts the inputs by group and the activations are read in that
order. They are multiplied in integers by ``csrc/int8_linear.c`` (vpdpbusd with VNNI,
vpmaddubsw on AVX2, AMX tiles from 16-32 rows), one kernel family with the GGUF path, and decode steps run them inside
the fused decoder layer (``fused_decode``).

- W8A8 (SmoothQuant / compressed-tensors int8): activations quantized per token, as the scheme
  says: the integers of the reference method, each 32-input block summed exactly and the
  blocks added in fp32 (the reference sums the row, then scales once).
- W4A16 / W8A16 (AWQ, GPTQ, weight-only int8): activations quantized to int8 per 32 inputs,
  as vLLM's CPU backend does through IPEX (``WoqLowpMode.INT8``, per input-channel block) and
  llama.cpp for its blocks: 4-bit decoding at batch 1 runs ~2x as fast as widening the weights
  (bench/quantization.py). ``KILN_CPU_INT8_ACTIVATIONS=0`` keeps fp32 activations: the tiles
  are widened and the products are exactly those of the dequantized weights.

bf16 models (``--dtype bfloat16``) run the same tiles on their rows widened to fp32, the
outputs rounded back to bf16: the reference method, their fallback before, widened every
weight on every call (an AWQ MoE at bf16 ran at half its fp32 speed). Layers the tiles do not
fit (fp16, widths not multiples of 16 and 32, act-order groups not multiples of 32 inputs):
W8A8 through ``torch._int_mm`` (oneDNN's int8 GEMM), the others through the reference method.
"""

from __future__ import annotations

import logging
import os

import torch

from kiln.interfaces.quantization import (
    LinearMethod,
    QuantLinear,
    QuantScheme,
    ReferenceLinearMethod,
    expert_tensors,
    group_index,
    quantize_per_token,
    replace_experts,
)
from kiln_cpu import native
from kiln_cpu.tiled_weights import (
    BLOCK,
    INT8_PER_BLOCK,
    INT8_PER_ROW,
    TILE,
    TiledLinear,
    TiledWeight,
    pack_q4,
    pack_q8,
    pack_tiles,
)

logger = logging.getLogger("kiln.cpu")


class Int8GemmMethod(LinearMethod):
    """W8A8: per-token int8 activations times per-channel int8 weights, in int32."""

    def process(self, layer: QuantLinear) -> None:
        layer.weight_t = layer.weight.data.T.contiguous()  # (in, out): the layout _int_mm reads fastest
        layer.scale_row = layer.weight_scale.data.reshape(1, -1).contiguous()
        del layer.weight, layer.weight_scale

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_per_token(x.reshape(-1, layer.in_features))
        out = torch._int_mm(q, layer.weight_t).float().mul_(scale).mul_(layer.scale_row)
        if layer.bias is not None:
            out += layer.bias
        return out.to(x.dtype).view(*x.shape[:-1], layer.out_features)


def _tiles(
    bits: int, weight: torch.Tensor, index: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> TiledWeight:
    """Canonical tensors (inputs in group order: ``index``, each input's group) as the tiles."""
    blocks = index[::BLOCK]  # each 32-input block lies in one group (group sizes are multiples of 32)
    scale = scale[:, blocks]
    if bits == 8:
        return TiledWeight(8, pack_tiles(scale), None, pack_q8(weight))
    zero = zero[:, blocks].float() if zero is not None else None
    codes = weight.to(torch.int16) + (8 if zero is None else 0)  # unsigned 0..15
    offset = -(8.0 if zero is None else zero) * scale  # w = code * scale + offset
    return TiledWeight(4, pack_tiles(scale), pack_tiles(offset), pack_q4(codes))


def _activations(scheme: QuantScheme) -> int:
    """How the scheme's tiles multiply (``tiled_matmul``'s modes; see the module doc)."""
    if scheme.activation_bits == 8:
        return INT8_PER_ROW
    return INT8_PER_BLOCK if os.environ.get("KILN_CPU_INT8_ACTIVATIONS", "1") != "0" else 0


class TiledIntMethod(LinearMethod):
    """Every scheme through the tiled C kernels (see the module doc)."""

    def process(self, layer: QuantLinear) -> None:
        weight, index = layer.weight.data, group_index(layer)
        perm = None
        if layer.g_idx is not None:  # act-order: sort the inputs by group, and the activations with them
            perm = torch.argsort(index, stable=True)
            weight, index = weight[:, perm], index[perm]
        zero = None if layer.weight_zero is None else layer.weight_zero.data
        tiled = _tiles(layer.scheme.weight_bits, weight, index, layer.weight_scale.data, zero)
        bias = None if layer.bias is None else layer.bias.data.float()  # the kernels add an fp32 bias
        # what the fused decoder layer runs
        layer.tiled = TiledLinear(tiled, bias, _activations(layer.scheme), perm)
        del layer.weight, layer.weight_scale, layer.weight_zero, layer.g_idx

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return layer.tiled(x)
        return layer.tiled(x.float()).to(x.dtype)  # bf16 models: the kernels take fp32 rows


class CpuLinearMethod(LinearMethod):
    """Chooses per layer: the tiled kernels where the shape and dtype fit, else W8A8 through
    oneDNN or the reference."""

    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme
        self.tiled = TiledIntMethod()
        self.fallback = Int8GemmMethod() if scheme.activation_bits == 8 else ReferenceLinearMethod()

    def _fits_tiles(self, layer: QuantLinear) -> bool:
        group = self.scheme.group_size or BLOCK
        return (
            native.load_kernels() is not None
            and layer.dtype in (torch.float32, torch.bfloat16)
            and layer.out_features % TILE == 0
            and layer.in_features % BLOCK == 0
            and group % BLOCK == 0
            # act-order: sorted by group, every 32-input block must still lie in one group
            and (layer.g_idx is None or bool((torch.bincount(layer.g_idx.long()) % BLOCK == 0).all()))
        )

    def process(self, layer: QuantLinear) -> None:
        layer.cpu_method = self.tiled if self._fits_tiles(layer) else self.fallback
        if type(layer.cpu_method) is ReferenceLinearMethod:
            logger.warning("%s: no CPU kernel for this shape or dtype; using the (slow) reference", layer)
        layer.cpu_method.process(layer)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return layer.cpu_method.apply(layer, x)

    def process_experts(self, moe, experts: dict[tuple[int, str], dict[str, torch.Tensor]]) -> bool:
        """Each expert's codes straight into the tiles ``kiln_cpu.experts`` packs (gate and up
        stacked, as ``w13`` stacks them), where they fit as for a linear layer and inputs are in
        group order; else False: widened, the blocks are then found back from the values, which
        took most of a start and gave 4-bit groups as 8-bit codes. A bf16 model's experts go
        into the same tiles, their rows widened to fp32 per call as for its linear layers:
        widened at load they had held bf16 values, 4x a 4-bit checkpoint's bytes."""
        from kiln_cpu.experts import PackedExperts

        inter, hidden = moe.w2.shape[2], moe.w2.shape[1]
        group = self.scheme.group_size  # FusedMoE checked that it divides both sizes; None: per row
        if (
            native.load_kernels() is None
            or moe.w13.dtype not in (torch.float32, torch.bfloat16)
            or "g_idx" in experts[0, "gate_proj"]
            or inter % BLOCK or hidden % BLOCK  # both are a matmul's inputs and outputs (tiles of 16)
            or (group or BLOCK) % BLOCK
        ):  # fmt: skip
            return False
        bits = self.scheme.weight_bits

        def packed(projections: tuple[str, ...], shape: torch.Size) -> PackedExperts:
            def leaf(name: str) -> list[torch.Tensor]:
                return expert_tensors(experts, moe.num_local, projections, name)

            zeros = leaf("weight_zero") if "weight_zero" in experts[0, "gate_proj"] else [None] * moe.num_local
            tiles = [
                _tiles(bits, weight, torch.arange(weight.shape[1]) // (group or weight.shape[1]), scale, zero)
                for weight, scale, zero in zip(leaf("weight"), leaf("weight_scale"), zeros)
            ]
            return PackedExperts(tiles, tuple(shape), _activations(self.scheme))

        replace_experts(moe, packed(("gate_proj", "up_proj"), moe.w13.shape), packed(("down_proj",), moe.w2.shape))
        return True


def linear_method(scheme: QuantScheme) -> LinearMethod:
    return CpuLinearMethod(scheme)
