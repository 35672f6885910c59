"""``fused_experts`` (``kiln.interfaces.model``) on CUDA: the step's (token, slot) pairs sorted by
expert, then one Triton grouped GEMM per projection over them, so each program multiplies a tile
of one expert's rows by that expert's weights::

    order = the slots t * k + j sorted by ids[t, j]; first[e], count[e]: expert e's run in order
    h13[slot] = x[slot // k] @ w13[e].T        (grouped GEMM, rows gathered by token)
    h = silu_and_mul(h13)
    y[slot] = weights[slot] * (h[slot] @ w2[e].T)
    out[t] = y[t * k] + ... + y[t * k + k - 1]

Everything is computed on the device with shapes fixed by the step (no host sync: the grid is
``experts x cdiv(tokens * k, BLOCK_M) x (N tiles x K splits)`` and programs past their expert's
run return at once), so a CUDA graph holds it. With few rows a GEMM has few tiles (for the down
projection of a token or two, fewer than the GPU has multiprocessors): then each tile's inputs
are split into ``gemm_split`` parts, each program sums one part into an fp32 buffer, and the
parts are added in order (deterministic, unlike atomic adds). ``kiln_cuda.ops.fused_experts``
puts the pieces together; under expert parallelism the slots of other ranks' experts (id -1)
are in no run, so no program computes them.

A quantized checkpoint's experts (AWQ, GPTQ without act-order, weight-only int8, fp8) stay
quantized (``QuantizedExperts``): the GEMM widens a tile of an expert's packed codes (or float8
values) in registers, as ``kiln_cuda.quant``'s dequantizing GEMM does for a linear layer,
``(code - zero) * scale`` rounded to the activations' dtype. W8A8 experts (``Int8Experts``) multiply int8 rows, quantized
per token (the first GEMM's per token, the second's per slot), by their int8 weights, summed
exactly in int32 and then scaled per row and per channel, as the W8A8 linear layers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln_cuda.quant_kernels import quantize_per_token


@dataclass(slots=True, eq=False)
class QuantizedExperts:
    """Stacked experts' weights (experts, N, K) kept as integer codes, each expert's (N, K) codes
    packed as ``kiln_cuda.quant.pack_codes`` packs a linear layer's, or as float8 values."""

    qweight: torch.Tensor  # (experts, ceil(K / (32 / bits)), N) int32, unsigned codes; float8: (experts, K, N)
    scale: torch.Tensor  # (experts, groups, N) fp32
    zero: torch.Tensor | None  # (experts, groups, N) fp32; None: every zero point is ``offset``
    bits: int
    group: int  # inputs per group, a multiple of 16 (K for one scale per output)
    offset: float
    shape: tuple[int, int, int]  # of the stacked weight it stands for
    float8: bool = False  # qweight holds float8 values (fp8 checkpoints), one per input


@dataclass(slots=True, eq=False)
class Int8Experts:
    """Stacked W8A8 experts: int8 weights per channel, for int8 activations quantized per row."""

    weight: torch.Tensor  # (experts, N, K) int8
    scale: torch.Tensor  # (experts, N) fp32
    shape: tuple[int, int, int]


@triton.jit
def moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, order_ptr, first_ptr, count_ptr, scale_ptr, a_stride, w_stride_e, w_stride_n, c_stride,
    N, K, TOP_K, qscale_ptr, qzero_ptr, q_stride_e, row_scale_ptr, k_chunk, c_split_stride,
    SPLIT: tl.constexpr, A_BY_TOKEN: tl.constexpr, SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZERO: tl.constexpr,
    INT8: tl.constexpr, FLOAT8: tl.constexpr,
):  # fmt: skip
    """Grid (experts, cdiv(slots, BLOCK_M), cdiv(N, BLOCK_N) * SPLIT): c[slot, n] = a[row] . w[e, n] for the
    slots of expert e's run, row = slot // TOP_K if A_BY_TOKEN else slot, times scale[slot] if SCALE.
    Program (e, m, n * SPLIT + part) sums inputs [part * k_chunk, (part + 1) * k_chunk) (k_chunk: a
    multiple of BLOCK_K; K when SPLIT is 1) into c + part * c_split_stride.
    With ``BITS`` (4 or 8; 0: ``w`` is (experts, N, K) floats), ``w`` is ``QuantizedExperts.qweight``
    (``FLOAT8``: its float8 values, (experts, K, N)) and ``qscale``/``qzero`` its (experts, groups, N)
    scales and zero points (``ZERO`` where not
    ``HAS_ZERO``), the group of input k being ``k // GROUP`` (``BLOCK_K`` divides ``GROUP``, or
    ``GROUP`` is K). With ``INT8``, ``a`` holds int8 rows with
    their scales in ``row_scale`` and ``w`` is ``Int8Experts.weight``, its (experts, N) scales in
    ``qscale``: the products sum in int32."""
    e = tl.program_id(0)
    m_tile = tl.program_id(1)
    first = tl.load(first_ptr + e)
    count = tl.load(count_ptr + e)
    if m_tile * BLOCK_M < count:
        idx = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = idx < count
        slots = tl.load(order_ptr + first + idx, mask=rmask, other=0)
        rows = slots // TOP_K if A_BY_TOKEN else slots
        part = tl.program_id(2) % SPLIT
        cols = tl.program_id(2) // SPLIT * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_base = w_ptr + e.to(tl.int64) * w_stride_e
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if INT8:
            iacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(part * k_chunk, tl.minimum(K, (part + 1) * k_chunk), BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            at = tl.load(a_ptr + rows[:, None] * a_stride + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                         other=0)  # fmt: skip
            tile_mask = kmask[:, None] & cmask[None, :]
            if INT8:
                wt = tl.load(w_base + cols[None, :] * w_stride_n + ks[:, None], mask=tile_mask, other=0)
                iacc = tl.dot(at, wt, iacc, out_dtype=tl.int32)
            elif BITS:
                if FLOAT8:
                    codes = tl.load(w_base + ks[:, None] * N + cols[None, :], mask=tile_mask, other=0.0)
                    codes = codes.to(tl.float32)
                else:
                    # Each word is read once and widened to its PACK inputs; the tile lies in one
                    # group (BLOCK_K divides GROUP), so a scale and a zero point per column serve it.
                    PACK: tl.constexpr = 32 // BITS
                    wk = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
                    wmask = (wk < tl.cdiv(K, PACK))[:, None] & cmask[None, :]
                    words = tl.load(w_base + wk[:, None] * N + cols[None, :], mask=wmask, other=0)
                    words = tl.broadcast_to(words[:, None, :], (BLOCK_K // PACK, PACK, BLOCK_N))
                    words = tl.reshape(words, (BLOCK_K, BLOCK_N))
                    codes = ((words >> ((ks % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
                at_group = e.to(tl.int64) * q_stride_e + (k0 // GROUP) * N + cols
                qscale = tl.load(qscale_ptr + at_group, mask=cmask, other=0.0)[None, :]
                if HAS_ZERO:
                    zero = tl.load(qzero_ptr + at_group, mask=cmask, other=0.0)[None, :]
                else:
                    zero = ZERO
                wt = ((codes - zero) * qscale).to(at.dtype)
                acc += tl.dot(at, wt, input_precision="ieee")
            else:
                wt = tl.load(w_base + cols[None, :] * w_stride_n + ks[:, None], mask=tile_mask, other=0.0)
                acc += tl.dot(at, wt, input_precision="ieee")
        if INT8:
            row_scale = tl.load(row_scale_ptr + rows, mask=rmask, other=0.0)
            channel_scale = tl.load(qscale_ptr + e.to(tl.int64) * q_stride_e + cols, mask=cmask, other=0.0)
            acc = iacc.to(tl.float32) * row_scale[:, None] * channel_scale[None, :]
        if SCALE:
            acc = acc * tl.load(scale_ptr + slots, mask=rmask, other=0.0)[:, None]
        out = c_ptr + part * c_split_stride + slots[:, None] * c_stride + cols[None, :]
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def expert_runs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots ``t * k + j`` of ``ids`` sorted by expert, and where each expert's run starts in
    that order and how long it is: (order, first, count). Slots of another rank's experts (-1)
    sort first and belong to no run: no program computes them."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ranked, experts = flat[order], torch.arange(num_experts, device=ids.device, dtype=flat.dtype)
    first = torch.searchsorted(ranked, experts)
    return order, first, torch.searchsorted(ranked, experts, right=True) - first


# (rows per expert at most, (BLOCK_M, BLOCK_N, BLOCK_K)): the tiles ``bench/moe_kernels.py`` timed
# best on an H200 at Mixtral-8x7B's sizes. Taller tiles as each expert gets more rows; packed
# codes take wider ones while the rows are few, int8 rows longer K tiles.
TILES = {
    "float": ((32, (32, 64, 128)), (math.inf, (64, 128, 64))),
    "packed": ((1, (16, 64, 64)), (8, (16, 128, 128)), (32, (32, 128, 64)), (math.inf, (64, 128, 64))),
    "int8": ((1, (16, 64, 64)), (8, (16, 64, 128)), (32, (32, 64, 128)), (math.inf, (64, 128, 64))),
}


def gemm_tile(w: torch.Tensor | QuantizedExperts | Int8Experts, slots: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the grouped GEMM for ``slots`` rows over ``w``'s experts."""
    kind = "packed" if isinstance(w, QuantizedExperts) else "int8" if isinstance(w, Int8Experts) else "float"
    rows = slots / w.shape[0]  # per expert, were they spread evenly
    bm, bn, bk = next(tile for most, tile in TILES[kind] if rows <= most)
    return bm, bn, group_k(w, bk)


# A GEMM with fewer programs than this (about four per multiprocessor of an H100 or H200) splits
# its inputs, down to one K tile per part.
PROGRAMS = 512
MAX_SPLIT = 16


def gemm_split(experts: int, slots: int, n: int, k: int, tile: tuple[int, int, int]) -> int:
    """Parts each output tile's K inputs are split into (a power of two; 1: none), so that the
    grouped GEMM of ``slots`` rows over ``experts`` has about ``PROGRAMS`` programs with rows."""
    block_m, block_n, block_k = tile
    busy = min(experts, slots)  # experts with rows, at most
    programs = busy * triton.cdiv(triton.cdiv(slots, busy), block_m) * triton.cdiv(n, block_n)
    split = 1
    while split < MAX_SPLIT and programs * split * 2 <= PROGRAMS and k >= split * 2 * block_k:
        split *= 2
    return split


def group_k(w: torch.Tensor | QuantizedExperts | Int8Experts, bk: int) -> int:
    """``bk`` (a power of two), halved until a K tile lies in one of ``w``'s groups (16 at least:
    ``process_experts`` takes groups of a multiple of 16 inputs only)."""
    while isinstance(w, QuantizedExperts) and w.group < w.shape[2] and w.group % bk:
        bk //= 2
    return bk


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor | QuantizedExperts | Int8Experts,
    runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slots: int,
    scale: torch.Tensor | None = None,
    top_k: int = 1,
    by_token: bool = False,
) -> torch.Tensor:
    """(slots, N): each slot's row of ``a`` (its token's, ``slot // top_k``, if ``by_token``) times
    its expert's (N, K) weight of ``w`` (stacked floats, ``QuantizedExperts`` or ``Int8Experts``:
    then ``a``'s rows are quantized to int8 per row first), times ``scale[slot]`` if given."""
    order, first, count = runs
    experts, n, k = w.shape
    block_m, block_n, block_k = gemm_tile(w, slots)
    split = gemm_split(experts, slots, n, k, (block_m, block_n, block_k))
    chunk = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, chunk)
    # Slots in no run stay 0. The parts of a split sum in fp32 and are rounded once, added up.
    out = torch.zeros((split, slots, n), dtype=a.dtype if split == 1 else torch.float32, device=a.device)
    grid = (experts, triton.cdiv(slots, block_m), triton.cdiv(n, block_n) * split)
    rows, row_scale, bits, int8, float8 = a, out, 0, isinstance(w, Int8Experts), False
    shape = dict(GROUP=1, ZERO=0.0, HAS_ZERO=False)
    if isinstance(w, QuantizedExperts):
        weight, strides, bits, float8 = w.qweight, (w.qweight.stride(0), 0), w.bits, w.float8
        quant = (w.scale, w.scale if w.zero is None else w.zero, w.scale.stride(0))
        shape = dict(GROUP=w.group, ZERO=w.offset, HAS_ZERO=w.zero is not None)
    elif int8:
        rows, row_scale = quantize_per_token(a)
        weight, strides, quant = w.weight, (w.weight.stride(0), w.weight.stride(1)), (w.scale, out, w.scale.stride(0))
    else:
        weight, strides, quant = w, (w.stride(0), w.stride(1)), (out, out, 0)
    moe_gemm_kernel[grid](
        rows, weight, out, order, first, count, out if scale is None else scale, rows.stride(0), *strides,
        out.stride(1), n, k, top_k, *quant, row_scale, chunk, out.stride(0), SPLIT=split, A_BY_TOKEN=by_token,
        SCALE=scale is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BITS=bits, INT8=int8,
        FLOAT8=float8, **shape,
    )  # fmt: skip
    return out[0] if split == 1 else out.sum(dim=0).to(a.dtype)
