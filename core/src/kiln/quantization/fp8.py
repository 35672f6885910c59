"""fp8 checkpoints widened at load: each ``X.weight`` in float8 times its ``X.<scale>`` (per
tensor, per output feature, or per block) becomes an fp32 ``X.weight`` that the model copies into
its own dtype, so the model is served as an unquantized one. Activation and KV-cache scales
(``input_scale``; ``k_scale``/``v_scale``, compressed-tensors' ``k_proj.output_scale``, AutoFP8's
``kv_scale``) have nothing to scale there and are dropped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kiln.quantization.config import Fp8Layout

_DROPPED = ("input_scale", "output_scale", "k_scale", "v_scale", "q_scale", "kv_scale", "prob_output_scale")


def widen(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """``weight`` (rows, columns) in float8 times ``scale``: a scalar, one per row, or a grid of
    one per ``block`` (the last row and column of blocks may be partial)."""
    w = weight.float()
    scale = scale.float()
    if block is not None and scale.numel() > 1:
        rows, cols = w.shape
        scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    elif scale.numel() > 1:
        scale = scale.reshape(-1, 1)
    return w * scale


def widen_fp8(weights: Iterable[tuple[str, torch.Tensor]], layout: Fp8Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) stream with its fp8 weights widened (each paired with its scale,
    in whichever order the files hold them); other tensors pass through."""
    suffix = "." + layout.scale_name
    pending: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its weight and/or scale seen so far
    for name, tensor in weights:
        layer, _, leaf = name.rpartition(".")
        if leaf in _DROPPED:
            continue
        is_fp8 = leaf == "weight" and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        if not is_fp8 and not name.endswith(suffix):
            yield name, tensor
            continue
        parts = pending.setdefault(layer, {})
        parts["scale" if name.endswith(suffix) else "weight"] = tensor
        if len(parts) == 2:
            del pending[layer]
            yield f"{layer}.weight", widen(parts["weight"], parts["scale"], layout.block)
    if pending:
        layer, parts = next(iter(pending.items()))
        missing = f"{layer}{suffix}" if "weight" in parts else f"{layer}.weight"
        raise ValueError(f"fp8 checkpoint: {missing} is missing (it has {', '.join(f'{layer}.{k}' for k in parts)})")
