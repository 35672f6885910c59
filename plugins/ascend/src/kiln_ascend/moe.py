"""Mixture-of-experts ops on Ascend (``moe_route``, ``fused_experts`` of ``kiln.interfaces.model``)
through torch_npu's routing and grouped-matmul ops, all of fixed shape, so a decode graph holds
them (the core's reference loops over the experts a step hits)::

    weights, ids, _ = npu_moe_gating_top_k_softmax(logits, None, k)     softmax + top-k
    xs, rows, sorted_ids = npu_moe_init_routing(x, row_idx, ids, T)     (T*k, H): rows by expert
    ends = npu_moe_compute_expert_tokens(sorted_ids, E)                 each expert's last row + 1
    h = npu_swiglu(gmm(xs, w13^T, ends)); y = gmm(h, w2^T, ends)        one grouped matmul each
    out = npu_moe_finalize_routing(y, ..., weights, rows, ids)          back to tokens, weighted

Expert parallelism's "another rank's expert" (id -1) becomes expert 0 with weight 0: the shapes
stay fixed and the product adds nothing.

A quantized checkpoint's experts stay int8 or int4 (``QuantizedExperts``, from
``kiln_ascend.quant``): W8A8's grouped matmuls take the rows quantized per token, as
vllm-ascend's W8A8_DYNAMIC MoE does, and weight-only experts are widened inside the op (its
pseudo-quantized form)::

    q, s = npu_dynamic_quant(xs); gmm(q, w, scale=[s_ch], per_token_scale=[s], output_dtype=...)
    gmm(xs, w, antiquant_scale=[s_ch], antiquant_offset=[-zero])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.interfaces.quantization import quantize_per_token
from kiln_ascend.lora import grouped_matmul


@dataclass(slots=True, eq=False)
class QuantizedExperts:
    """Stacked experts (experts, N, K) as int8 codes for ``npu_grouped_matmul``'s quantized forms."""

    weight: torch.Tensor  # (experts, K, N) int8 (the transposed view of (experts, N, K) codes), or int32
    # (experts, K, N / 8) holding int4
    scale: torch.Tensor  # (experts, N), or (experts, groups, N) for int4: W8A8's in fp32 for fp16
    # outputs and bf16 for bf16 ones, weight-only ones in the activations' dtype
    offset: torch.Tensor | None  # as scale, added to the codes (pseudo-quantized only)
    w8a8: bool
    dtype: torch.dtype  # the kernels' activations and outputs: fp16 or bf16
    shape: tuple[int, int, int]  # of the stacked weight it stands for

    def matmul(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` (m, K), in groups by cumulative ``ends``, times their expert's weight, in ``x``'s dtype."""
        import torch_npu

        if self.w8a8:
            if x.dtype == self.dtype:
                q, token_scale = torch_npu.npu_dynamic_quant(x)
            else:  # fp32 models: npu_dynamic_quant takes fp16/bf16 (see kiln_ascend.quant)
                q, token_scale = quantize_per_token(x)
                token_scale = token_scale.view(-1)
            quant = dict(scale=[self.scale], per_token_scale=[token_scale], output_dtype=self.dtype)
            rows = q
        else:
            offset = None if self.offset is None else [self.offset]
            quant, rows = dict(antiquant_scale=[self.scale], antiquant_offset=offset), x.to(self.dtype)
        out = torch_npu.npu_grouped_matmul(
            [rows], [self.weight], group_list=ends, split_item=3, group_type=0, group_list_type=0, **quant
        )[0]
        return out.to(x.dtype)


def _experts_matmul(x: torch.Tensor, w: torch.Tensor | QuantizedExperts, ends: torch.Tensor) -> torch.Tensor:
    if isinstance(w, QuantizedExperts):
        return w.matmul(x, ends)
    return grouped_matmul(x, w.transpose(1, 2), ends)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import torch_npu

    weights, ids, _ = torch_npu.npu_moe_gating_top_k_softmax(router_logits.float(), None, top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.long()


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor | QuantizedExperts,
    w2: torch.Tensor | QuantizedExperts,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    import torch_npu

    tokens, top_k = ids.shape
    weights = torch.where(ids < 0, 0.0, weights).to(x.dtype)
    ids = ids.clamp(min=0).to(torch.int32)
    # The op's row index: slot j of token t is row j * tokens + t.
    row_idx = torch.arange(tokens * top_k, dtype=torch.int32, device=x.device).view(top_k, tokens).t().contiguous()
    xs, rows, sorted_ids = torch_npu.npu_moe_init_routing(x.contiguous(), row_idx, ids, tokens)
    ends = torch_npu.npu_moe_compute_expert_tokens(sorted_ids, w13.shape[0]).long()
    h = torch_npu.npu_swiglu(_experts_matmul(xs, w13, ends), dim=-1)
    y = _experts_matmul(h.contiguous(), w2, ends)
    return torch_npu.npu_moe_finalize_routing(y, None, None, None, weights, rows, ids, drop_pad_mode=0)
