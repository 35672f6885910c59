"""GPTQ's per-group grid: the range shrunk where that rounds the group better."""

import torch

from kiln.quantization.gptq import MAXQ, _group_params


def rounding_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    q = torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, MAXQ)
    return ((q - zero[:, None]) * scale[:, None] - w).abs().pow(2.4).sum(dim=1)


def test_an_outlier_is_clipped_when_that_rounds_the_rest_better():
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w[0, 5] = 3.0  # an outlier: a min..max grid spaces its 16 levels for it
    for sym in (False, True):
        scale, zero = _group_params(w, sym)
        low, high = w.amin(dim=1), w.amax(dim=1)
        if sym:
            plain = (2 * torch.maximum(low.abs(), high.abs()) / MAXQ).half().double(), torch.full_like(low, 8)
        else:
            s = ((high - low) / MAXQ).half().double()
            plain = s, torch.clamp(-torch.round(low / s), 1, MAXQ)
        assert torch.all(rounding_error(w, scale, zero) <= rounding_error(w, *plain))
        assert scale[0] < plain[0][0]  # the outlier's row took a narrower grid
        assert torch.all(scale >= 0.8 * plain[0] - 1e-3)  # never more than 20 % narrower
