"""A CPU emulation of exactly the torch_npu ops kiln_ascend calls, following their documented
contracts (signatures, layouts, masks: True = not attended). Installed as ``torch_npu`` in
``sys.modules`` by the tests; real torch_npu cannot be installed without CANN.

The ops a decode graph contains are, like the real ones, registered torch operators
(``torch.ops.npu.*``), so ``torch.compile`` (the emulated torchair) sees each as one opaque
node with a shape rule instead of tracing into its Python loops. The prefill/eager-only
attention ops (IFA, FIA) stay plain functions: they take keyword-only tensors, which
``torch.library.custom_op`` cannot declare.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import custom_op

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


def _paged_rows(cache, block_table_row, length, block_size):
    """Rows ``[0, length)`` of one request from a (nb, bs, ...) cache plane."""
    pos = torch.arange(length)
    return cache[block_table_row[pos // block_size].long(), pos % block_size]


@custom_op("npu::_npu_reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def _npu_reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:  # fmt: skip
    calls.append("_npu_reshape_and_cache")
    bs = key_cache.shape[1]
    for t, slot in enumerate(slot_indices.tolist()):
        if slot >= 0:
            key_cache[slot // bs, slot % bs] = key[t]
            value_cache[slot // bs, slot % bs] = value[t]


@custom_op("npu::_npu_paged_attention", mutates_args=("out",))
def _npu_paged_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int, num_heads: int,
    scale_value: float, block_table: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
) -> None:  # fmt: skip
    """ATB decode attention: query/out (B, N, D), caches (nb, bs, KVN, D), context_lens int32 (B,)."""
    calls.append("_npu_paged_attention")
    assert query.shape[1] == num_heads and key_cache.shape[2] == num_kv_heads and context_lens.dtype == torch.int32
    bs = key_cache.shape[1]
    for b, length in enumerate(context_lens.tolist()):
        k = _paged_rows(key_cache, block_table[b], length, bs)
        v = _paged_rows(value_cache, block_table[b], length, bs)
        out[b] = _attend(query[b : b + 1], k, v, scale_value, torch.zeros(1, length, dtype=torch.bool))[0]


def npu_incre_flash_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, block_table: torch.Tensor | None = None,
    actual_seq_lengths: list[int] | None = None, num_heads: int = 1, scale_value: float = 1.0,
    input_layout: str = "BSH", num_key_value_heads: int = 0, block_size: int = 0, inner_precise: int = 1,
) -> torch.Tensor:  # fmt: skip
    """Decode (Sq = 1) with paged K/V: cache (nb, bs, KVN*D), block_table (B, maxb)."""
    calls.append(f"npu_incre_flash_attention:{inner_precise}")
    assert input_layout == "BSND" and query.shape[1] == 1 and block_table is not None
    batch, _, heads, dim = query.shape
    kv_heads = num_key_value_heads or num_heads
    out = torch.empty_like(query)
    for b in range(batch):
        length = actual_seq_lengths[b]
        k = _paged_rows(key, block_table[b], length, block_size).view(length, kv_heads, dim)
        v = _paged_rows(value, block_table[b], length, block_size).view(length, kv_heads, dim)
        out[b] = _attend(query[b], k, v, scale_value, torch.zeros(1, length, dtype=torch.bool))
    return out


def npu_fused_infer_attention_score(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: list[int] | None = None, actual_seq_lengths_kv: list[int] | None = None,
    num_heads: int = 1, scale: float = 1.0, input_layout: str = "BSH", num_key_value_heads: int = 0,
    sparse_mode: int = 0, inner_precise: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
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


@custom_op("npu::npu_rms_norm", mutates_args=())
def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    calls.append("npu_rms_norm")
    return _rms_norm(x, gamma, epsilon)


def _rms_norm(x, gamma, epsilon):
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


@custom_op("npu::npu_add_rms_norm", mutates_args=())
def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    calls.append("npu_add_rms_norm")
    x_sum = x1 + x2
    y, rstd = _rms_norm(x_sum, gamma, epsilon)
    return y, rstd, x_sum


@custom_op("npu::npu_rotary_mul", mutates_args=())
def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    calls.append("npu_rotary_mul")
    assert rotary_mode == "half" and x.dim() == 4
    x1, x2 = x.chunk(2, dim=-1)
    return x * r1 + torch.cat((-x2, x1), dim=-1) * r2


@custom_op("npu::npu_swiglu", mutates_args=())
def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    calls.append("npu_swiglu")
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


# Shape rules, for tracing (dynamo runs these on fake tensors instead of the ops).
npu_rms_norm.register_fake(
    lambda x, gamma, epsilon=1e-6: (torch.empty_like(x), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32))
)
npu_add_rms_norm.register_fake(
    lambda x1, x2, gamma, epsilon=1e-6: (
        torch.empty_like(x1),
        x1.new_empty(*x1.shape[:-1], 1, dtype=torch.float32),
        torch.empty_like(x1),
    )
)
npu_rotary_mul.register_fake(
    lambda x, r1, r2, rotary_mode="half": torch.empty_like(x, dtype=torch.promote_types(x.dtype, r1.dtype))
)
npu_swiglu.register_fake(lambda x, dim=-1: x.new_empty(*x.shape[:-1], x.shape[-1] // 2))
_npu_reshape_and_cache.register_fake(lambda *args: None)
_npu_paged_attention.register_fake(lambda *args: None)
