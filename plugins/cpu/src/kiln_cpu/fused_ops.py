"""The platform's fused ops (``Platform.custom_ops``): C kernels for fp32/bf16, torch otherwise.

Each wrapper takes the reference op's arguments and returns what it returns
(see ``kiln.interfaces.model``); shapes, strides or dtypes the kernels do not handle go to
the reference. ``fused_add_rms_norm`` and ``rotary_embedding`` work in place,
as vLLM's kernels do: the model never reuses their inputs.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from functools import cache, partial

import torch
import torch.nn.functional as F

from kiln.interfaces import lora as lora_reference
from kiln.interfaces import model as reference
from kiln.interfaces.lora import LoRAMapping
from kiln_cpu import native
from kiln_cpu.experts import PackedExperts
from kiln_cpu.packed_linear import on_padded_rows, widened_linear

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _kernel(op: str, dtype: torch.dtype):
    return getattr(native.load_kernels(), f"{op}_{_SUFFIX[dtype]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    if x.dtype not in _SUFFIX or weight.dtype != x.dtype or not weight.is_contiguous() or weight.shape != (dim,):
        return reference.rms_norm(x, weight, eps)
    x = x.contiguous()  # e.g. the query heads, a view of the fused qkv projection: normed per head
    out = torch.empty_like(x)
    rows = x.numel() // dim
    _kernel("rms_norm", x.dtype)(out.data_ptr(), x.data_ptr(), weight.data_ptr(), rows, dim, dim, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    ok = x.dtype in _SUFFIX and x.dtype == residual.dtype == weight.dtype and x.shape == residual.shape
    if not (ok and x.is_contiguous() and residual.is_contiguous()):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    dim = x.shape[-1]
    _kernel("add_rms_norm", x.dtype)(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // dim, dim, eps)
    return x, residual


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, q_heads, dim = q.shape
    rows_ok = all(t.stride(2) == 1 and t.stride(1) == dim for t in (q, k))
    if q.dtype not in _SUFFIX or k.dtype != q.dtype or not rows_ok or cos_sin_cache.dtype != torch.float32:
        return reference.rotary_embedding(positions, q, k, cos_sin_cache)
    pos = positions.to(torch.int64).contiguous()
    cache = cos_sin_cache.contiguous()
    _kernel("rotary", q.dtype)(
        pos.data_ptr(), q.data_ptr(), k.data_ptr(), cache.data_ptr(),
        tokens, q_heads, k.shape[1], dim, q.stride(0), k.stride(0),
    )  # fmt: skip
    return q, k


def _act_and_mul(op: str, x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in _SUFFIX or not x.is_contiguous():
        return getattr(reference, op)(x)
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    _kernel(op, x.dtype)(out.data_ptr(), x.data_ptr(), x.numel() // (2 * d), d)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul("silu_and_mul", x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU (``gelu_pytorch_tanh``): a prefill's was ~2.3x as long through torch."""
    return _act_and_mul("gelu_tanh_and_mul", x)


LORA_KERNELS = {torch.float32: "lora_add_f32", torch.bfloat16: "lora_add_bf16w"}  # by the slots' dtype
_SLICE_SIZES: dict[tuple[int, ...], torch.Tensor] = {}  # a projection's slice sizes, as the kernel reads them
_PREPARED: dict[int, tuple] = {}  # id(lora_b) -> (weakref to it, its version, B^T, slot ranks)


def prepared_lora_b(lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lora_b`` as the C kernel reads it, (slots, rank, out), and each slot's rank (its last
    nonzero column: the rest is zero padding the kernel skips). Made again only after a slot
    changed (an in-place write bumps the tensor's version), so decode steps reuse them."""
    held = _PREPARED.get(id(lora_b))
    if held is None or held[0]() is not lora_b or held[1] != lora_b._version:
        if held is None or held[0]() is not lora_b:  # dropped with its slots (engines come and go)
            weakref.finalize(lora_b, _PREPARED.pop, id(lora_b), None)
        used = (lora_b != 0).any(dim=1)  # (slots, rank): columns holding anything
        ranks = torch.where(used.any(-1), used.shape[-1] - used.flip(-1).int().argmax(-1), 0).to(torch.int64)
        held = (weakref.ref(lora_b), lora_b._version, lora_b.transpose(1, 2).contiguous(), ranks.contiguous())
        _PREPARED[id(lora_b)] = held
    return held[2], held[3]


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_bias: torch.Tensor | None,
    mapping: LoRAMapping,
    slices: tuple[int, ...],
) -> torch.Tensor:
    weights = (lora_a, lora_b) + (() if lora_bias is None else (lora_bias,))
    kernel = LORA_KERNELS.get(lora_a.dtype)
    ok = y.dtype == x.dtype == torch.float32 and y.is_contiguous() and x.is_contiguous() and kernel is not None
    if not ok or any(w.dtype != lora_a.dtype or not w.is_contiguous() for w in weights):
        return lora_reference.add_lora(y, x, lora_a, lora_b, lora_bias, mapping, slices)
    sizes = _SLICE_SIZES.get(slices)
    if sizes is None:
        sizes = _SLICE_SIZES.setdefault(slices, torch.tensor(slices, dtype=torch.int64))
    slots = mapping.token_slots
    transposed, ranks = prepared_lora_b(lora_b)
    failed = getattr(native.load_kernels(), kernel)(
        y.data_ptr(), y.shape[1], x.data_ptr(), x.shape[1], y.shape[0], slots.data_ptr(), lora_a.data_ptr(),
        transposed.data_ptr(), None if lora_bias is None else lora_bias.data_ptr(), x.shape[1], y.shape[1],
        lora_b.shape[-1], len(slices), sizes.data_ptr(), ranks.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"{kernel}: out of memory")
    return y


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor | PackedExperts, w2: torch.Tensor | PackedExperts, weights, ids
) -> torch.Tensor:
    """``kiln.interfaces.model.fused_experts`` in one C call (``csrc/experts.c``): fp32 experts
    in their tiles (``kiln_cpu.experts``), bf16 ones as loaded at decode batch sizes (at any on
    AMX machines); beyond those, bf16 experts through ``widened_linear`` where FMAs outrun bf16 products (the
    reference's roundings, each expert's matmuls as fp32 GEMMs), else through oneDNN on their
    rows padded (``on_padded_rows``: each expert's count of rows would be a new kernel to compile);
    else the reference."""
    if isinstance(w13, PackedExperts):
        return _fused_experts_tiled(x, w13, w2, weights, ids)
    if _bf16_experts_kernel_takes(x, w13, w2):
        return _fused_experts_bf16(x, w13, w2, weights, ids)
    if x.dtype == w13.dtype == w2.dtype == torch.bfloat16:
        return reference.route_to_experts(x, weights, ids, partial(_bf16_expert, w13, w2))
    return reference.fused_experts(x, w13, w2, weights, ids)


def _bf16_expert(w13: torch.Tensor, w2: torch.Tensor, e: int, rows: torch.Tensor) -> torch.Tensor:
    if native.fma_outruns_bf16_dots():
        return widened_linear(silu_and_mul(widened_linear(rows, w13[e])), w2[e])
    return on_padded_rows(lambda r: F.linear(silu_and_mul(F.linear(r, w13[e])), w2[e]), rows)


@cache
def bf16_experts_max_tokens() -> int:
    """Tokens up to which the bf16 experts kernel runs; more go to the reference's per-expert
    matmuls, where oneDNN's blocked GEMM is faster and the torch ops around them cost little.
    On AMX tiles the kernel takes any number (in calls of ``BF16_EXPERTS_CHUNK``): on
    bench/moe.py's model a layer of 256 tokens took 3.3 ms against oneDNN's 5.9, of 1024 12.7
    against 18.1, of 2048 21.3 against 27.0."""
    return sys.maxsize if native.load_kernels().fused_experts_bf16_amx() else 64


# Tokens per call of the bf16 experts kernel: its buffers hold each (token, expert) pair's
# input, hidden and output rows (Mixtral's, 1024 tokens: ~100 MB).
BF16_EXPERTS_CHUNK = 1024


def bf16_experts_fit(w13, w2) -> bool:
    """Stacked experts the bf16 kernel reads: contiguous bf16 tensors whose hidden and
    intermediate sizes are multiples of its step."""
    multiple = native.load_kernels().fused_experts_bf16_multiple()
    return (
        all(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.is_contiguous() for w in (w13, w2))
        and w13.shape[2] % multiple == 0 and w2.shape[2] % multiple == 0
    )  # fmt: skip


def _bf16_experts_kernel_takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    rows_ok = x.dim() == 2 and x.shape[0] <= bf16_experts_max_tokens() and x.shape[1] == w13.shape[2]
    return rows_ok and x.dtype == torch.bfloat16 and x.is_contiguous() and bf16_experts_fit(w13, w2)


# Tokens per call of the fp32 experts kernel: its buffers hold each (token, slot)'s input and
# hidden rows (a 2k-token prefill of Mixtral: ~290 MB at once), so prefills go in chunks (each
# reads the experts' weights again: a few % of a prefill's time at 256 tokens).
TILED_EXPERTS_CHUNK = 256


def _check(status: int, kernel: str, experts: int) -> None:
    if status == 2:
        raise ValueError(f"{kernel}: an expert id outside the layer's {experts} experts")
    if status:
        raise MemoryError(f"{kernel}: no memory for its buffers")


def _experts_in_chunks(kernel: str, chunk: int, x, inter: int, experts: int, weights, ids, *weight_args):
    """A C experts kernel (``csrc/experts.c``: its arguments up to the experts' count, then
    ``weight_args``) over ``x``'s rows, ``chunk`` at a time: its buffers grow with the rows."""
    ids, weights = ids.to(torch.int64).contiguous(), weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    call = getattr(native.load_kernels(), kernel)
    for start in range(0, x.shape[0], chunk):
        rows = slice(start, start + chunk)
        status = call(
            out[rows].data_ptr(), x[rows].data_ptr(), out[rows].shape[0], x.shape[1], inter, ids[rows].data_ptr(),
            weights[rows].data_ptr(), ids.shape[1], experts, *weight_args,
        )  # fmt: skip
        _check(status, kernel, experts)
    return out


def _fused_experts_tiled(x, w13: PackedExperts, w2: PackedExperts, weights, ids) -> torch.Tensor:
    if x.dtype != torch.float32:  # a bf16 model's quantized experts: the kernel takes fp32 rows
        return _fused_experts_tiled(x.float(), w13, w2, weights, ids).to(x.dtype)
    experts, _, inter = w2.shape
    return _experts_in_chunks(
        "fused_experts_tiled", TILED_EXPERTS_CHUNK, x.contiguous(), inter, experts, weights, ids,
        w13.kernel_args, w2.kernel_args, w13.int8_activations,
    )  # fmt: skip


def _fused_experts_bf16(x, w13, w2, weights, ids) -> torch.Tensor:
    experts, _, inter = w2.shape
    return _experts_in_chunks(
        "fused_experts_bf16", BF16_EXPERTS_CHUNK, x, inter, experts, weights, ids, w13.data_ptr(), w2.data_ptr()
    )


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = router_logits.shape if router_logits.dim() == 2 else (0, 0)
    ok = router_logits.dtype in _SUFFIX and router_logits.is_contiguous() and 0 < top_k <= experts
    if not ok:
        return reference.moe_route(router_logits, top_k, renormalize)
    weights = torch.empty(tokens, top_k, dtype=torch.float32)
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    _kernel("moe_route", router_logits.dtype)(
        weights.data_ptr(), ids.data_ptr(), router_logits.data_ptr(), tokens, experts, top_k, int(renormalize)
    )
    return weights, ids


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1 or 0 in logits.shape:
        return reference.argmax(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    native.load_kernels().argmax_f32(out.data_ptr(), logits.data_ptr(), *logits.shape, logits.stride(0))
    return out


def fused_ops() -> dict[str, Callable]:
    """The overrides, when the C kernels are built (``KILN_CPU_NATIVE=0`` turns them off)."""
    if native.load_kernels() is None:
        return {}
    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "rotary_embedding": rotary_embedding,
        "silu_and_mul": silu_and_mul,
        "gelu_tanh_and_mul": gelu_tanh_and_mul,
        "add_lora": add_lora,
        "moe_route": moe_route,
        "fused_experts": fused_experts,
        "argmax": argmax,
    }
