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
    """BSND, non-paged, Sq > 1 (the PFA branch; Sq = 1 ignores sparse_mode, unused here).
    sparse_mode 3: right-down causal (j <= i + Skv - Sq) with the 2048 mask.
    sparse_mode 0: no mask, nothing masked; with a mask of shape (Sq, Skv), (B|1, Sq, Skv) or
    (B|1, 1, Sq, Skv), True = masked, that mask (the pre/next_tokens band, not emulated, is
    left at its all-covering default)."""
    calls.append(f"npu_fused_infer_attention_score:{inner_precise}")
    assert input_layout == "BSND" and query.shape[1] > 1 and sparse_mode in (0, 3)
    if sparse_mode == 3:
        assert atten_mask is not None and atten_mask.shape == (2048, 2048)
    elif atten_mask is not None:
        assert atten_mask.dtype in (torch.bool, torch.int8, torch.uint8)
        assert atten_mask.shape[-2:] == (query.shape[1], key.shape[1]) and atten_mask.dim() in (2, 3, 4)
        assert atten_mask.dim() < 4 or atten_mask.shape[1] == 1
    out = torch.zeros_like(query)
    for b in range(query.shape[0]):
        sq, skv = actual_seq_lengths[b], actual_seq_lengths_kv[b]
        if sparse_mode == 3:
            masked = torch.arange(skv)[None, :] > torch.arange(sq)[:, None] + (skv - sq)
        elif atten_mask is None:
            masked = torch.zeros(sq, skv, dtype=torch.bool)
        else:
            mask = atten_mask.reshape(-1, *atten_mask.shape[-2:])  # (B or 1, Sq, Skv)
            masked = mask[b if mask.shape[0] > 1 else 0, :sq, :skv].bool()
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


# Quantized matmuls. Contracts (torch_npu 6.0/7.0 API reference, aclnn docs, op-plugin sources):
#   npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None) -> (y int8, scale fp32)
#   npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None)
#   npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
#       quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0)
#   npu_convert_weight_to_int4pack(weight, inner_k_tiles=0)
# The first two take keyword-only arguments, which custom_op cannot declare: each is a registered
# op with positional arguments behind a wrapper with the real signature (dynamo traces the wrapper
# and sees the op as one node). Parts the plugin does not use (int4 activations, int8 outputs,
# int64 scales from npu_trans_quant_param, MoE group_index) raise NotImplementedError.

HALF_DTYPES = (torch.float16, torch.bfloat16)


def _is_transposed(t: torch.Tensor) -> bool:
    """op-plugin's is_transpose_last_two_dims: a (a, b) view of a contiguous (b, a) tensor."""
    return t.dim() == 2 and not t.is_contiguous() and t.stride(-2) == 1 and t.stride(-1) == t.shape[-2]


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 (r, c) holding eight int4 each, element 8j+i in bits 4i..4i+3 -> int32 (r, 8c), sign-extended."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1)
    return (nibbles - 16 * (nibbles >= 8)).flatten(-2).to(torch.int32)


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """int32 (d0, d1) with values in [-8, 7] -> int32 (d0, d1 / 8): eight consecutive values of the
    last dimension per int32, the first in the lowest 4 bits (op-plugin's convert_to_int4_pack)."""
    calls.append("npu_convert_weight_to_int4pack")
    assert weight.dtype == torch.int32 and weight.dim() == 2 and weight.is_contiguous(), "int32 2-D contiguous"
    assert weight.shape[-1] % 8 == 0, f"weight last dim should be the multiple of 8, but it is {weight.shape[-1]}"
    assert weight.min() >= -8 and weight.max() <= 7, "values must lie in int4's range [-8, 7]"
    nibbles = (weight.to(torch.int64) & 0xF).view(weight.shape[0], -1, 8)
    words = sum(nibbles[..., i] << (4 * i) for i in range(8))
    return (words - (words >= 2**31) * 2**32).to(torch.int32)


@custom_op("npu::npu_dynamic_quant", mutates_args=())
def _npu_dynamic_quant(
    x: torch.Tensor, smooth_scales: torch.Tensor | None, dst_type: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token int8: scale = row_max(|x|) / 127, y = round(x / scale), in fp32."""
    calls.append("npu_dynamic_quant")
    assert x.dtype in HALF_DTYPES and x.dim() > 1, f"x must be float16/bfloat16 with 2+ dims, not {x.dtype}"
    if dst_type not in (None, torch.int8):
        raise NotImplementedError(f"emulation: dst_type {dst_type}")
    values = x.float()
    if smooth_scales is not None:
        assert smooth_scales.dtype == x.dtype and smooth_scales.shape == x.shape[-1:]
        values = values * smooth_scales.float()
    scale = values.abs().amax(dim=-1) / 127
    y = torch.round(values / scale.unsqueeze(-1)).nan_to_num(0.0)  # an all-zero row: scale 0, y 0
    return y.clamp(-128, 127).to(torch.int8), scale


def npu_dynamic_quant(
    x: torch.Tensor, *, smooth_scales: torch.Tensor | None = None, group_index: torch.Tensor | None = None,
    dst_type: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if group_index is not None:
        raise NotImplementedError("emulation: MoE group_index")
    return _npu_dynamic_quant(x, smooth_scales, dst_type)


@custom_op("npu::npu_quant_matmul", mutates_args=())
def _npu_quant_matmul(
    x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
    pertoken_scale: torch.Tensor | None, bias: torch.Tensor | None, output_dtype: torch.dtype | None,
) -> torch.Tensor:  # fmt: skip
    """int8 (m, k) @ int8 (k, n) in int32, then (aclnnQuantMatmulV4):
    pertoken, int32 bias:          (x1 @ x2 + bias) * scale * pertoken_scale
    pertoken, fp16/bf16/fp32 bias: x1 @ x2 * scale * pertoken_scale + bias
    no pertoken:                   (x1 @ x2 [+ int32 bias]) * scale [+ float bias]
    Accepted dtypes (the API reference's table), with x1 = x2 = int8:
      output bf16: scale fp32/bf16, no offset, bias int32/bf16/fp32, pertoken_scale fp32 or None
      output fp16: with pertoken_scale (fp32): scale fp32, bias int32/fp16/fp32;
                   without: scale fp32 (or int64), bias int32 only."""
    calls.append("npu_quant_matmul")
    if x1.dtype == torch.int32 or output_dtype in (None, torch.int8):
        raise NotImplementedError("emulation: int4 inputs and int8 outputs")
    assert x1.dtype == x2.dtype == torch.int8, f"x1 and x2 must both be int8, not {x1.dtype} and {x2.dtype}"
    assert x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0], f"(m, k) @ (k, n): {x1.shape} {x2.shape}"
    assert x2.is_contiguous() or _is_transposed(x2), "x2: contiguous (k, n), or the transpose of a contiguous (n, k)"
    n = x2.shape[1]
    assert scale.dim() == 1 and scale.shape[0] in (1, n), f"scale must be (1,) or (n,), not {tuple(scale.shape)}"
    assert offset is None, "offset applies to int8 outputs only"
    if pertoken_scale is not None:
        assert pertoken_scale.dtype == torch.float32 and pertoken_scale.shape == (x1.shape[0],), (
            "pertoken_scale fp32 (m,)"
        )
    if bias is not None:
        assert bias.shape == (n,), f"bias must be (n,), not {tuple(bias.shape)}"
    if output_dtype == torch.bfloat16:
        assert scale.dtype in (torch.float32, torch.bfloat16), f"bf16 output: scale fp32/bf16, not {scale.dtype}"
        assert bias is None or bias.dtype in (torch.int32, torch.bfloat16, torch.float32), f"bias {bias.dtype}"
    elif output_dtype == torch.float16:
        assert scale.dtype == torch.float32, f"fp16 output: scale fp32 (or int64), not {scale.dtype}"
        allowed = (torch.int32, torch.float16, torch.float32) if pertoken_scale is not None else (torch.int32,)
        assert bias is None or bias.dtype in allowed, f"fp16 output: bias {bias.dtype} not in {allowed}"
    else:
        raise AssertionError(f"output_dtype must be int8, float16 or bfloat16, not {output_dtype}")
    acc = x1.double() @ x2.double()  # exact: |acc| < 2**53
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.double()
    out = acc.float() * scale.float()
    if pertoken_scale is not None:
        out = out * pertoken_scale[:, None]
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.float()
    return out.to(output_dtype)


def npu_quant_matmul(
    x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *, offset: torch.Tensor | None = None,
    pertoken_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    return _npu_quant_matmul(x1, x2, scale, offset, pertoken_scale, bias, output_dtype)


@custom_op("npu::npu_weight_quant_batchmatmul", mutates_args=())
def npu_weight_quant_batchmatmul(
    x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
    antiquant_offset: torch.Tensor | None = None, quant_scale: torch.Tensor | None = None,
    quant_offset: torch.Tensor | None = None, bias: torch.Tensor | None = None, antiquant_group_size: int = 0,
    inner_precise: int = 0,
) -> torch.Tensor:  # fmt: skip
    """y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias (aclnnWeightQuantBatchMatmulV2), on
    A2/A3: x (m, k) fp16/bf16; weight (k, n) int8, or int32 holding int4 (npu_convert_weight_to_int4pack):
    (k, n / 8), or the transpose of a packed (n, k / 8); non-contiguous only as a transpose. Scale and
    offset in x's dtype, (n,) or (1, n) per channel, (ceil(k / g), n) per group of g inputs (g a multiple
    of 32 in [32, k - 1]); bias (n,) fp16 for fp16 x, fp32 for bf16 x; y in x's dtype. The weight is
    widened in fp32 and rounded once to x's dtype (what the cube unit multiplies), products summed in fp32."""
    calls.append("npu_weight_quant_batchmatmul")
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError("emulation: int8 outputs (quant_scale)")
    assert x.dtype in HALF_DTYPES and x.dim() == 2, f"x must be 2-D float16/bfloat16, not {x.dim()}-D {x.dtype}"
    assert x.is_contiguous() or _is_transposed(x), "x: non-contiguous only as a transpose"
    assert weight.dim() == 2 and (weight.is_contiguous() or _is_transposed(weight)), "weight: 2-D, or a transpose"
    if weight.dtype == torch.int32:
        w = _unpack_int4(weight.T).T if _is_transposed(weight) else _unpack_int4(weight)
    else:
        assert weight.dtype == torch.int8, f"weight must be int8 or int32 (int4 pack), not {weight.dtype}"
        w = weight
    k, n = w.shape
    assert x.shape[1] == k, f"The k of x and weight should be equal. but x_k_dim is {x.shape[1]}, weight_k_dim is {k}"
    assert 1 <= k <= 65535 and 1 <= n <= 65535 and x.shape[0] >= 1, f"k, n in [1, 65535], no empty x: {x.shape} {k} {n}"
    group = antiquant_group_size
    assert group == 0 or (group % 32 == 0 and 32 <= group <= k - 1), (
        "antiquant_group_size can be either 0 or a multiple of 32 within the range 32 to weight_k_dim - 1."
    )
    assert antiquant_scale.dtype == x.dtype, f"antiquant_scale must be {x.dtype}, not {antiquant_scale.dtype}"
    groups = -(-k // group) if group else 1
    shapes = [(groups, n)] if group else [(n,), (1, n), (1,), (1, 1)]
    assert tuple(antiquant_scale.shape) in shapes, f"antiquant_scale {tuple(antiquant_scale.shape)} not in {shapes}"
    if antiquant_offset is not None:
        assert antiquant_offset.dtype == x.dtype and antiquant_offset.shape == antiquant_scale.shape, "offset: as scale"
    if bias is not None:
        wanted = torch.float16 if x.dtype == torch.float16 else torch.float32
        assert bias.dtype == wanted and tuple(bias.shape) in ((n,), (1, n)), f"bias: {wanted} (n,), not {bias.dtype}"

    def per_input(t: torch.Tensor) -> torch.Tensor:  # scale/offset -> (k, n), or (1, n) / (1, 1) to broadcast
        t = t.float().reshape(-1, t.shape[-1])
        return t.repeat_interleave(group, dim=0)[:k] if group else t

    widened = w.float()
    if antiquant_offset is not None:
        widened = widened + per_input(antiquant_offset)
    widened = (widened * per_input(antiquant_scale)).to(x.dtype)
    out = x.float() @ widened.float()
    if bias is not None:
        out = out + bias.float().reshape(-1)
    return out.to(x.dtype)


# Grouped matmul (op-plugin docs/context/torch_npu-npu_grouped_matmul.md, GroupedMatmulKernelNpuOpApi.cpp):
#   npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
#       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
#       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
#       group_list_type=0, act_type=0, output_dtype=None, tuning_config=None) -> List[Tensor]
# y_i = x_i @ weight_i + bias_i, the non-quantized cases of A2/A3. It is a plain function (list and
# keyword-only arguments); the one form a decode graph holds (MoE experts: one x, one 3-D weight, a
# Tensor group_list, no bias) runs as the registered operator ``npu::_grouped_matmul_m``, so dynamo
# sees one node, and so do that form's per-token W8A8 and per-channel int8 pseudo-quantized cases
# (``npu::_grouped_matmul_quant_m``, the API reference's table 2). Other quantized forms, activations
# and group_list_type 2 (int8 only) raise NotImplementedError.

GMM_BIAS_DTYPE = {torch.float16: torch.float16, torch.bfloat16: torch.float32, torch.float32: torch.float32}


def _gmm_weight_ok(w: torch.Tensor) -> bool:
    """Contiguous, or the transpose of the last two dims of a contiguous tensor ("weight转置")."""
    if w.is_contiguous():
        return True
    return w.dim() in (2, 3) and w.transpose(-1, -2).is_contiguous()


def npu_grouped_matmul(
    x: list[torch.Tensor], weight: list[torch.Tensor], *, bias: list[torch.Tensor] | None = None,
    scale=None, offset=None, antiquant_scale=None, antiquant_offset=None, per_token_scale=None,
    group_list: torch.Tensor | list[int] | None = None, activation_input=None, activation_quant_scale=None,
    activation_quant_offset=None, split_item: int = 0, group_type: int | None = None, group_list_type: int = 0,
    act_type: int = 0, output_dtype: torch.dtype | None = None, tuning_config=None,
) -> list[torch.Tensor]:  # fmt: skip
    """Groups of rows of x times their own weight. With a Tensor group_list and group_type 0 (m axis),
    x is one (M, K) tensor whose rows are split into groups by group_list (group_list_type 0: cumulative
    ends, non-decreasing, the last M; 1: sizes summing to M, more than one), and weight is one (E, K, N)
    tensor (group i: weight[i], E = len(group_list) <= 1024) or a list of (K, N) tensors (<= 128, one per
    group, N equal); split_item 2/3: one (M, N) output. With group_list None (group_type -1), x and weight
    are lists of the same length, y_i = x_i @ weight_i (split_item 0/1: a list; 2/3: rows concatenated).
    x must be contiguous; a weight contiguous or the transpose (last two dims) of a contiguous tensor.
    fp16 x/weight take fp16 bias, bf16 take fp32 bias, fp32 (Tensor group_list: only x, weight and y
    all single tensors) take fp32 bias; products summed in fp32, bias added, rounded once to the output."""
    single = len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3 and bias is None
    if single and isinstance(group_list, torch.Tensor) and group_type == 0 and split_item in (2, 3):
        quant = (scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
                 activation_quant_scale, activation_quant_offset)  # fmt: skip
        if all(q is None for q in quant) and act_type == 0 and output_dtype in (None, x[0].dtype):
            return [_grouped_matmul_m(x[0], weight[0], group_list, split_item, group_list_type)]
        unused = (offset, activation_input, activation_quant_scale, activation_quant_offset)
        if all(q is None for q in unused) and act_type == 0 and weight[0].dtype in (torch.int8, torch.int32):

            def one(tensors):
                assert tensors is None or len(tensors) == 1, "one scale tensor per weight tensor"
                return None if tensors is None else tensors[0]

            return [
                _grouped_matmul_quant_m(
                    x[0], weight[0], group_list, one(scale), one(per_token_scale), one(antiquant_scale),
                    one(antiquant_offset), split_item, group_list_type, output_dtype,
                )
            ]  # fmt: skip
    return _grouped_matmul(
        x, weight, bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
        antiquant_offset=antiquant_offset, per_token_scale=per_token_scale, group_list=group_list,
        activation_input=activation_input, activation_quant_scale=activation_quant_scale,
        activation_quant_offset=activation_quant_offset, split_item=split_item, group_type=group_type,
        group_list_type=group_list_type, act_type=act_type, output_dtype=output_dtype,
    )  # fmt: skip


def _tensor_group_ends(group_list: torch.Tensor, group_list_type: int, m: int, groups: int, limit: int) -> list[int]:
    """Each group's end row from a Tensor group_list (group_type 0): cumulative ends (type 0) or
    sizes (type 1), checked as the op checks them."""
    assert group_list.dtype == torch.int64 and group_list.dim() == 1, "group_list: 1-D int64"
    values = group_list.tolist()
    assert len(values) == groups and len(values) <= limit, f"group_list has {len(values)} entries for {groups} weights"
    assert all(v >= 0 for v in values), "group_list must be non-negative"
    if group_list_type == 0:
        assert values == sorted(values) and values[-1] == m, f"cumulative group ends ending at {m}: {values}"
        return values
    assert group_list_type == 1 and len(values) != 1 and sum(values) == m, f"group sizes summing to {m}"
    return [sum(values[: i + 1]) for i in range(len(values))]


@custom_op("npu::_grouped_matmul_quant_m", mutates_args=())
def _grouped_matmul_quant_m(
    x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor, scale: torch.Tensor | None,
    per_token_scale: torch.Tensor | None, antiquant_scale: torch.Tensor | None,
    antiquant_offset: torch.Tensor | None, split_item: int, group_list_type: int, output_dtype: torch.dtype | None,
) -> torch.Tensor:  # fmt: skip
    """One x (m, k) split by group_list, one int8 weight (e, k, n) (or its transpose) or int32 (e, k,
    n / 8) holding int4 (eight per int32 along n, as npu_convert_weight_to_int4pack packs them), one
    output:
    per-token W8A8 (formula 3): x int8, int8 weight, scale (e, n) bf16 with output bf16, or fp32
      with output fp16, per_token_scale fp32 (m,): y = (x @ w_i) * scale_i * per_token_scale, the
      products exact in int32, then rounded once to the output dtype;
    pseudo-quantized (formula 4): x fp16/bf16, antiquant_scale and antiquant_offset (or None) in x's
      dtype, (e, n) per channel, or for int4 (e, G, n) per group of k / G inputs:
      y = x @ ((w_i + offset_i) * scale_i), the weight widened in fp32 and rounded once to x's
      dtype, products summed in fp32, y in x's dtype."""
    calls.append("npu_grouped_matmul")
    assert split_item in (2, 3), "group_type 0: split_item 2 or 3 (one output tensor)"
    assert x.dim() == 2 and x.is_contiguous(), "x: 2-D, contiguous"
    assert weight.dim() == 3 and _gmm_weight_ok(weight), "weight: 3-D, contiguous or its last two dims transposed"
    int4 = weight.dtype == torch.int32
    if int4:
        assert weight.is_contiguous() and x.dtype in HALF_DTYPES, "emulation: int4 weights contiguous, pseudo-quantized"
        weight = torch.stack([_unpack_int4(w) for w in weight])
    e, k, n = weight.shape
    assert x.shape[1] == k, f"(m, k) @ (e, k, n): {tuple(x.shape)} @ {tuple(weight.shape)}"
    ends = _tensor_group_ends(group_list, group_list_type, x.shape[0], e, 1024)
    if x.dtype == torch.int8:
        assert antiquant_scale is None and antiquant_offset is None, "int8 x: no antiquant parameters"
        assert scale is not None and scale.shape == (e, n), (
            f"scale (e, n), not {None if scale is None else scale.shape}"
        )
        assert per_token_scale is not None and per_token_scale.dtype == torch.float32, "per_token_scale fp32"
        assert per_token_scale.shape == (x.shape[0],), "per_token_scale (m,)"
        rule = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}
        assert rule.get(scale.dtype) == output_dtype, (
            f"scale {scale.dtype} with output {output_dtype}: not in the table"
        )
        acc = torch.cat([x[a:b].double() @ weight[i].double() for i, (a, b) in enumerate(zip([0, *ends], ends))])
        groups = torch.repeat_interleave(torch.arange(e), torch.tensor([b - a for a, b in zip([0, *ends], ends)]))
        return (acc.float() * scale.float()[groups] * per_token_scale[:, None]).to(output_dtype)
    assert x.dtype in HALF_DTYPES, f"x must be int8, float16 or bfloat16 here, not {x.dtype}"
    assert scale is None and per_token_scale is None, "pseudo-quantized: antiquant parameters only"
    assert output_dtype in (None, x.dtype), f"output_dtype must be None or {x.dtype}"
    assert antiquant_scale is not None, "pseudo-quantized: antiquant_scale"
    per_group = antiquant_scale.dim() == 3
    assert not per_group or int4, "int8 weights: per channel only"
    groups = antiquant_scale.shape[1] if per_group else 1
    assert k % groups == 0, f"the per-group count {groups} must divide k = {k}"
    shape = (e, groups, n) if per_group else (e, n)
    for name, t in (("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset)):
        assert t is None or (t.dtype == x.dtype and t.shape == shape), f"{name}: {shape} {x.dtype}"

    def per_input(t: torch.Tensor) -> torch.Tensor:  # (e, k, n): each input's scale or offset
        return t.float().repeat_interleave(k // groups, dim=1) if per_group else t.float()[:, None, :]

    w = weight.float()
    if antiquant_offset is not None:
        w = w + per_input(antiquant_offset)
    w = (w * per_input(antiquant_scale)).to(x.dtype)
    ys = [x[a:b].float() @ w[i].float() for i, (a, b) in enumerate(zip([0, *ends], ends))]
    return torch.cat(ys).to(x.dtype)


@custom_op("npu::_grouped_matmul_m", mutates_args=())
def _grouped_matmul_m(
    x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor, split_item: int, group_list_type: int
) -> torch.Tensor:
    return _grouped_matmul(
        [x], [weight], group_list=group_list, split_item=split_item, group_type=0, group_list_type=group_list_type
    )[0]


def _grouped_matmul(
    x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
    per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
    activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0, output_dtype=None,
) -> list[torch.Tensor]:  # fmt: skip
    calls.append("npu_grouped_matmul")
    quant = (scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
             activation_quant_scale, activation_quant_offset)  # fmt: skip
    if any(q is not None for q in quant) or act_type != 0 or group_list_type == 2:
        raise NotImplementedError("emulation: quantized grouped matmul, activations, group_list_type 2")
    assert split_item in (0, 1, 2, 3), f"Invalid value of split_item [{split_item}]: one of 0/1/2/3"
    assert isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), "x and weight are tensor lists"
    assert 0 < len(x) <= 128 and 0 < len(weight) <= 128, "Invalid inputs: neither x nor weight could be empty."
    dtype = x[0].dtype
    assert dtype in GMM_BIAS_DTYPE, f"x must be float16, bfloat16 or float32 here, not {dtype}"
    assert all(t.dtype == dtype for t in [*x, *weight]), "x and weight must share one dtype (non-quantized)"
    assert output_dtype in (None, dtype), f"output_dtype must be None or {dtype}, not {output_dtype}"
    assert all(t.is_contiguous() for t in x), "x does not support transposition: contiguous only"
    assert all(_gmm_weight_ok(w) for w in weight), "weight: contiguous, or the transpose of a contiguous tensor"
    single_weight = len(weight) == 1 and weight[0].dim() == 3
    if bias is not None:
        assert not single_weight, "emulation: bias with a single 3-D weight"
        assert len(bias) == len(weight), "bias: one tensor per weight"
        assert all(b.dtype == GMM_BIAS_DTYPE[dtype] and b.dim() == 1 for b in bias), (
            f"bias must be 1-D {GMM_BIAS_DTYPE[dtype]} for {dtype} x"
        )
    groups = list(weight[0]) if single_weight else list(weight)
    assert all(w.dim() == 2 for w in groups), "weight: 2-D tensors, or one 3-D tensor"

    def mm(xi: torch.Tensor, i: int) -> torch.Tensor:
        assert xi.shape[-1] == groups[i].shape[0], f"group {i}: (m, k) @ (k, n), not {xi.shape} @ {groups[i].shape}"
        out = xi.float() @ groups[i].float()
        if bias is not None:
            out = out + bias[i].float()
        return out.to(dtype)

    if group_list is None:
        assert group_type in (None, -1), "group_type must be -1 without a group_list"
        assert len(x) == len(weight), "without a group_list, the num of x tensors must equal the num of weight tensors"
        ys = [mm(xi, i) for i, xi in enumerate(x)]
        return ys if split_item in (0, 1) else [torch.cat(ys, dim=0)]
    if isinstance(group_list, torch.Tensor):
        assert group_type == 0, f"a Tensor group_list groups the m axis here: group_type 0, not {group_type}"
        assert split_item in (2, 3), "group_type 0: split_item 2 or 3 (one output tensor)"
        assert len(x) == 1 and x[0].dim() == 2, "emulation: one 2-D x split by group_list"
        assert dtype != torch.float32 or single_weight, "float32: x, weight and y single tensors only"
        ends = _tensor_group_ends(
            group_list, group_list_type, x[0].shape[0], len(groups), 1024 if single_weight else 128
        )
    else:
        assert group_type is None, "a List[int] group_list takes group_type None"
        assert len(group_list) != 1 and list(group_list) == sorted(group_list), "group_list: increasing, not 1 long"
        assert len(x) == 1 and len(group_list) == len(groups), "one x split into one group per weight"
        ends = list(group_list)
        assert ends[-1] == x[0].shape[0], "the last group_list value is x's row count"
    n = {w.shape[1] for w in groups}
    assert split_item in (0, 1) or len(n) == 1, "one output tensor: every weight has the same N"
    starts = [0, *ends[:-1]]
    ys = [mm(x[0][start:end], i) for i, (start, end) in enumerate(zip(starts, ends))]
    return ys if split_item in (0, 1) else [torch.cat(ys, dim=0)]


# MoE routing (op-plugin docs/zh/custom_APIs/torch_npu: npu_moe_gating_top_k_softmax,
# npu_moe_init_routing, npu_moe_compute_expert_tokens, npu_moe_finalize_routing; the docs' numpy
# equivalents). Registered operators: a decode graph holds them.


@custom_op("npu::npu_moe_gating_top_k_softmax", mutates_args=())
def npu_moe_gating_top_k_softmax(
    x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax over the last axis, its top k (y in x's dtype, expert_idx int32), and row_idx int32
    with row_idx[t, j] = j * num_rows + t."""
    calls.append("npu_moe_gating_top_k_softmax")
    assert x.dim() == 2 and 0 < k <= min(x.shape[-1], 1024), "emulation: 2-D x, 0 < k <= experts, k <= 1024"
    assert finished is None, "emulation: no finished rows"
    y, idx = torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)
    rows = torch.arange(x.shape[0] * k, dtype=torch.int32).view(k, x.shape[0]).t().contiguous()
    return y.to(x.dtype), idx.to(torch.int32), rows


@custom_op("npu::npu_moe_init_routing", mutates_args=())
def npu_moe_init_routing(
    x: torch.Tensor, row_idx: torch.Tensor, expert_idx: torch.Tensor, active_num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of x repeated per slot and sorted (stably) by expert: expanded_x[i] = x[src[i] % num_rows]
    where src is row_idx in that order; expanded_row_idx[src[i]] = i; expanded_expert_idx sorted."""
    calls.append("npu_moe_init_routing")
    assert x.dim() == 2 and expert_idx.dim() == 2 and row_idx.shape == expert_idx.shape
    assert row_idx.dtype == expert_idx.dtype == torch.int32, "row_idx and expert_idx are int32"
    num_rows, k = x.shape[0], expert_idx.shape[1]
    order = torch.sort(expert_idx.reshape(-1), stable=True)
    src = row_idx.reshape(-1)[order.indices].long()
    expanded_row_idx = torch.empty_like(src, dtype=torch.int32)
    expanded_row_idx[src] = torch.arange(src.numel(), dtype=torch.int32)
    active = min(active_num, num_rows) * k
    return x[src[:active] % num_rows], expanded_row_idx, order.values.to(torch.int32)


@custom_op("npu::npu_moe_compute_expert_tokens", mutates_args=())
def npu_moe_compute_expert_tokens(sorted_expert_for_source_row: torch.Tensor, num_expert: int) -> torch.Tensor:
    """For each expert e < num_expert: one past the last row holding e (a binary search)."""
    calls.append("npu_moe_compute_expert_tokens")
    assert sorted_expert_for_source_row.dtype == torch.int32 and sorted_expert_for_source_row.dim() == 1
    experts = torch.arange(num_expert, dtype=torch.int32)
    return torch.searchsorted(sorted_expert_for_source_row, experts, right=True).to(torch.int32)


@custom_op("npu::npu_moe_finalize_routing", mutates_args=())
def npu_moe_finalize_routing(
    expanded_permuted_rows: torch.Tensor, skip1: torch.Tensor | None, skip2: torch.Tensor | None,
    bias: torch.Tensor | None, scales: torch.Tensor | None, expanded_src_to_dst_row: torch.Tensor,
    expert_for_source_row: torch.Tensor | None, drop_pad_mode: int = 0, k: int = 1,
) -> torch.Tensor:  # fmt: skip
    """out[i] = skip1 + skip2 + sum over slots j of scales[i, j] * rows[expanded_src_to_dst_row[j * num_rows + i]]
    (drop-less mode 0); fp32 sums, rounded once to the rows' dtype."""
    calls.append("npu_moe_finalize_routing")
    assert drop_pad_mode == 0 and bias is None, "emulation: drop-less mode 0, no bias"
    assert scales is None or scales.dtype == expanded_permuted_rows.dtype, "scales share the rows' dtype"
    assert expanded_src_to_dst_row.dtype == torch.int32
    k = scales.shape[1] if scales is not None else k
    num_rows = expanded_src_to_dst_row.numel() // k
    out = torch.zeros(num_rows, expanded_permuted_rows.shape[-1])
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    for j in range(k):
        rows = expanded_permuted_rows[expanded_src_to_dst_row[j * num_rows : (j + 1) * num_rows].long()].float()
        out = out + (rows if scales is None else scales[:, j, None].float() * rows)
    return out.to(expanded_permuted_rows.dtype)


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
_grouped_matmul_m.register_fake(
    lambda x, weight, group_list, split_item, group_list_type: x.new_empty(x.shape[0], weight.shape[-1])
)
_grouped_matmul_quant_m.register_fake(
    lambda x, weight, group_list, scale, token_scale, antiquant_scale, antiquant_offset, split, group_type, dtype: (
        x.new_empty(x.shape[0], weight.shape[-1] * (8 if weight.dtype == torch.int32 else 1), dtype=dtype or x.dtype)
    )
)
npu_moe_gating_top_k_softmax.register_fake(
    lambda x, finished=None, k=1: (
        x.new_empty(x.shape[0], k),
        x.new_empty(x.shape[0], k, dtype=torch.int32),
        x.new_empty(x.shape[0], k, dtype=torch.int32),
    )
)
npu_moe_init_routing.register_fake(
    lambda x, row_idx, expert_idx, active_num: (
        x.new_empty(min(active_num, x.shape[0]) * expert_idx.shape[1], x.shape[1]),
        row_idx.new_empty(row_idx.numel()),
        expert_idx.new_empty(expert_idx.numel()),
    )
)
npu_moe_compute_expert_tokens.register_fake(lambda sorted_rows, num_expert: sorted_rows.new_empty(num_expert))
npu_moe_finalize_routing.register_fake(
    lambda rows, skip1, skip2, bias, scales, dst, experts, drop_pad_mode=0, k=1: rows.new_empty(
        dst.numel() // (scales.shape[1] if scales is not None else k), rows.shape[-1]
    )
)
_npu_paged_attention.register_fake(lambda *args: None)
_npu_dynamic_quant.register_fake(
    lambda x, smooth_scales, dst_type: (
        torch.empty_like(x, dtype=torch.int8),
        x.new_empty(x.shape[:-1], dtype=torch.float32),
    )
)
_npu_quant_matmul.register_fake(
    lambda x1, x2, scale, offset, pertoken_scale, bias, output_dtype: x1.new_empty(
        x1.shape[0], x2.shape[1], dtype=output_dtype
    )
)


@npu_weight_quant_batchmatmul.register_fake
def _(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None, quant_offset=None, bias=None,
      antiquant_group_size=0, inner_precise=0):  # fmt: skip
    n = weight.shape[1] * (8 if weight.dtype == torch.int32 and not _is_transposed(weight) else 1)
    return x.new_empty(x.shape[0], n)
