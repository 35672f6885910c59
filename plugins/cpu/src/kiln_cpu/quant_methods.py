"""Quantized linear layers on the CPU (``Platform.linear_method``).

- W8A8 (SmoothQuant / compressed-tensors int8): activations quantized to int8 per
  token, then ``torch._int_mm``, oneDNN's int8 GEMM, which picks its AVX2
  (``vpmaddubsw``), AVX-512 VNNI or AMX kernel at run time. Measured on this project's
  2-core EPYC (AVX-512 VNNI): 16x576x1536 in 36 us vs 244 us for the fp32 matmul.
- W4A16 / W8A16 (AWQ, GPTQ, weight-only int8) with fp32 activations: the weights go
  into ``csrc/tiled_linear.c``'s 4/8-bit tiles (the GGUF Q4_1/Q8_0 kernel), which widen
  a tile at a time in L1: a scale (and for 4-bit an offset) per 32 inputs, so groups of
  any multiple of 32 fit exactly. Other shapes and dtypes use the reference method.
"""

from __future__ import annotations

import logging

import torch

from kiln.interfaces.quantization import (
    LinearMethod,
    QuantLinear,
    QuantScheme,
    ReferenceLinearMethod,
    group_index,
    quantize_per_token,
)
from kiln_cpu import native
from kiln_cpu.tiled_weights import BLOCK, TILE, TiledWeight, pack_q4, pack_q8, pack_tiles, tiled_matmul

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


class TiledIntMethod(LinearMethod):
    """W4A16 / W8A16 on fp32 activations through the tiled C kernel."""

    def process(self, layer: QuantLinear) -> None:
        weight, index = layer.weight.data, group_index(layer)
        perm = None
        if layer.g_idx is not None:  # act-order: sort the inputs by group, and the activations with them
            perm = torch.argsort(index, stable=True)
            weight, index = weight[:, perm], index[perm]
        blocks = index[::BLOCK]  # each 32-input block lies in one group (group sizes are multiples of 32)
        scale = layer.weight_scale.data[:, blocks]
        if layer.scheme.weight_bits == 8:
            tiled = TiledWeight(8, pack_tiles(scale), None, pack_q8(weight))
        else:
            zero = layer.weight_zero.data[:, blocks].float() if layer.weight_zero is not None else None
            codes = weight.to(torch.int16) + (8 if zero is None else 0)  # unsigned 0..15
            offset = -(8.0 if zero is None else zero) * scale  # w = code * scale + offset
            tiled = TiledWeight(4, pack_tiles(scale), pack_tiles(offset), pack_q4(codes))
        layer.tiled, layer.perm = tiled, perm
        del layer.weight, layer.weight_scale, layer.weight_zero, layer.g_idx

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        if layer.perm is not None:
            x = x.reshape(-1, layer.in_features)[:, layer.perm]
        return tiled_matmul(layer.tiled, x, layer.bias).view(*x.shape[:-1], layer.out_features)


class CpuLinearMethod(LinearMethod):
    """Chooses per layer: the tiled kernel where its shape and dtype fit, else the reference."""

    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme
        self.tiled, self.reference = TiledIntMethod(), ReferenceLinearMethod()

    def _fits_tiles(self, layer: QuantLinear) -> bool:
        group = self.scheme.group_size or BLOCK
        return (
            native.load_kernels() is not None
            and layer.dtype == torch.float32
            and layer.out_features % TILE == 0
            and layer.in_features % BLOCK == 0
            and group % BLOCK == 0
        )

    def process(self, layer: QuantLinear) -> None:
        layer.cpu_method = self.tiled if self._fits_tiles(layer) else self.reference
        if layer.cpu_method is self.reference:
            logger.warning("%s: no CPU kernel for this shape or dtype; using the (slow) reference", layer)
        layer.cpu_method.process(layer)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return layer.cpu_method.apply(layer, x)


def linear_method(scheme: QuantScheme) -> LinearMethod:
    if scheme.activation_bits == 8:
        return Int8GemmMethod()
    return CpuLinearMethod(scheme)
