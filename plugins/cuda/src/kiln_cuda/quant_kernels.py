"""Triton kernels for quantized linear layers (``kiln_cuda.quant`` launches them): per-token int8
activation quantization (with its launcher, ``quantize_per_token``, which the experts' W8A8 GEMM
uses too), the W8A8 int8 GEMM, and the W4A16/W8A16 GEMM that widens packed integer (or fp8)
weights a tile at a time. Results round where ``kiln.interfaces.quantization.ReferenceLinearMethod``
rounds. They run on GPUs, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``).

Every ``tl.dot`` tile is at least 16 x 16 x 16 (int8: K tiles of 32 and more)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_half_even(y):
    """``torch.round`` (ties to even) from exact steps: ``y - floor(y)`` is exact for |y| < 2**23,
    where ``floor(y + 0.5)`` would round 0.49999997 up."""
    f = tl.floor(y)
    frac = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return f + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)


@triton.jit
def quantize_per_token_kernel(x_ptr, q_ptr, scale_ptr, x_stride, K, BLOCK: tl.constexpr):
    """Grid (rows,): scale = max(absmax(x), 1e-10) / 127 and q = clamp(round(x / scale), +-127)
    for one row of x (any float dtype, widened to fp32); q is (rows, K) int8, contiguous. Divisions
    are IEEE (``div_rn``): Triton's ``/`` on fp32 is approximate on GPUs."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        c = start + cols
        x = tl.load(x_ptr + row * x_stride + c, mask=c < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-10), 127.0)
    for start in range(0, K, BLOCK):
        c = start + cols
        x = tl.load(x_ptr + row * x_stride + c, mask=c < K, other=0.0).to(tl.float32)
        q = _round_half_even(tl.math.div_rn(x, scale))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(q_ptr + row * K + c, q.to(tl.int8), mask=c < K)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kiln.interfaces.quantization.quantize_per_token`` in one Triton kernel: rows (M, K) of
    any float dtype (unit stride along K) -> (int8 (M, K), fp32 (M, 1))."""
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(4096, triton.next_power_of_2(k))
        quantize_per_token_kernel[(rows,)](x, q, scale, x.stride(0), k, BLOCK=block)
    return q, scale


@triton.jit
def _store_output(out_ptr, o_stride, bias_ptr, val, rm, rn, M, N, HAS_BIAS: tl.constexpr):
    """Round ``val`` (fp32) to the output dtype, then add the bias rounded to it (as the reference)."""
    dtype = out_ptr.dtype.element_ty
    out = val.to(dtype)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(dtype).to(tl.float32)
        out = (out.to(tl.float32) + bias[None, :]).to(dtype)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * o_stride + rn[None, :], out, mask=mask)


@triton.jit
def int8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, o_stride,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(M, BM), cdiv(N, BN)): out = (a @ w.T) * a_scale * w_scale (+ bias), with a (M, K)
    int8 per-token quantized activations, w (N, K) int8 weights, both contiguous; the products
    sum exactly in int32."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        a = tl.load(a_rows + k[None, :], mask=(rm < M)[:, None] & (k < K)[None, :], other=0)
        w = tl.load(w_rows + k[None, :], mask=(rn < N)[:, None] & (k < K)[None, :], other=0)
        acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
    a_scale = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)
    val = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    _store_output(out_ptr, o_stride, bias_ptr, val, rm, rn, M, N, HAS_BIAS)


@triton.jit
def dequant_gemm_kernel(
    x_ptr, qw_ptr, scale_ptr, zero_ptr, gidx_ptr, bias_ptr, out_ptr, M, N, K, x_stride, o_stride,
    BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZERO: tl.constexpr,
    HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr, FLOAT: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(M, BM), cdiv(N, BN)): out = x @ w (+ bias) with w widened tile by tile in registers.

    ``qw`` (ceil(K / (32 / BITS)), N) int32: word j of column n holds the unsigned codes of inputs
    8j..8j+7 (4-bit) or 4j..4j+3 (8-bit), input 8j + i in bits 4i..4i+3; with ``FLOAT``, (K, N)
    float8 codes, one per input (fp8 checkpoints). ``scale``/``zero``
    (groups, N) fp32; w = (code - zero) * scale, rounded to x's dtype, then multiplied with fp32
    accumulation. Without ``HAS_ZERO`` the zero point is the constant ``ZERO``. The group of input
    k is ``k // GROUP`` (BK divides GROUP: one scale row per tile), or with ``HAS_GIDX``
    ``gidx[k]`` (int32 (K,)), read per input."""
    PACK: tl.constexpr = 32 // BITS
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    dtype = x_ptr.dtype.element_ty
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    n_mask = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * x_stride
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        k_mask = k < K
        tile_mask = k_mask[:, None] & n_mask[None, :]
        a = tl.load(x_rows + k[None, :], mask=(rm < M)[:, None] & k_mask[None, :], other=0.0)
        if FLOAT:
            codes = tl.load(qw_ptr + k[:, None] * N + rn[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        else:
            words = tl.load(qw_ptr + (k // PACK)[:, None] * N + rn[None, :], mask=tile_mask, other=0)
            codes = ((words >> ((k % PACK) * BITS)[:, None]) & CODE_MASK).to(tl.float32)
        if HAS_GIDX:
            group = tl.load(gidx_ptr + k, mask=k_mask, other=0)
            at = group[:, None] * N + rn[None, :]
            scale = tl.load(scale_ptr + at, mask=tile_mask, other=0.0)
            if HAS_ZERO:
                zero = tl.load(zero_ptr + at, mask=tile_mask, other=0.0)
            else:
                zero = ZERO
        else:
            at = (k0 // GROUP) * N + rn
            scale = tl.load(scale_ptr + at, mask=n_mask, other=0.0)[None, :]
            if HAS_ZERO:
                zero = tl.load(zero_ptr + at, mask=n_mask, other=0.0)[None, :]
            else:
                zero = ZERO
        w = ((codes - zero) * scale).to(dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    _store_output(out_ptr, o_stride, bias_ptr, acc, rm, rn, M, N, HAS_BIAS)
