"""Building and loading linear layers for a possibly quantized checkpoint."""

from __future__ import annotations

import logging

import torch
from torch import nn

from kiln.interfaces.quantization import QuantLinear
from kiln.quantization.config import QuantConfig
from kiln.quantization.rtn import int8_per_channel

logger = logging.getLogger("kiln")


def make_linear(
    quant: QuantConfig | None, names: list[str], in_features: int, out_features: int, bias: bool = False
) -> nn.Module:
    """An ``nn.Linear``, or a ``QuantLinear`` when ``quant`` quantizes the layers ``names``
    (Hugging Face names; a merged projection lists the ones it merges)."""
    if quant is None:
        return nn.Linear(in_features, out_features, bias=bias)
    quantized = {quant.quantizes(name) for name in names}
    if len(quantized) > 1:
        raise ValueError(f"{', '.join(names)} are merged into one matmul, but only some of them are quantized")
    if not quantized.pop():
        return nn.Linear(in_features, out_features, bias=bias)
    return QuantLinear(in_features, out_features, bias, quant.scheme, act_order=quant.desc_act)


def row_parallel_dim(leaf: str, tensor: torch.Tensor) -> int | None:
    """The dimension a row-parallel layer's tensor ``leaf`` splits along under tensor
    parallelism: the weight's inputs, and the scales of grouped inputs; None: kept whole
    (per-channel scales, biases, and ``g_idx``: act-order checkpoints are served on one rank)."""
    if leaf == "weight":
        return 1
    if leaf in ("weight_scale", "weight_zero") and tensor.shape[1] > 1:
        return 1
    return None


def values_for(
    params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, part: str | None = None
) -> dict[str, torch.Tensor]:
    """The values a checkpoint tensor (``part`` of ``name``, merged) gives the parameter ``name``
    (and its scale): as it is, except a float weight for an int8 parameter, quantized here per
    channel (``--quantization weight_only_int8`` on an unquantized checkpoint), and a 16-bit
    weight for an fp8 parameter (a layer, or part of a fused one, an fp8 checkpoint left in 16
    bits without listing it), rounded to fp8 per row with a warning."""
    param = params.get(name)
    if param is None:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    if tensor.dtype == torch.int8 and param.dtype != torch.int8:
        raise ValueError(f"{part or name}: int8 weights for a layer held unquantized, without a quantization_config")
    if param.dtype == torch.int8 and tensor.is_floating_point():
        return dict(zip((name, name + "_scale"), int8_per_channel(tensor)))
    if param.dtype == torch.float8_e4m3fn and tensor.dtype != param.dtype:
        logger.warning("%s: %s in an fp8 checkpoint that does not list it as unquantized: rounded to fp8 per row",
                       part or name, tensor.dtype)  # fmt: skip
        scale = tensor.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / torch.finfo(param.dtype).max
        groups = params[name + "_scale"].shape[1]
        return {name: (tensor.float() / scale).to(param.dtype), name + "_scale": scale.expand(-1, groups)}
    return {name: tensor}


def load_linear_tensor(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> list[str]:
    """Copy ``tensor`` into the parameter ``name`` (``values_for`` says how); returns the
    parameters it filled."""
    values = values_for(params, name, tensor)
    for key, value in values.items():
        target = params[key]
        if target.shape != value.shape:
            raise ValueError(f"weight {key!r} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(value)
    return list(values)
