"""AWQ (Lin et al., 2024): activation-aware scales searched per layer group, then 4-bit.

For the linears that read one input (q/k/v after the attention norm, gate/up after
the MLP norm, down after up_proj, o after v_proj when their shapes match), input
channels are scaled by ``s = x_mean**r / w_mean**(1 - r)`` (normalised), the weight
quantized as ``Q(W * s) / s``, and the ratio ``r`` on a grid of 20 chosen for the
least output error on the calibration inputs; ``s`` is folded into the previous op.
Then each output row's clipping range per group is shrunk where that lowers the
error (except q/k, whose errors softmax amplifies).

Both searches score a trial weight ``Wq`` by the mean squared output error over the calibration
tokens, ``mean((x @ D.T) ** 2)`` with ``D = Wq - W`` (no subtraction of two large outputs). Where
the inputs are narrower than the tokens are many (a small model's layers; each clip group), it is
computed as ``sum((D @ G) * D) / (tokens * outputs)`` with the inputs' Gram matrix ``G = x.T @ x``
formed once: the same quantity at ``in_features / tokens`` of the products per trial.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.quantization.rtn import int4_fake_quant as fake_quant
from kiln.quantization.smoothquant import fold_scales

GRID = 20
CLIP_STEPS, CLIP_SHRINK = 10, 0.5
MAX_TOKENS = 4096  # calibration tokens each search evaluates (a seeded subsample beyond that)


def _subsample(x: torch.Tensor, limit: int) -> torch.Tensor:
    if x.shape[0] <= limit:
        return x
    return x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:limit]]


def _output_error(x: torch.Tensor, delta: torch.Tensor, gram: torch.Tensor | None) -> float:
    """``mean((x @ delta.T) ** 2)`` over tokens and outputs; from ``gram = x.T @ x`` when given."""
    if gram is None:
        return (x @ delta.T).pow(2).mean().item()
    return ((delta @ gram) * delta).sum().item() / (x.shape[0] * delta.shape[0])


@torch.no_grad()
def search_scales(x: torch.Tensor, linears: list[nn.Linear], group: int) -> torch.Tensor:
    """The per-input-channel scales for ``linears`` (reading ``x``) with the least output error."""
    x = _subsample(x, MAX_TOKENS)
    weight = torch.cat([lin.weight for lin in linears])
    grouped = weight.abs().reshape(weight.shape[0], -1, group)
    w_mean = (grouped / (grouped.amax(-1, keepdim=True) + 1e-6)).reshape(weight.shape).mean(0)
    x_mean = x.abs().mean(0)
    gram = x.T @ x if x.shape[1] < x.shape[0] else None  # the cheaper of the two forms
    best, best_scales = float("inf"), torch.ones_like(x_mean)
    for step in range(GRID):
        ratio = step / GRID
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        error = _output_error(x, fake_quant(weight * s, group) / s - weight, gram)
        if error < best:
            best, best_scales = error, s
    return best_scales


@torch.no_grad()
def search_clip(x: torch.Tensor, linear: nn.Linear, group: int) -> None:
    """Clamp each (row, group) of the weight to the shrunk range with the least output error."""
    x = _subsample(x, 512)
    w = linear.weight
    rows, cols = w.shape
    xg = x.reshape(x.shape[0], cols // group, group).transpose(0, 1)  # (groups, tokens, group)
    gram = xg.transpose(1, 2) @ xg  # (groups, group, group): each group's inputs' Gram matrix
    for start in range(0, rows, 256):
        wg = w[start : start + 256].reshape(-1, cols // group, group)  # (rows, groups, group)
        limit = wg.abs().amax(-1, keepdim=True)
        best_err = torch.full(limit.shape[:2], float("inf"))
        best_limit = limit.clone()
        for step in range(CLIP_STEPS):
            trial = limit * (1 - CLIP_SHRINK * step / CLIP_STEPS)
            clipped = torch.maximum(torch.minimum(wg, trial), -trial)
            q = fake_quant(clipped.reshape(-1, cols), group).reshape(wg.shape)
            delta = (q - wg).transpose(0, 1)  # (groups, rows, group)
            err = ((delta @ gram) * delta).sum(-1).T / x.shape[0]  # (rows, groups): each one's mean error
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_limit = torch.where(better[..., None], trial, best_limit)
        clipped = torch.maximum(torch.minimum(wg, best_limit), -best_limit)
        w[start : start + 256] = clipped.reshape(-1, cols)


@torch.no_grad()
def scale_and_clip(groups: list[tuple[nn.Module, list[nn.Linear], torch.Tensor]], group: int, no_clip: set) -> None:
    """For each (previous op, linears, their input): search and fold the scales, then clip.
    The inputs of a group whose scales are folded shrink by ``s`` with them."""
    for prev, linears, x in groups:
        s = search_scales(x, linears, group)
        fold_scales(prev, linears, s)
        x = x / s
        for lin in linears:
            if lin not in no_clip:
                search_clip(x, lin, group)
