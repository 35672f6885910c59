"""Rounding weights to integer grids (the step every algorithm ends with)."""

from __future__ import annotations

import torch

from kiln.interfaces.quantization import quantize_per_token


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes (out, in) and one scale per output row (absmax / 127): the rounding
    W8A8 applies to each token, applied to each output row."""
    return quantize_per_token(w)


def _int4_grid(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 codes (rows, groups, group) and each group's scale and zero point: the grid spanning
    its min..max (AWQ's), the scale rounded to fp16 as the checkpoint stores it."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group, group)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low).clamp(min=1e-5) / 15).half().float()
    zero = torch.clamp(-torch.round(low / scale), 0, 15)
    codes = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15)
    return codes, scale, zero


def int4_asymmetric(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unsigned 4-bit codes (out, in) with a scale and zero point per ``group`` inputs:
    ``w ~ (code - zero) * scale``."""
    codes, scale, zero = _int4_grid(w, group)
    return codes.reshape(w.shape).to(torch.int8), scale, zero.to(torch.int8)


def int4_fake_quant(w: torch.Tensor, group: int) -> torch.Tensor:
    """``w`` rounded to ``int4_asymmetric``'s grid and widened back to fp32 (what AWQ's searches
    score), without the integer tensors in between."""
    codes, scale, zero = _int4_grid(w, group)
    return codes.sub_(zero[..., None]).mul_(scale[..., None]).reshape(w.shape)
