"""AWQ's searches score trials through the inputs' Gram matrix (or, for layers wider than the
tokens are many, straight from ``x @ D.T``): the same errors, and the same choices, as scoring
them on the calibration outputs against the full-precision ones."""

import torch
from torch import nn

from kiln.quantization import awq


def _inputs(tokens: int, features: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # a few loud channels, as real activations have: they are what the scales search is for
    return torch.randn(tokens, features, generator=g) * (1 + 20 * (torch.rand(features, generator=g) > 0.95))


def test_output_error_is_the_mean_squared_output_difference():
    x = _inputs(300, 64)
    delta = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 1e-2
    direct = ((x @ (delta + 1).T) - x @ torch.ones_like(delta).T).pow(2).mean().item()
    assert abs(awq._output_error(x, delta, x.T @ x) - direct) <= 1e-4 * direct
    assert abs(awq._output_error(x, delta, None) - direct) <= 1e-4 * direct


def _search_scales_directly(x, linears, group):
    """The search as first written: every trial's outputs against the full-precision ones."""
    weight = torch.cat([lin.weight for lin in linears])
    grouped = weight.abs().reshape(weight.shape[0], -1, group)
    w_mean = (grouped / (grouped.amax(-1, keepdim=True) + 1e-6)).reshape(weight.shape).mean(0)
    x_mean, reference = x.abs().mean(0), x @ weight.T
    errors = []
    for step in range(awq.GRID):
        ratio = step / awq.GRID
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        errors.append(((x @ (awq.fake_quant(weight * s, group) / s).T - reference).pow(2).mean().item(), s))
    return min(errors, key=lambda e: e[0])[1]


def test_scale_search_picks_what_the_direct_search_picks():
    torch.manual_seed(0)
    x = _inputs(512, 128)
    linears = [nn.Linear(128, 96, bias=False), nn.Linear(128, 32, bias=False)]
    assert torch.equal(awq.search_scales(x, linears, 32), _search_scales_directly(x, linears, 32))


def test_wide_layers_are_searched_like_narrow_ones():
    """More inputs than calibration tokens: the error straight from the outputs, the same picks."""
    x = _inputs(96, 128)
    linears = [nn.Linear(128, 64, bias=False)]
    assert torch.equal(awq.search_scales(x, linears, 32), _search_scales_directly(x, linears, 32))


def test_clip_search_keeps_the_limits_the_direct_search_keeps():
    torch.manual_seed(0)
    x = _inputs(512, 128)
    lin = nn.Linear(128, 300, bias=False)  # two blocks of rows (256 and 44)
    with torch.no_grad():
        lin.weight[:, :4] *= 8  # outliers: clipping them pays off in some groups and not in others
    original = lin.weight.detach().clone()
    awq.search_clip(x, lin, 32)
    clipped = lin.weight.detach()
    # the direct search: each (row, group)'s error per trial limit, on the outputs themselves
    xg = x.reshape(x.shape[0], 4, 32)
    wg = original.reshape(300, 4, 32)
    reference = torch.einsum("tgk,rgk->trg", xg, wg)
    limit = wg.abs().amax(-1, keepdim=True)
    errors, trials = [], []
    for step in range(awq.CLIP_STEPS):
        trial = limit * (1 - awq.CLIP_SHRINK * step / awq.CLIP_STEPS)
        q = awq.fake_quant(torch.maximum(torch.minimum(wg, trial), -trial).reshape(300, 128), 32).reshape(wg.shape)
        errors.append((torch.einsum("tgk,rgk->trg", xg, q) - reference).pow(2).mean(0))
        trials.append(trial)
    best = torch.stack(errors).argmin(0)  # (rows, groups)
    chosen = torch.stack(trials)[best, torch.arange(300)[:, None], torch.arange(4)[None, :]]
    expected = torch.maximum(torch.minimum(wg, chosen), -chosen).reshape(300, 128)
    shrunk = (expected != original).any(-1)
    assert 0 < int(shrunk.sum()) < 300  # the check means something: some rows clipped, some not
    assert torch.equal(clipped, expected)
