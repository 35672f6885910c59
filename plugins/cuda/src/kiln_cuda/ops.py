"""The fused ops the CUDA platform puts in place of ``kiln.interfaces.model`` (same arguments and results)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from kiln_cuda import kernels
from kiln_cuda.lora import add_lora
from kiln_cuda.moe import Int8Experts, QuantizedExperts, expert_runs, grouped_gemm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows, per = x2.shape[0], kernels.rows_per_program(dim)
    if rows:
        kernels.rms_norm_kernel[(triton.cdiv(rows, per),)](
            x2, x2, weight, out, rows, x2.stride(0), dim, eps,
            HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(dim), ROWS=per,
        )  # fmt: skip
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` then normalise it, in place (as vLLM's kernel): returns (x, residual)."""
    dim = x.shape[-1]
    rows = x.numel() // dim
    x, residual = x.contiguous(), residual.contiguous()
    if rows:
        per = kernels.rows_per_program(dim)
        kernels.rms_norm_kernel[(triton.cdiv(rows, per),)](
            x, residual, weight, x, rows, dim, dim, eps, HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(dim), ROWS=per
        )
    return x, residual


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on (tokens, heads, head_dim) views whose rows may be strided."""
    tokens, _, dim = q.shape
    for x in (q, k):
        if tokens and x.stride(2) == 1:
            block_h = triton.next_power_of_2(x.shape[1])
            per = kernels.rows_per_program(block_h * dim)
            kernels.rotary_kernel[(triton.cdiv(tokens, per),)](
                positions, x, cos_sin_cache, tokens, x.stride(0), x.stride(1), x.shape[1],
                D=dim, HALF=dim // 2, BLOCK=triton.next_power_of_2(dim // 2), BLOCK_H=block_h, NEOX=neox, TOKENS=per,
            )  # fmt: skip
        elif tokens:
            raise ValueError("rotary_embedding: head_dim must be contiguous")
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d).contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block, rows = min(1024, triton.next_power_of_2(d)), x2.shape[0]
    per = kernels.rows_per_program(block)
    if rows:
        kernels.silu_and_mul_kernel[(triton.cdiv(rows, per), triton.cdiv(d, block))](
            x2, out, rows, d, BLOCK=block, ROWS=per
        )
    return out.view(*x.shape[:-1], d)


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Through ``kiln_cuda.moe``'s grouped GEMM, on stacked weights, ``QuantizedExperts`` or
    ``Int8Experts``; another rank's experts (id -1) are not computed."""
    tokens, top_k = ids.shape
    runs = expert_runs(ids, w13.shape[0])
    scale = weights.reshape(-1).float().contiguous()
    x = x.contiguous()
    w13, w2 = (w if isinstance(w, (QuantizedExperts, Int8Experts)) else w.contiguous() for w in (w13, w2))
    h = silu_and_mul(grouped_gemm(x, w13, runs, tokens * top_k, top_k=top_k, by_token=True))
    y = grouped_gemm(h, w2, runs, tokens * top_k, scale=scale)
    return y.view(tokens, top_k, -1).sum(dim=1)


def fused_ops() -> dict[str, Callable]:
    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "rotary_embedding": rotary_embedding,
        "silu_and_mul": silu_and_mul,
        "add_lora": add_lora,
        "fused_experts": fused_experts,
    }
