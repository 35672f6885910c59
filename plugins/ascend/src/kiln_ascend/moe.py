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
"""

from __future__ import annotations

import torch

from kiln_ascend.lora import grouped_matmul


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import torch_npu

    weights, ids, _ = torch_npu.npu_moe_gating_top_k_softmax(router_logits.float(), None, top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.long()


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    import torch_npu

    tokens, top_k = ids.shape
    weights = torch.where(ids < 0, 0.0, weights).to(x.dtype)
    ids = ids.clamp(min=0).to(torch.int32)
    # The op's row index: slot j of token t is row j * tokens + t.
    row_idx = torch.arange(tokens * top_k, dtype=torch.int32, device=x.device).view(top_k, tokens).t().contiguous()
    xs, rows, sorted_ids = torch_npu.npu_moe_init_routing(x.contiguous(), row_idx, ids, tokens)
    ends = torch_npu.npu_moe_compute_expert_tokens(sorted_ids, w13.shape[0]).long()
    h = torch_npu.npu_swiglu(grouped_matmul(xs, w13.transpose(1, 2), ends), dim=-1)
    y = grouped_matmul(h.contiguous(), w2.transpose(1, 2), ends)
    return torch_npu.npu_moe_finalize_routing(y, None, None, None, weights, rows, ids, drop_pad_mode=0)
