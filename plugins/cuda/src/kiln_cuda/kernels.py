"""Triton kernels written for Kiln. Arithmetic is fp32 whatever the storage dtype; results round
where the torch reference ops (``kiln.interfaces.model``) round. They run on GPUs, and on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1``), which is how this project's machines test them."""

from __future__ import annotations

import triton
import triton.language as tl


def rows_per_program(width: int) -> int:
    """Rows a program of the row-wise kernels below takes: up to 4096 values in all (one row of a
    large model's hidden size; 16 of a small one's, fewer programs for the same work), a power of two."""
    return max(1, min(16, 4096 // triton.next_power_of_2(width)))


@triton.jit
def reshape_and_cache_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, tokens, k_stride, v_stride, plane_stride, inv_k_scale, inv_v_scale,
    KVN: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(tokens, TOKENS),): each KV head's K and V row of TOKENS tokens t into slot
    ``slot_ptr[t]``; slot < 0 is padding. The cache is (2, blocks, block_size, kv_heads, D): slot
    s, head h is row ``s * KVN + h``. Values are stored as ``k * inv_k_scale`` in the cache's
    dtype (fp8 caches; 1.0 otherwise). A block row is (token, head)."""
    r = tl.arange(0, TOKENS * BLOCK_H)
    t = tl.program_id(0) * TOKENS + r // BLOCK_H
    h = (r % BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    slot = tl.load(slot_ptr + t, mask=t < tokens, other=-1).to(tl.int64)[:, None]
    mask = (h < KVN) & (d < D) & (slot >= 0)
    row = tl.where(slot >= 0, slot, 0) * KVN + h
    k = tl.load(k_ptr + t[:, None] * k_stride + h * D + d, mask=mask)
    v = tl.load(v_ptr + t[:, None] * v_stride + h * D + d, mask=mask)
    dtype = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + row * D + d, (k.to(tl.float32) * inv_k_scale).to(dtype), mask=mask)
    tl.store(cache_ptr + plane_stride + row * D + d, (v.to(tl.float32) * inv_v_scale).to(dtype), mask=mask)


@triton.jit
def paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, tile_seq_ptr, tile_first_ptr,
    tile_len_ptr, token_pos_ptr, block_table_ptr, bt_stride, q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    plane_stride, scale, window, softcap,
    H: tl.constexpr, KVN: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Grid (query tiles, kv heads, SPLITS): prefill chunks and decodes alike. A tile is up to
    ``BLOCK_M // GROUP`` consecutive query tokens of one request (``tile_len`` of them from token
    ``tile_first``), and a program takes them with the GROUP query heads that share KV head ``kvh``:
    BLOCK_M rows of (token, head), so each K/V tile is read once for all of them, and scores and
    weighted values are fp32 dots. Token t at absolute position ``pos`` attends to cache positions
    pos - window + 1..pos (from 0 where that is negative; ``window`` is the sliding window, or
    larger than any position without one): causal within the new tokens, over the cached context
    as far as the window reaches, reading K/V through the block table, with online softmax. Keys
    before the window are not read. With SPLITS > 1 (flash-decoding, for tiles of one decode) each
    program covers one slice of those keys and leaves each row's unnormalised output, max and sum
    for ``reduce_splits_kernel``; with soft-capping (``SOFTCAP``) scores first become
    ``softcap * tanh(score / softcap)`` (Gemma 2)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    start = tl.load(tile_first_ptr + tile)
    count = tl.load(tile_len_ptr + tile)
    r = tl.arange(0, BLOCK_M)
    rmask = r < count * GROUP
    t = start + r // GROUP
    n = kvh * GROUP + r % GROUP
    pos = tl.load(token_pos_ptr + t, mask=rmask, other=-1)  # padding rows see no key
    first = tl.maximum(pos + 1 - window, 0)
    last = pos
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    io_mask = rmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + t[:, None] * q_stride_t + n[:, None] * q_stride_h + d[None, :], mask=io_mask, other=0.0)
    q = q.to(tl.float32)
    # Keys from the first token's window to the last token's position.
    low = tl.maximum(tl.load(token_pos_ptr + start) + 1 - window, 0)
    high = tl.max(pos, axis=0) + 1
    if SPLITS > 1:
        chunk = tl.cdiv(high - low, SPLITS)
        low = low + split * chunk
        high = tl.minimum(low + chunk, high)
        first = tl.maximum(first, low)
        last = tl.minimum(last, high - 1)
    table_row = block_table_ptr + seq * bt_stride
    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for tile_start in range(low, high, TILE):
        j = tile_start + tl.arange(0, TILE)
        jmask = j < high
        block = tl.load(table_row + j // BS, mask=jmask, other=0)
        keys = (block * BS + j % BS) * KVN + kvh
        kt = tl.load(cache_ptr + keys[None, :] * D + d[:, None], mask=dmask[:, None] & jmask[None, :], other=0.0)
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee") * scale
        if SOFTCAP:  # tanh from exp, which saturates to +-1 where exp overflows or vanishes
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where((j[None, :] >= first[:, None]) & (j[None, :] <= last[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf) = 0, not NaN
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        v = tl.load(cache_ptr + plane_stride + keys[:, None] * D + d[None, :], mask=jmask[:, None] & dmask[None, :],
                    other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    if SPLITS > 1:
        part = (t * H + n) * SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=rmask[:, None])
        tl.store(part_max_ptr + part, m, mask=rmask)
        tl.store(part_sum_ptr + part, denom, mask=rmask)
    else:
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out_ptr + t[:, None] * o_stride_t + n[:, None] * o_stride_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)  # fmt: skip


@triton.jit
def encoder_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
    v_stride_t, v_stride_h, o_stride_t, o_stride_h, scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (sequences, heads, cdiv(longest, BLOCK_M)): queries ``BLOCK_M * tile ...`` of sequence
    ``s`` (tokens ``starts[s]..starts[s + 1]`` of the flattened q/k/v, no cache) against every key
    of that sequence, in both directions, with online softmax. Scores are fp32 dots of the stored
    q and k; the weights are rounded to the storage dtype for the dot with v (flash attention's
    usual trade: exact in fp32, about 1e-3 relative in fp16)."""
    s = tl.program_id(0)
    n = tl.program_id(1)
    tile = tl.program_id(2)
    start = tl.load(starts_ptr + s)
    end = tl.load(starts_ptr + s + 1)
    rows = start + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < end
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    kvh = n // GROUP
    q = tl.load(q_ptr + rows[:, None] * q_stride_t + n * q_stride_h + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last = tl.where(start + tile * BLOCK_M < end, end, start)  # a tile past the sequence reads no keys
    for first in range(start, last, BLOCK_N):
        cols = first + tl.arange(0, BLOCK_N)
        cmask = cols < end
        kt = tl.load(k_ptr + cols[None, :] * k_stride_t + kvh * k_stride_h + d[:, None],
                     mask=dmask[:, None] & cmask[None, :], other=0.0)  # fmt: skip
        scores = tl.dot(q, kt, input_precision="ieee") * scale
        scores = tl.where(cmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + cols[:, None] * v_stride_t + kvh * v_stride_h + d[None, :],
                    mask=cmask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # rows of a tile past the sequence: 0, not 0/0
    tl.store(out_ptr + rows[:, None] * o_stride_t + n * o_stride_h + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])  # fmt: skip


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr, w_ptr, out_ptr, rows, x_stride, dim, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(rows, ROWS),): out = w * round(x * rsqrt(mean(x^2) + eps)) for ROWS rows; with a
    residual, first residual = round(x + residual) (stored back) and that is normalised."""
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS))[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (c < dim)
    x = tl.load(x_ptr + row * x_stride + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * dim + c, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * dim + c, x, mask=mask)
        x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / dim + eps)
    y = (x * inv[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < dim, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + c, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    pos_ptr, x_ptr, cache_ptr, tokens, x_stride_t, x_stride_h, heads,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, NEOX: tl.constexpr,
    TOKENS: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(tokens, TOKENS),), in place on every head of TOKENS tokens (a block row is
    (token, head)). NeoX pairs i with i + D/2; GPT-J pairs 2i with 2i + 1. The cache row of a
    position is cos (D/2) then sin (D/2), fp32."""
    r = tl.arange(0, TOKENS * BLOCK_H)
    t = tl.program_id(0) * TOKENS + r // BLOCK_H
    h = (r % BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK)[None, :]
    live = t < tokens
    pos = tl.load(pos_ptr + t, mask=live, other=0)[:, None]
    mask = live[:, None] & (h < heads) & (i < HALF)
    cos = tl.load(cache_ptr + pos * D + i, mask=mask, other=0.0)
    sin = tl.load(cache_ptr + pos * D + HALF + i, mask=mask, other=0.0)
    base = x_ptr + t[:, None] * x_stride_t + h * x_stride_h
    if NEOX:
        first, second = base + i, base + HALF + i
    else:
        first, second = base + 2 * i, base + 2 * i + 1
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(second, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, rows, d, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Grid (cdiv(rows, ROWS), cdiv(d, BLOCK)): out = round(silu(gate)) * up, with x = [gate | up]."""
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS))[:, None]
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (row < rows) & (c < d)
    gate = tl.load(x_ptr + row * 2 * d + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * d + d + c, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * d + c, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reduce_splits_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, o_stride_t, o_stride_h,
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Grid (decodes, heads): combine the slices (empty ones weigh nothing)."""
    r = tl.program_id(0)
    n = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    base = (r * H + n) * SPLITS
    maxes = tl.load(part_max_ptr + base + splits)
    weights = tl.exp(maxes - tl.max(maxes, axis=0))
    total = tl.sum(weights * tl.load(part_sum_ptr + base + splits), axis=0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + (base + splits)[:, None] * BLOCK_D + d[None, :])
    out = tl.sum(weights[:, None] * acc, axis=0) / total
    tl.store(out_ptr + r * o_stride_t + n * o_stride_h + d, out.to(out_ptr.dtype.element_ty), mask=d < D)
