"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights, then W8A8.

Per input channel j of the linears that read one normalised input,
``s_j = max|X_j|**alpha / max|W_j|**(1 - alpha)``: the norm's weight is divided by s
and the linears' input columns multiplied by it, so the product is unchanged while
the activations, which int8 quantizes per token, lose their outlier channels. The
MLP's down projection is smoothed against up_proj's output rows the same way.
"""

from __future__ import annotations

import torch
from torch import nn


def smoothing_scales(act_absmax: torch.Tensor, linears: list[nn.Linear], alpha: float) -> torch.Tensor:
    weight_absmax = torch.cat([lin.weight.abs() for lin in linears]).amax(dim=0)
    s = act_absmax.clamp(min=1e-5).pow(alpha) / weight_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """Divide the output of ``prev`` by ``s`` per channel and multiply the input columns of the
    ``linears`` reading it by ``s``: the same function, differently distributed. ``prev`` is an
    RMSNorm (its weight scales its output) or a linear (its output rows)."""
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s[:, None])
        if prev.bias is not None:
            prev.bias.div_(s)
    else:
        prev.weight.div_(s)
    for lin in linears:
        lin.weight.mul_(s)


def smooth_layer(groups: list[tuple[nn.Module, list[nn.Linear], torch.Tensor]], alpha: float) -> None:
    """Smooth each (previous op, linears reading its output, per-channel max |input|)."""
    for prev, linears, act_absmax in groups:
        fold_scales(prev, linears, smoothing_scales(act_absmax, linears, alpha))
