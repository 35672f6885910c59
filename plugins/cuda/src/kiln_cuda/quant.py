"""Quantized linear layers on CUDA (``Platform.linear_method``), through ``kiln_cuda.quant_kernels``.

- W8A8 (SmoothQuant / compressed-tensors int8): the activations are quantized to int8 per token
  by a Triton kernel (absmax / 127, ties to even, as ``quantize_per_token``), then an int8 GEMM
  sums in int32 through ``tl.dot`` and applies the per-token and per-channel scales. The weight
  stays (out, in) int8.
- W4A16 / W8A16 (AWQ, GPTQ, weight-only int8): ``process`` packs the codes, unsigned, 8 (4-bit)
  or 4 (8-bit) to an int32 along the inputs, GPTQ's layout: ``qweight`` (ceil(in / pack), out).
  Scales and zero points become (groups, out) fp32; symmetric schemes store ``q + 2**(bits-1)``
  with that constant as the zero point. The GEMM widens a (BK, BN) tile in registers,
  ``(code - zero) * scale`` rounded to the activations' dtype, and multiplies in that dtype with
  fp32 accumulation (fp32 activations: IEEE fp32 products, not TF32).
- fp8 weights (fp8 checkpoints): the same GEMM reads them (in, out) as float8, one per input,
  scaled per output feature and group of inputs (a block's scale repeats down its rows).
- Experts of a mixture (``process_experts``): AWQ, GPTQ without act-order and weight-only int8
  codes packed per expert as above, and fp8 values (in, out) as they are, stacked, for
  ``kiln_cuda.moe``'s grouped GEMM, which widens them tile by tile the same way; W8A8 experts'
  int8 weights stacked as they are, for its int8 path (rows quantized per row by the kernel
  above). Act-order experts, and groups not a multiple of 16 inputs, are widened at load.
- GPTQ act-order: the inputs are sorted by group (``argsort(g_idx)``) once, and each call gathers
  the activations' columns in the same order. When the sorted groups are contiguous and equal in
  size (GPTQ's) the kernel reads one scale row per K tile, as without act-order; otherwise it
  reads each input's group from the sorted ``g_idx``.
"""

from __future__ import annotations

import torch
import triton

from kiln.interfaces.quantization import LinearMethod, QuantLinear, QuantScheme, expert_tensors, replace_experts
from kiln_cuda import quant_kernels as kernels
from kiln_cuda.quant_kernels import quantize_per_token

PER_CHANNEL = 1 << 30  # the kernel's group size when one scale covers every input: k0 // it is 0


def gemm_blocks(rows: int) -> tuple[int, int, int]:
    """(BM, BN, num_warps) for ``rows`` activation rows: small M tiles for decode batches."""
    if rows <= 16:
        return 16, 64, 4
    if rows <= 32:
        return 32, 64, 4
    if rows <= 128:
        return 64, 64, 4
    return 128, 128, 8


def _rows(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, layer.in_features)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class TritonInt8Method(LinearMethod):
    """W8A8: per-token int8 activations times per-channel int8 weights, summed in int32."""

    def process(self, layer: QuantLinear) -> None:
        layer.qweight = layer.weight.data.contiguous()  # (out, in) int8: K-major, as the int8 MMA reads it
        layer.channel_scale = layer.weight_scale.data.reshape(-1).float().contiguous()
        del layer.weight, layer.weight_scale

    def process_experts(self, moe, experts: dict[tuple[int, str], dict[str, torch.Tensor]]) -> bool:
        """Each expert's int8 weights and channel scales stacked (gate and up rows as ``w13``
        stacks them) into one ``Int8Experts`` per stacked weight."""
        from kiln_cuda.moe import Int8Experts

        device = moe.gate.weight.device

        def stacked(projections: tuple[str, ...], shape: tuple[int, int, int]) -> Int8Experts:
            def leaf(name: str) -> torch.Tensor:
                return torch.stack(expert_tensors(experts, moe.num_local, projections, name)).to(device)

            return Int8Experts(
                leaf("weight").contiguous(), leaf("weight_scale").squeeze(-1).float().contiguous(), shape
            )

        replace_experts(
            moe, stacked(("gate_proj", "up_proj"), tuple(moe.w13.shape)), stacked(("down_proj",), tuple(moe.w2.shape))
        )
        return True

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(layer, x)
        m, n, k = rows.shape[0], layer.out_features, layer.in_features
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m:
            q, scale = quantize_per_token(rows)
            bm, bn, warps = gemm_blocks(m)
            bias = layer.bias if layer.bias is not None else out
            kernels.int8_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
                q, scale, layer.qweight, layer.channel_scale, bias, out, m, n, k, out.stride(0),
                HAS_BIAS=layer.bias is not None, BM=bm, BN=bn, BK=64, num_warps=warps,
            )  # fmt: skip
        return out.view(*x.shape[:-1], n)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes (out, in) -> int32 (ceil(in / pack), out): word j of a column holds inputs
    pack*j .. pack*j + pack - 1, input pack*j + i in bits bits*i and up (the tail padded with 0)."""
    pack = 32 // bits
    out_features, in_features = codes.shape
    words = -(-in_features // pack)
    padded = torch.zeros((words * pack, out_features), dtype=torch.int64, device=codes.device)
    padded[:in_features] = codes.T.to(torch.int64)
    shifts = torch.arange(pack, device=codes.device, dtype=torch.int64) * bits
    packed = (padded.view(words, pack, out_features) << shifts[None, :, None]).sum(dim=1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # the same bits, as int32
    return packed.to(torch.int32).contiguous()


def k_block(group: int) -> int | None:
    """The largest K tile (64 down to 16) that divides ``group``: each tile then lies in one group."""
    for bk in (64, 32, 16):
        if group % bk == 0:
            return bk
    return None


def _gemm_codes(
    scheme: QuantScheme, weight: torch.Tensor, zero: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """A layer's canonical (out, in) codes and zero points as the dequantizing GEMMs read them:
    (qweight, qzero (groups, out) fp32 or None, offset). Unsigned codes packed along the inputs:
    4-bit schemes with zero points hold them already; signed weights (symmetric, or 8-bit with zero
    points in int8) move up by ``offset`` = 2**(bits-1), and so does the zero. fp8: the float8
    values (in, out) as they are."""
    bits, floats = scheme.weight_bits, scheme.float_weights
    offset = 0 if floats or (bits == 4 and zero is not None) else 1 << (bits - 1)
    qweight = weight.T.contiguous() if floats else pack_codes(weight.to(torch.int32) + offset, bits)
    return qweight, None if zero is None else (zero.float() + offset).T.contiguous(), offset


class TritonDequantMethod(LinearMethod):
    """W4A16 / W8A16 / fp8 weights: packed integer (or fp8) weights widened tile by tile inside the GEMM."""

    takes_float_weights = True

    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme

    def process(self, layer: QuantLinear) -> None:
        k = layer.in_features
        weight, device = layer.weight.data, layer.weight.device
        groups = layer.weight_scale.shape[1]
        if layer.g_idx is not None:
            index = layer.g_idx.data.long()
        else:
            index = torch.arange(k, device=device) // (k // groups)
        perm = None
        if layer.g_idx is not None:  # act-order: inputs sorted by group; apply gathers x the same way
            perm = torch.argsort(index, stable=True)
            weight, index = weight[:, perm], index[perm]
        size = k // groups
        uniform = groups * size == k and torch.equal(index, torch.arange(k, device=device) // size)
        group = PER_CHANNEL if groups == 1 else size
        bk = 64 if groups == 1 else (k_block(size) if uniform else None)
        zero = None if layer.weight_zero is None else layer.weight_zero.data
        layer.qweight, layer.qzero, offset = _gemm_codes(layer.scheme, weight, zero)
        layer.qscale = layer.weight_scale.data.float().T.contiguous()  # (groups, out)
        layer.qgidx = None if bk is not None else index.to(torch.int32).contiguous()
        layer.qperm, layer.qblock = perm, (bk or 32, group, float(offset))
        del layer.weight, layer.weight_scale, layer.weight_zero, layer.g_idx

    def process_experts(self, moe, experts: dict[tuple[int, str], dict[str, torch.Tensor]]) -> bool:
        """Each expert's codes packed as ``process`` packs a layer's (gate and up rows stacked, as
        ``w13`` stacks them), or its float8 values as they are, into one ``QuantizedExperts`` per
        stacked weight; act-order experts, and groups not a multiple of 16 inputs, are left to be
        widened."""
        from kiln_cuda.moe import QuantizedExperts

        first, group = experts[0, "gate_proj"], self.scheme.group_size
        if "g_idx" in first or (group and group % 16):
            return False  # the grouped GEMM's K tiles (16 inputs at least) each lie in one group
        device, has_zero = moe.gate.weight.device, "weight_zero" in first

        def stacked(projections: tuple[str, ...], shape: tuple[int, int, int]) -> QuantizedExperts:
            def cat(leaf: str) -> list[torch.Tensor]:
                return [t.to(device) for t in expert_tensors(experts, moe.num_local, projections, leaf)]

            zeros = cat("weight_zero") if has_zero else [None] * moe.num_local
            qweights, qzeros, offsets = zip(*(_gemm_codes(self.scheme, w, z) for w, z in zip(cat("weight"), zeros)))
            scale = torch.stack([s.float().T for s in cat("weight_scale")]).contiguous()  # (experts, groups, N)
            zero = torch.stack(qzeros) if has_zero else None
            return QuantizedExperts(
                torch.stack(qweights), scale, zero, self.scheme.weight_bits, shape[2] // scale.shape[1],
                float(offsets[0]), shape, float8=self.scheme.float_weights,
            )  # fmt: skip

        replace_experts(
            moe, stacked(("gate_proj", "up_proj"), tuple(moe.w13.shape)), stacked(("down_proj",), tuple(moe.w2.shape))
        )
        return True

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(layer, x)
        if layer.qperm is not None:
            rows = rows.index_select(1, layer.qperm)
        m, n, k = rows.shape[0], layer.out_features, layer.in_features
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m:
            bk, group, zero = layer.qblock
            bm, bn, warps = gemm_blocks(m)
            qzero = layer.qzero if layer.qzero is not None else layer.qscale
            gidx = layer.qgidx if layer.qgidx is not None else layer.qweight
            bias = layer.bias if layer.bias is not None else out
            kernels.dequant_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
                rows, layer.qweight, layer.qscale, qzero, gidx, bias, out, m, n, k, rows.stride(0), out.stride(0),
                BITS=layer.scheme.weight_bits, GROUP=group, ZERO=zero, HAS_ZERO=layer.qzero is not None,
                HAS_GIDX=layer.qgidx is not None, HAS_BIAS=layer.bias is not None, FLOAT=layer.scheme.float_weights,
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BM=bm, BN=bn, BK=bk, num_warps=warps,
            )  # fmt: skip
        return out.view(*x.shape[:-1], n)


def linear_method(scheme: QuantScheme) -> LinearMethod | None:
    """The method for ``scheme``, or None where these kernels cannot run it."""
    if scheme.activation_bits == 8:
        ok = scheme.weight_bits == 8 and scheme.group_size is None and scheme.symmetric
        return TritonInt8Method() if ok else None
    if scheme.float_weights and not fp8_loads():
        return None  # widened at load
    if scheme.activation_bits is None and scheme.weight_bits in (4, 8):
        return TritonDequantMethod(scheme)
    return None


def fp8_loads() -> bool:
    """Whether Triton reads float8 e4m3 here: from compute capability 8.9 (Ada, Hopper) on a GPU,
    and always under the interpreter (no GPU)."""
    return not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9)
