"""Quantized checkpoint formats <-> Kiln's canonical tensors (``kiln.interfaces.quantization``).

Each quantized linear layer ``X`` of a checkpoint stores a few tensors (AutoAWQ's GEMM
layout: ``X.qweight/qzeros/scales``; AutoGPTQ's: the same plus ``X.g_idx``;
compressed-tensors: ``X.weight`` + ``X.weight_scale``, or ``X.weight_packed`` for 4-bit).
``canonical_weights`` turns a checkpoint's (name, tensor) stream into
``X.weight/weight_scale/weight_zero/g_idx``; ``checkpoint_tensors`` does the reverse
for ``kiln quantize``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kiln.quantization.config import QuantConfig
from kiln.quantization.packing import AWQ_ORDER, pack, unpack

# The tensors of one quantized layer, per checkpoint layout.
_LAYOUTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "ct-packed": ("weight_packed", "weight_scale", "weight_shape"),
}


def _layout(quant: QuantConfig) -> str | None:
    if quant.method in ("awq", "gptq"):
        return quant.method
    return "ct-packed" if quant.packed else None  # compressed-tensors int8: X.weight is already int8


def _contiguous_groups(num_inputs: int, group_size: int | None) -> torch.Tensor:
    return torch.arange(num_inputs, dtype=torch.int32) // (group_size or num_inputs)


def to_canonical(layout: str, parts: dict[str, torch.Tensor], quant: QuantConfig) -> dict[str, torch.Tensor]:
    """One layer's checkpoint tensors -> {weight, weight_scale[, weight_zero][, g_idx]}."""
    scheme = quant.scheme
    bits = scheme.weight_bits
    if layout == "awq":
        codes = unpack(parts["qweight"], bits, 1, AWQ_ORDER).T
        zero = unpack(parts["qzeros"], bits, 1, AWQ_ORDER).T
        scale = parts["scales"].T
    elif layout == "gptq":
        codes = unpack(parts["qweight"], bits, 0).T
        zero = ((unpack(parts["qzeros"], bits, 1) + 1) & ((1 << bits) - 1)).T  # GPTQ stores zero - 1
        scale = parts["scales"].T
        g_idx = parts["g_idx"].to(torch.int32)
        if not quant.desc_act and not torch.equal(g_idx, _contiguous_groups(len(g_idx), scheme.group_size)):
            raise ValueError("gptq: g_idx is not in group order but desc_act is false in quantization_config")
    else:  # compressed-tensors pack-quantized: signed values stored + 2**(bits-1), packed along inputs
        codes = unpack(parts["weight_packed"], bits, 1)
        zero = torch.full(parts["weight_scale"].shape, 1 << (bits - 1), dtype=torch.int16)
        scale = parts["weight_scale"]
        rows, cols = parts["weight_shape"].tolist()
        codes = codes[:rows, :cols]
    out = {"weight_scale": scale.float().contiguous()}
    if scheme.symmetric:
        index = _contiguous_groups(codes.shape[1], scheme.group_size).long() if not quant.desc_act else g_idx.long()
        out["weight"] = (codes - zero[:, index]).to(torch.int8).contiguous()
    else:
        out["weight"] = codes.to(torch.int8).contiguous()
        out["weight_zero"] = zero.to(torch.int8).contiguous()
    if quant.desc_act:
        out["g_idx"] = g_idx.contiguous()
    return out


def canonical_weights(
    weights: Iterable[tuple[str, torch.Tensor]], quant: QuantConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) stream with each quantized layer's tensors in canonical form.

    A layer's tensors are held until all of them have arrived (shards may split them)."""
    layout = _layout(quant)
    wanted = _LAYOUTS.get(layout, ())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if leaf in ("input_scale", "weight_zero_point", "input_zero_point") and layout is None:
            if leaf == "weight_zero_point" and not tensor.any():
                continue  # a symmetric scheme's zero points, written out as zeros
            raise ValueError(f"{name}: static activation scales and zero points are not supported")
        if leaf == "weight_zero_point" and layout == "ct-packed":
            raise ValueError(f"{name}: compressed-tensors 4-bit weights with zero points are not supported")
        if leaf not in wanted:
            if leaf == "weight_scale":
                tensor = tensor.float().reshape(tensor.shape[0], -1)
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor
        if len(parts) == len(wanted):
            del pending[module]
            for leaf, value in to_canonical(layout, parts, quant).items():
                yield f"{module}.{leaf}", value
    if pending:
        module, parts = next(iter(pending.items()))
        missing = sorted(set(wanted) - set(parts))
        raise ValueError(f"checkpoint is missing {', '.join(f'{module}.{m}' for m in missing)}")


def quantized_leaves(quant: QuantConfig) -> set[str]:
    """The canonical tensors of one of ``quant``'s layers."""
    leaves = {"weight", "weight_scale"}
    if not quant.scheme.symmetric:
        leaves.add("weight_zero")
    if quant.desc_act:
        leaves.add("g_idx")
    return leaves


def is_quantized(leaf: str, tensor: torch.Tensor) -> bool:
    """Whether a canonical tensor is a quantized layer's: not a 16/32-bit ``weight``."""
    return leaf != "weight" or not tensor.is_floating_point() or tensor.element_size() == 1


class QuantizedParts:
    """Quantized layers' canonical tensors, held per layer until all have arrived, then widened
    to an fp32 weight: for layers a model keeps in floats (DeepSeek's, a mixture's experts)."""

    def __init__(self, quant: QuantConfig) -> None:
        self.leaves = quantized_leaves(quant)
        self.pending: dict[object, dict[str, torch.Tensor]] = {}

    def add(
        self, layer: object, leaf: str, tensor: torch.Tensor, widened: bool = True
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """Once ``tensor`` completes the layer: its widened weight, or (``widened=False``) its
        canonical tensors by leaf; else None."""
        parts = self.pending.setdefault(layer, {})
        parts[leaf] = tensor
        if len(parts) < len(self.leaves):
            return None
        del self.pending[layer]
        return widen_parts(parts) if widened else parts

    def check_complete(self) -> None:
        if self.pending:
            layer, parts = next(iter(self.pending.items()))
            missing = ", ".join(f"{layer}.{m}" for m in sorted(self.leaves - set(parts)))
            raise ValueError(f"checkpoint is missing {missing}")


def widen_parts(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """A quantized layer's canonical tensors by leaf, widened to its fp32 weight."""
    from kiln.interfaces.quantization import widen

    return widen(*(parts.get(k) for k in ("weight", "weight_scale", "weight_zero", "g_idx")))


def widen_quantized(
    weights: Iterable[tuple[str, torch.Tensor]], quant: QuantConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """A quantized checkpoint's stream with each quantized layer widened to an fp32 ``X.weight``
    (for a model without quantized layers); other tensors pass through."""
    parts = QuantizedParts(quant)
    for name, tensor in canonical_weights(weights, quant):
        module, _, leaf = name.rpartition(".")
        if leaf not in parts.leaves or not is_quantized(leaf, tensor):
            yield name, tensor  # not a quantized layer's (a norm, an embedding, an unquantized layer)
        elif (weight := parts.add(module, leaf, tensor)) is not None:
            yield f"{module}.weight", weight
    parts.check_complete()


def checkpoint_tensors(
    quant: QuantConfig, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
    g_idx: torch.Tensor | None, dtype: torch.dtype,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """One layer's canonical tensors in ``quant``'s checkpoint layout, scales stored as
    ``dtype`` (AWQ and GPTQ: fp16, as their readers expect)."""
    bits, layout = quant.scheme.weight_bits, _layout(quant)
    if layout is None:
        return {"weight": weight.contiguous(), "weight_scale": scale.to(dtype).contiguous()}
    codes = weight.to(torch.int16)
    if zero is None:  # symmetric: unsigned codes around 2**(bits-1)
        codes, zero = codes + (1 << (bits - 1)), torch.full(scale.shape, 1 << (bits - 1), dtype=torch.int16)
    if layout == "ct-packed":
        return {
            "weight_packed": pack(codes, bits, 1),
            "weight_shape": torch.tensor(list(weight.shape), dtype=torch.int64),
            "weight_scale": scale.to(dtype).contiguous(),
        }
    if layout == "awq":
        return {
            "qweight": pack(codes.T, bits, 1, AWQ_ORDER),
            "qzeros": pack(zero.T, bits, 1, AWQ_ORDER),
            "scales": scale.T.to(torch.float16).contiguous(),
        }
    if g_idx is None:
        g_idx = _contiguous_groups(weight.shape[1], weight.shape[1] // scale.shape[1])
    return {
        "qweight": pack(codes.T, bits, 0),
        "qzeros": pack((zero.to(torch.int16).T - 1) & ((1 << bits) - 1), bits, 1),  # AutoGPTQ's zero - 1
        "scales": scale.T.to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }
