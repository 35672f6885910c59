"""A CPU emulation of exactly the torch_npu ops kiln_ascend calls, following their documented
contracts (signatures, layouts, masks: True = not attended). Installed as ``torch_npu`` in
``sys.modules`` by the tests; real torch_npu cannot be installed without CANN."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__version__ = torch.__version__.split("+")[0] + ".post1"
calls: list[str] = []  # which ops ran, so tests can prove the NPU path was taken


def _attend(q, k, v, scale, masked):
    """q (Sq, N, D), k/v (Skv, KVN, D), masked (Sq, Skv) True = not attended; fp32 math."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    s = torch.einsum("qnd,knd->nqk", q.float(), k) * scale
    s = s.masked_fill(masked[None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with every key masked give 0
    return torch.einsum("nqk,knd->qnd", p, v).to(q.dtype)


def _reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    calls.append("_npu_reshape_and_cache")
    bs = key_cache.shape[1]
    for t, slot in enumerate(slot_indices.tolist()):
        if slot >= 0:
            key_cache[slot // bs, slot % bs] = key[t]
            value_cache[slot // bs, slot % bs] = value[t]


globals()["_npu_reshape_and_cache"] = _reshape_and_cache


def npu_incre_flash_attention(
    query, key, value, *, block_table=None, actual_seq_lengths=None, num_heads=1, scale_value=1.0,
    input_layout="BSH", num_key_value_heads=0, block_size=0, inner_precise=1, **unused,
):  # fmt: skip
    """Decode (Sq = 1) with paged K/V: cache (nb, bs, KVN*D), block_table (B, maxb)."""
    calls.append(f"npu_incre_flash_attention:{inner_precise}")
    assert input_layout == "BSND" and query.shape[1] == 1 and block_table is not None
    batch, _, heads, dim = query.shape
    kv_heads = num_key_value_heads or num_heads
    out = torch.empty_like(query)
    for b in range(batch):
        length = actual_seq_lengths[b]
        pos = torch.arange(length)
        blocks = block_table[b, pos // block_size].long()
        k = key[blocks, pos % block_size].view(length, kv_heads, dim)
        v = value[blocks, pos % block_size].view(length, kv_heads, dim)
        out[b] = _attend(query[b], k, v, scale_value, torch.zeros(1, length, dtype=torch.bool))
    return out


def npu_fused_infer_attention_score(
    query, key, value, *, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
    num_heads=1, scale=1.0, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0, **unused,
):  # fmt: skip
    """BSND, non-paged; sparse_mode 3 = right-down causal (j <= i + Skv - Sq) with the 2048 mask."""
    calls.append(f"npu_fused_infer_attention_score:{inner_precise}")
    assert input_layout == "BSND" and sparse_mode == 3 and atten_mask is not None and atten_mask.shape == (2048, 2048)
    out = torch.zeros_like(query)
    for b in range(query.shape[0]):
        sq, skv = actual_seq_lengths[b], actual_seq_lengths_kv[b]
        i = torch.arange(sq)[:, None]
        j = torch.arange(skv)[None, :]
        masked = j > i + (skv - sq)
        out[b, :sq] = _attend(query[b, :sq], key[b, :skv], value[b, :skv], scale, masked)
    return out, torch.zeros(1)


def npu_rms_norm(x, gamma, epsilon=1e-6):
    calls.append("npu_rms_norm")
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    calls.append("npu_add_rms_norm")
    x_sum = x1 + x2
    y, rstd = npu_rms_norm(x_sum, gamma, epsilon)
    return y, rstd, x_sum


def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
    calls.append("npu_rotary_mul")
    assert rotary_mode == "half" and x.dim() == 4
    x1, x2 = x.chunk(2, dim=-1)
    return x * r1 + torch.cat((-x2, x1), dim=-1) * r2


def npu_swiglu(x, dim=-1):
    calls.append("npu_swiglu")
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b
