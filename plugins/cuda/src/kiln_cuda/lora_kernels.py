"""Triton kernels for multi-LoRA (punica-style shrink and expand) over tokens grouped by slot.

The tokens of a step that use an adapter are listed slot by slot (``token_ids``), and each
group ``g`` is one row of ``groups``: (slot, first index into ``token_ids``, count). Every
program takes one tile of one group's tokens, so tokens of the same adapter share the tile's
loads of its A or B whichever requests they belong to (decodes of several requests included)::

    shrink  h[i, :]       = x[token_ids[i]] @ lora_a[slot].T             (all slices at once)
    expand  y[t, slice s] += h[i, s*R:(s+1)*R] @ lora_b[slot, slice s].T (+ lora_bias[slot, slice s])

``h`` holds one row per listed token and per part of the input features (split-K, so that a
few decode tokens still keep many programs busy on the long reduction), in fp32; the expand
sums the parts in a fixed order (no atomics: runs are reproducible). Tokens not listed (the base
model's) are neither read nor written. Arithmetic is fp32; values round where the reference
(``kiln.interfaces.lora.add_lora``) rounds: h, the product, the biased product, then y.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, token_ptr, group_ptr, x_stride, a_stride_slot, a_stride_row, h_stride, h_stride_split,
    K, NR, K_PER_SPLIT, N_TILES,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid (groups, cdiv(most tokens in a group, BLOCK_M), cdiv(NR, BLOCK_N) * splits), NR = slices
    * rank: split ``p`` sums input features ``p * K_PER_SPLIT ...`` into ``h[p]`` (fp32)."""
    g = tl.program_id(0)
    m_tile = tl.program_id(1)
    n_tile = tl.program_id(2) % N_TILES
    split = tl.program_id(2) // N_TILES
    slot = tl.load(group_ptr + 3 * g)
    first = tl.load(group_ptr + 3 * g + 1)
    count = tl.load(group_ptr + 3 * g + 2)
    if m_tile * BLOCK_M < count:  # the group's tokens may end before this tile
        rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < count
        tokens = tl.load(token_ptr + first + rows, mask=rmask, other=0)
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < NR
        a_base = a_ptr + slot.to(tl.int64) * a_stride_slot
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.minimum(split * K_PER_SPLIT + K_PER_SPLIT, K)
        for k0 in range(split * K_PER_SPLIT, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < k_end
            xt = tl.load(x_ptr + tokens[:, None] * x_stride + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                         other=0.0)  # fmt: skip
            at = tl.load(a_base + cols[None, :] * a_stride_row + ks[:, None], mask=kmask[:, None] & cmask[None, :],
                         other=0.0)  # fmt: skip
            acc += tl.dot(xt.to(at.dtype), at, input_precision="ieee")
        out = h_ptr + split * h_stride_split + (first + rows)[:, None] * h_stride + cols[None, :]
        tl.store(out, acc, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def lora_expand_kernel(
    h_ptr, b_ptr, bias_ptr, y_ptr, token_ptr, group_ptr, bounds_ptr, h_stride, h_stride_split, y_stride,
    b_stride_slot, b_stride_row, bias_stride_slot, R, TILES_PER_SLICE, SPLITS,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Grid (groups, cdiv(most tokens in a group, BLOCK_M), slices * TILES_PER_SLICE): slice ``s``
    writes output columns ``bounds[s] .. bounds[s + 1]`` from columns ``s*R .. (s+1)*R`` of h
    (the sum of its SPLITS parts, rounded to the adapters' dtype)."""
    g = tl.program_id(0)
    m_tile = tl.program_id(1)
    s = tl.program_id(2) // TILES_PER_SLICE
    n_tile = tl.program_id(2) % TILES_PER_SLICE
    slot = tl.load(group_ptr + 3 * g)
    first = tl.load(group_ptr + 3 * g + 1)
    count = tl.load(group_ptr + 3 * g + 2)
    lo = tl.load(bounds_ptr + s)
    hi = tl.load(bounds_ptr + s + 1)
    if (m_tile * BLOCK_M < count) & (lo + n_tile * BLOCK_N < hi):  # a smaller slice has fewer tiles
        rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < count
        tokens = tl.load(token_ptr + first + rows, mask=rmask, other=0)
        cols = lo + n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < hi
        b_base = b_ptr + slot.to(tl.int64) * b_stride_slot
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            kmask = r < R
            h_rows = h_ptr + (first + rows)[:, None] * h_stride + s * R + r[None, :]
            ht = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in range(0, SPLITS):
                ht += tl.load(h_rows + split * h_stride_split, mask=rmask[:, None] & kmask[None, :], other=0.0)
            bt = tl.load(b_base + cols[None, :] * b_stride_row + r[:, None], mask=kmask[:, None] & cmask[None, :],
                         other=0.0)  # fmt: skip
            acc += tl.dot(ht.to(bt.dtype), bt, input_precision="ieee")
        lora_dtype = b_ptr.dtype.element_ty
        delta = acc.to(lora_dtype)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + slot.to(tl.int64) * bias_stride_slot + cols, mask=cmask, other=0.0)
            delta = (delta.to(tl.float32) + bias.to(tl.float32)[None, :]).to(lora_dtype)
        mask = rmask[:, None] & cmask[None, :]
        out = y_ptr + tokens[:, None] * y_stride + cols[None, :]
        y_dtype = y_ptr.dtype.element_ty
        y = tl.load(out, mask=mask, other=0.0).to(tl.float32) + delta.to(y_dtype).to(tl.float32)
        tl.store(out, y.to(y_dtype), mask=mask)
