"""The GGUF blocks an fp32 weight was widened from, recovered from its values alone.

A GGUF file stores most weights as small integer codes with a float scale (and often a min)
per 32 or 16 values; the loader widens them to fp32. Each recovery here rebuilds codes, scales
and mins of one GGUF type from the values and is kept only where widening them again gives
every value bit for bit (``kiln_cpu.tiled_weights`` checks the kernels' own widening once
more). The codes times the scales are exact in fp32 for the types here, so a fused
multiply-add rounds as ggml's multiply-then-add does; the one rounding left is adding the
min, and a K-quant block whose min is so much larger than its scale that this rounds (never
seen in llama.cpp's files) keeps its weight in fp32. No file format or tensor name is
involved: a weight from other sources fails on its first rows. A weight whose rows come from tensors of several
types (a fused q/k/v projection of a Q4_K_M file) is recovered in row ranges and held as 8-bit
codes with a min, the one form every type fits. Rows of int8 codes with one scale each (the
experts of a per-channel int8 checkpoint, which the core widens at load) are recovered too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("kiln.cpu")

BLOCK = 32  # values per scale (Q6_K's per 16)
CHUNK_ROWS = 1024  # rows recovered and checked at a time: bounds the temporary copies
_RUN_ROWS = 16  # rows recovered as one type at least (the tiled kernels pass their tile height)
_TRIAL_VALUES = 1 << 22  # values one batch of trials computes: bounds the temporaries


@dataclass(slots=True, eq=False)
class Blocks:
    """value = code * scale + min. ``fmt`` 4: codes 0..15 (Q4_0/Q4_1/Q4_K), scale and min per
    32 values; 8: int8 codes, a scale per 32, a min per 32 or None (Q8_0, Q5_0, IQ4_NL, IQ4_XS
    without; Q5_1, Q5_K with); 6: int8 codes, a scale per 16 (Q3_K, Q6_K), a min per 32 or None.
    ``codes`` (N, K) int8, ``scale`` (N, K/32) or (N, K/16), ``min`` (N, K/32)."""

    fmt: int
    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None

    def values(self) -> torch.Tensor:
        per_scale = self.codes.shape[1] // self.scale.shape[1]
        out = self.codes.float() * self.scale.repeat_interleave(per_scale, dim=1)
        return out if self.min is None else out + self.min.repeat_interleave(BLOCK, dim=1)


def _q4_1(w: torch.Tensor) -> Blocks:
    blocks = w.view(w.shape[0], -1, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    # GGUF stores the scale as fp16: (max - min) / 15 rounds back to it.
    scale = ((high - low) / 15).half().float()
    q = torch.where(scale[..., None] > 0, (blocks - low[..., None]) / scale[..., None], 0.0)
    return Blocks(4, q.round().clamp(0, 15).to(torch.int8).view(w.shape), scale, low)


def _q8_0(w: torch.Tensor) -> Blocks:
    blocks = w.view(w.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(-1) / 127
    q = torch.where(scale[..., None] > 0, blocks / scale[..., None], 0.0)
    return Blocks(8, q.round().clamp(-127, 127).to(torch.int8).view(w.shape), scale, None)


def _first_fit(
    live: torch.Tensor, size: int, attempt: Callable[[torch.Tensor | None, list], tuple], params: list
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, the scale and codes of the first of ``params`` that fits it (zeros where none
    does or the block is not ``live``). ``attempt(index, params)`` tries ``params`` on the blocks
    at ``index`` (every block when None): scales (params, blocks, 1), codes (params, blocks,
    size) and fits (params, blocks). The first param sees every block, in place; the rest go in
    batches over the blocks left (a weight of other values fails them all: one param at a time
    would be dozens of small steps per weight)."""
    scale, codes, fits = attempt(None, params[:1])
    fits = fits[0] & live
    scale, codes = torch.where(fits[:, None], scale[0], 0.0), torch.where(fits[:, None], codes[0], 0.0)
    todo, start = (live & ~fits).nonzero()[:, 0], 1
    while start < len(params) and todo.numel():
        count = max(1, _TRIAL_VALUES // (todo.numel() * size))
        s, c, fits = attempt(todo, params[start : start + count])
        hit = fits.any(0)
        first, at = fits.byte().argmax(0)[hit], hit.nonzero()[:, 0]  # argmax: the first fitting param
        scale[todo[hit]], codes[todo[hit]] = s[first, at], c[first, at]
        todo, start = todo[~hit], start + count
    return scale, codes


def _scaled_codes(
    w: torch.Tensor, tries: list[int], lo: int, hi: int, size: int = BLOCK, neighbours: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and codes lo..hi with value = c * d per ``size`` values: each block takes the first
    code k of ``tries`` for which d = (its value of largest magnitude) / k gives every value a
    whole code in range; with ``neighbours``, failing d, the fp32 next to it away from zero, then
    the one towards zero (the value was rounded when a checkpoint's scale was not a whole fraction
    of it)."""
    blocks = w.reshape(-1, size)
    top = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # (blocks, 1)
    live = top[:, 0] != 0  # an all-zero block: d 0, codes 0

    def attempt(index: torch.Tensor | None, trials: list[tuple[int, int]]) -> tuple:
        rest, near = (blocks, top) if index is None else (blocks[index], top[index])
        near = near / torch.tensor([float(k) for k, _ in trials]).view(-1, 1, 1)
        which = torch.tensor([i for _, i in trials]).view(-1, 1, 1)
        away, towards = torch.nextafter(near, near * 2), torch.nextafter(near, torch.zeros_like(near))
        trial = torch.where(which == 0, near, torch.where(which == 1, away, towards))
        c = (rest / trial).round()
        return trial, c, ((c * trial == rest) & (c >= lo) & (c <= hi)).all(-1)

    trials = [(k, i) for k in tries for i in range(3 if neighbours else 1)]
    d, codes = _first_fit(live, size, attempt, trials)
    return d.view(w.shape[0], -1), codes.clamp(lo, hi).to(torch.int8).view(w.shape)


def _signed(w: torch.Tensor, half: int, size: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q4_0 (``half`` 8), Q5_0 (16) or, per 16 values (``size``), Q6_K (32): value = c * d,
    c in -half..half-1. ggml's reference quantizer gives the block's value of largest magnitude
    c = -half; with an importance matrix llama.cpp fits d, and that value may take any code: so
    the codes from -half on are tried in turn."""
    return _scaled_codes(w, [*range(-half, 0), *range(half - 1, 0, -1)], -half, half - 1, size)


def _q4_0(w: torch.Tensor) -> Blocks:
    d, codes = _signed(w, 8)  # as Q4_1: nibble c + 8 times d, plus -8 d
    return Blocks(4, codes + 8, d, -8 * d)


def _q5_0(w: torch.Tensor) -> Blocks:
    d, codes = _signed(w, 16)  # as Q8_0: int8 codes -16..15 times d
    return Blocks(8, codes, d, None)


def _q6_k(w: torch.Tensor) -> Blocks:
    d, codes = _signed(w, 32, 16)  # int8 codes -32..31, a scale per 16 values (Q3_K's -4..3 too)
    return Blocks(6, codes, d, None)


# IQ4_NL's and IQ4_XS's 16 values (int8): a code indexes them, times the block's scale
_IQ4_VALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def _iq4(w: torch.Tensor) -> Blocks:
    d, codes = _scaled_codes(w, _IQ4_VALUES, -127, 127)  # the looked-up values are the int8 codes
    return Blocks(8, codes, d, None)


def _affine(w: torch.Tensor, levels: int) -> Blocks:
    """Codes 0..levels-1 with a scale and min per block whose scale is no fp16 of its range:
    the K-quants' (Q4_K, Q5_K: a 6-bit multiple of the super-block's fp16 scale, so a block's
    codes need not span 0..levels-1), and Q5_1's. Each block takes its smallest value as the
    min and the first step (max - min) / n, for spans n = levels-1, levels-2..., that gives
    every value a whole code with code * step exact: the first span tried on every block, each
    later one on the blocks none fitted yet."""
    blocks = w.reshape(-1, BLOCK)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    live = (low != high)[:, 0]  # a constant block: scale 0, every code 0

    def attempt(index: torch.Tensor | None, spans: list[int]) -> tuple:
        rest, rest_low, rest_high = (blocks, low, high) if index is None else (blocks[index], low[index], high[index])
        step = (rest_high - rest_low) / torch.tensor([float(n) for n in spans]).view(-1, 1, 1)
        c = ((rest - rest_low) / step).round()
        product = c * step
        exact = (product.double() == c.double() * step.double()).all(-1)
        return step, c, (product + rest_low == rest).all(-1) & exact

    scale, codes = _first_fit(live, BLOCK, attempt, list(range(levels - 1, 0, -1)))
    codes = codes.clamp(0, levels - 1).to(torch.int8).view(w.shape)
    return Blocks(4 if levels == 16 else 8, codes, scale.view(w.shape[0], -1), low.view(w.shape[0], -1))


def _q4_k(w: torch.Tensor) -> Blocks:
    return _affine(w, 16)


def _q5(w: torch.Tensor) -> Blocks:
    return _affine(w, 32)  # Q5_1 and Q5_K: 5-bit codes in 8-bit tiles, with a min


Recovery = Callable[[torch.Tensor], Blocks]


def _int8_rows(w: torch.Tensor) -> Blocks:
    """int8 codes with one scale per row (per-channel int8 checkpoints: their quantizers give
    each row's largest magnitude the code 127, or -128), as Q8_0's form with the row's scale in
    every block."""
    scale, codes = _scaled_codes(w, [127, -128], -128, 127, size=w.shape[1], neighbours=True)
    return Blocks(8, codes, scale.expand(-1, w.shape[1] // BLOCK).contiguous(), None)


_RECOVERIES: tuple[Recovery, ...] = (_q4_1, _q4_0, _q8_0, _q5_0, _q4_k, _q5, _q6_k, _iq4, _int8_rows)


def _fitting_rows(recover: Recovery, rows: torch.Tensor) -> tuple[Blocks, torch.Tensor]:
    """``recover``'s blocks of ``rows``, and which rows they widen back to bit for bit."""
    blocks = recover(rows)
    values = blocks.values()
    if torch.equal(values, rows):  # the usual answer, without a comparison per value kept
        return blocks, torch.ones(rows.shape[0], dtype=torch.bool)
    return blocks, (values == rows).all(-1)


def _rows(blocks: Blocks, start: int, stop: int) -> Blocks:
    low = None if blocks.min is None else blocks.min[start:stop]
    return Blocks(blocks.fmt, blocks.codes[start:stop], blocks.scale[start:stop], low)


def _concat(parts: list[Blocks]) -> Blocks:
    """Row ranges as one ``Blocks``: as they are when all share a format, else int8 codes with
    a scale per 16 values if any part has one (Q6_K), and a min wherever one has a min."""
    if len(parts) == 1:
        return parts[0]
    fmt = parts[0].fmt if len({p.fmt for p in parts}) == 1 else (6 if any(p.fmt == 6 for p in parts) else 8)
    scales = [p.scale.repeat_interleave(2, dim=1) if fmt == 6 and p.fmt != 6 else p.scale for p in parts]
    low = None
    if any(p.min is not None for p in parts):
        low = torch.cat([torch.zeros(p.codes.shape[0], p.codes.shape[1] // BLOCK) if p.min is None else p.min
                         for p in parts])  # fmt: skip
    return Blocks(fmt, torch.cat([p.codes for p in parts]), torch.cat(scales), low)


def _ranges(rows: torch.Tensor, order: tuple[Recovery, ...], step: int) -> list[tuple[Recovery, Blocks]] | None:
    """``rows`` in runs of ``step`` rows, each recovered by the first of ``order`` that fits all
    of its rows, or None when one fits no type. A type is tried on the first row of each run
    left before the runs themselves: a run it fails there it cannot fit."""
    count = (rows.shape[0] + step - 1) // step
    left = torch.ones(count, dtype=torch.bool)
    found: list[tuple[Recovery, Blocks, int, int] | None] = [None] * count  # a run's recovery, its rows in that
    for recover in order:
        runs = left.nonzero()[:, 0]
        if runs.numel() == 0:
            break
        tried = runs[_fitting_rows(recover, rows[runs * step])[1]]
        if tried.numel() == 0:
            continue
        if tried.numel() == count:
            taken = rows
        else:
            picked = (tried[:, None] * step + torch.arange(step)).flatten()
            taken = rows[picked[picked < rows.shape[0]]]
        blocks, fits = _fitting_rows(recover, taken)
        fits = torch.cat([fits, fits.new_ones(tried.numel() * step - fits.numel())])  # the last run may be short
        ok = fits.view(-1, step).all(-1)  # per tried run, the i-th at rows i * step.. of blocks
        left[tried[ok]] = False
        for i, run in zip(ok.nonzero()[:, 0].tolist(), tried[ok].tolist(), strict=True):
            found[run] = (recover, blocks, i * step, min(i * step + step, taken.shape[0]))
    if left.any():
        return None
    merged: list[tuple[Recovery, Blocks, int, int]] = []
    for recover, blocks, start, stop in found:
        if merged and merged[-1][1] is blocks and merged[-1][3] == start:  # runs next to each other in one recovery
            merged[-1] = (recover, blocks, merged[-1][2], stop)
        else:
            merged.append((recover, blocks, start, stop))
    return [(recover, _rows(blocks, start, stop)) for recover, blocks, start, stop in merged]


def _last_first(order: tuple[Recovery, ...], last: Recovery) -> tuple[Recovery, ...]:
    return (last, *(r for r in order if r is not last))


def recover_blocks(weight: torch.Tensor, step: int = _RUN_ROWS) -> Blocks | None:
    """The blocks fp32 ``weight`` (N, K; K a multiple of 32) was widened from, or None: chunk
    by chunk, in runs of ``step`` rows of one GGUF type each, the type found last tried first.
    A weight of one type comes out in that type's form."""
    order, parts = _RECOVERIES, []
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        found = _ranges(weight[start : start + CHUNK_ROWS], order, step)
        if found is None:
            if parts:  # GGUF blocks up to here: say why the weight stays wide
                logger.info("a %s weight's rows from %d fit no GGUF type: kept in fp32", tuple(weight.shape), start)
            return None
        order = _last_first(order, found[-1][0])
        parts += [blocks for _, blocks in found]
    return _concat(parts)
