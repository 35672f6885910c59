"""GPTQ's per-group grids (the range shrunk where that rounds the group better, each column's
error weighted as GPTQ weighs it) and its group orders (dynamic, act-order, static groups)."""

import pytest
import torch

from kiln.interfaces.quantization import widen
from kiln.quantization.gptq import MAXQ, Hessian, _group_params, gptq_quantize

ONES = torch.ones(32, dtype=torch.float64)


def rounding_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, col_weight=ONES) -> torch.Tensor:
    q = torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, MAXQ)
    return (((q - zero[:, None]) * scale[:, None] - w).abs().pow(2.4) * col_weight).sum(dim=1)


def test_an_outlier_is_clipped_when_that_rounds_the_rest_better():
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w[0, 5] = 3.0  # an outlier: a min..max grid spaces its 16 levels for it
    for sym in (False, True):
        scale, zero = _group_params(w, sym, ONES)
        low, high = w.amin(dim=1), w.amax(dim=1)
        if sym:
            plain = (2 * torch.maximum(low.abs(), high.abs()) / MAXQ).half().double(), torch.full_like(low, 8)
        else:
            s = ((high - low) / MAXQ).half().double()
            plain = s, torch.clamp(-torch.round(low / s), 1, MAXQ)
        assert torch.all(rounding_error(w, scale, zero) <= rounding_error(w, *plain))
        assert scale[0] < plain[0][0]  # the outlier's row took a narrower grid
        assert torch.all(scale >= 0.8 * plain[0] - 1e-3)  # never more than 20 % narrower


def test_heavily_weighted_columns_steer_the_grid():
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    col_weight = ONES.clone()
    col_weight[:4] = 1000.0  # four columns whose errors cost the layer most
    plain, weighted = _group_params(w, False, ONES), _group_params(w, False, col_weight)
    before, after = rounding_error(w, *plain, col_weight), rounding_error(w, *weighted, col_weight)
    assert (after < before).sum() >= 8  # rows whose grid moved for those columns


@pytest.mark.parametrize("act_order,static_groups", [(False, False), (True, False), (True, True)])
def test_gptq_beats_rounding_each_group_alone(act_order, static_groups):
    """On inputs with correlated columns of unequal sizes, the layer's output error is smaller than
    with each group rounded on its own grid; act-order's groups are recorded in g_idx unless static."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(512, 64, generator=gen) @ torch.randn(64, 64, generator=gen) * torch.linspace(0.1, 3, 64)
    w = torch.randn(48, 64, generator=gen)
    hessian = Hessian(64)
    hessian.add(x)
    codes, scale, zero, g_idx = gptq_quantize(w, hessian, 32, act_order, sym=False, static_groups=static_groups)
    grids = [_group_params(w[:, g : g + 32].double(), False, ONES) for g in (0, 32)]
    rtn_scale, rtn_zero = torch.stack([s for s, _ in grids], 1), torch.stack([z for _, z in grids], 1)
    per_col = rtn_scale.repeat_interleave(32, 1), rtn_zero.repeat_interleave(32, 1)
    rtn_codes = torch.clamp(torch.round(w / per_col[0]) + per_col[1], 0, MAXQ)

    def output_error(weight):
        return (x @ (weight - w).T).norm()

    assert output_error(widen(codes, scale, zero, g_idx)) < 0.9 * output_error(widen(rtn_codes, rtn_scale, rtn_zero))
    if act_order and not static_groups:
        assert g_idx is not None and torch.bincount(g_idx.long()).tolist() == [32, 32]
        assert not torch.equal(g_idx, torch.arange(64) // 32)  # columns ran in Hessian order
    else:
        assert g_idx is None
