"""fp8 checkpoints: each ``X.weight`` in float8 with its ``X.<scale>`` (per tensor, per output
feature, or per block). ``fp8_weights`` gives them in the canonical form of a ``QuantLinear`` of
``fp8_scheme`` (the weight as it is, the scale per output feature and group of inputs), for
platforms that compute in fp8; ``widen_fp8`` multiplies them out into fp32 ``X.weight``s that the
model copies into its own dtype, served as an unquantized model. Activation and KV-cache scales
(``input_scale``; ``k_scale``/``v_scale``, compressed-tensors' ``k_proj.output_scale``, AutoFP8's
``kv_scale``) have nothing to scale in either and are dropped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kiln.quantization.config import Fp8Layout

_DROPPED = ("input_scale", "output_scale", "k_scale", "v_scale", "q_scale", "kv_scale", "prob_output_scale")


def scale_rows(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None) -> torch.Tensor:
    """An fp8 weight's ``scale`` (a scalar, one per row, or a grid of one per ``block``) as
    (rows, groups) fp32: one per row and ``block[1]`` columns (the last group may be partial)."""
    scale = scale.float()
    if block is not None and scale.numel() > 1:
        return scale.repeat_interleave(block[0], 0)[: shape[0]].contiguous()
    return scale.reshape(-1, 1).expand(shape[0], 1).contiguous()


def widen(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """``weight`` (rows, columns) in float8 times ``scale``: a scalar, one per row, or a grid of
    one per ``block`` (the last row and column of blocks may be partial)."""
    rows = scale_rows(scale, weight.shape, block)
    if rows.shape[1] > 1:
        rows = rows.repeat_interleave(block[1], 1)[:, : weight.shape[1]]
    return weight.float() * rows


def _pairs(
    weights: Iterable[tuple[str, torch.Tensor]], layout: Fp8Layout
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(layer, fp8 weight, scale) for each fp8 layer (in whichever order the files hold the two),
    and (name, tensor, None) for every other tensor kept."""
    suffix = "." + layout.scale_name
    pending: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its weight and/or scale seen so far
    for name, tensor in weights:
        layer, _, leaf = name.rpartition(".")
        if leaf in _DROPPED:
            continue
        is_fp8 = leaf == "weight" and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        if not is_fp8 and not name.endswith(suffix):
            yield name, tensor, None
            continue
        parts = pending.setdefault(layer, {})
        parts["scale" if name.endswith(suffix) else "weight"] = tensor
        if len(parts) == 2:
            del pending[layer]
            yield layer, parts["weight"], parts["scale"]
    if pending:
        layer, parts = next(iter(pending.items()))
        missing = f"{layer}{suffix}" if "weight" in parts else f"{layer}.weight"
        raise ValueError(f"fp8 checkpoint: {missing} is missing (it has {', '.join(f'{layer}.{k}' for k in parts)})")


def widen_fp8(weights: Iterable[tuple[str, torch.Tensor]], layout: Fp8Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) stream with its fp8 weights widened; other tensors pass through."""
    for name, tensor, scale in _pairs(weights, layout):
        yield (name, tensor) if scale is None else (f"{name}.weight", widen(tensor, scale, layout.block))


def fp8_weights(weights: Iterable[tuple[str, torch.Tensor]], layout: Fp8Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) stream with each fp8 layer as ``X.weight`` (float8 e4m3, as
    stored) and ``X.weight_scale`` (rows, groups) fp32; other tensors pass through."""
    for name, tensor, scale in _pairs(weights, layout):
        if scale is None:
            yield name, tensor
        elif tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8 checkpoint: {name}.weight is {tensor.dtype} (Kiln computes in e4m3)")
        else:
            yield f"{name}.weight", tensor
            yield f"{name}.weight_scale", scale_rows(scale, tensor.shape, layout.block)
