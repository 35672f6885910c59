"""Quantized linear layers on Ascend NPUs (``Platform.linear_method``) through torch_npu's kernels.

W8A8 (SmoothQuant, compressed-tensors int8 weights with dynamic per-token int8 activations), as
vllm-ascend's W8A8_DYNAMIC method::

    q, s_tok = npu_dynamic_quant(x)          # s_tok = row_max(|x|) / 127, q = round(x / s_tok)
    y = npu_quant_matmul(q, W, s_ch, pertoken_scale=s_tok, bias=b, output_dtype=x.dtype)
      = (q @ W) * s_ch * s_tok + b           # W int8 (in, out), s_ch fp32 (out,), b fp32

the per-token int8 product of ``ReferenceLinearMethod``.

W8A16 / W4A16 (weight_only_int8, AWQ, GPTQ)::

    y = npu_weight_quant_batchmatmul(x, W, scale, offset, bias=b, antiquant_group_size=g)
      = x @ ((W + offset) * scale) + b

Kiln's weights are ``w = (q - zero) * scale``, so the kernel's offset is ``-zero``. 4-bit weights go
in as signed int4 ([-8, 7]) packed eight to an int32 by ``npu_convert_weight_to_int4pack``: unsigned
codes (0..15, AWQ and asymmetric GPTQ) as ``q - 8`` with offset ``8 - zero``; symmetric checkpoints
hold signed values already and need no offset. Scale and offset are (out,) per channel, with the
weight passed transposed (a (in, out) view of the (out, in) tensor, the layout the API reference
recommends per channel), or (groups, out) per group, with the weight (in, out) contiguous. GPTQ
act-order layers have their input columns sorted by group in ``process`` and the activations
permuted to match in ``apply`` (as the CPU plugin does), which makes the groups contiguous.

Dtypes: the kernels take fp16 or bf16 activations, with the weight scales in that dtype for the
weight-only kernel, and return that dtype. A model served in fp32 runs these layers in fp16 (11
significant bits against bf16's 8) and widens the result; its bias is then added in fp32, and its
W8A8 activations are quantized in fp32 by torch ops (``quantize_per_token``, the reference's own),
since ``npu_dynamic_quant`` takes fp16/bf16 only and rounding them to fp16 first would move some
int8 roundings.

Mixtures of experts (``process_experts``): int8 codes per channel (W8A8, weight-only int8) stay
int8, and 4-bit codes (AWQ, GPTQ without act-order; per channel or in groups of a multiple of 32)
go in as int4 packed eight to an int32 along the outputs, each expert's (in, out) weight as
``npu_convert_weight_to_int4pack`` packs a linear layer's, for ``npu_grouped_matmul``'s quantized
forms (``kiln_ascend.moe``); the op takes int8 pseudo-quantized weights per channel only, so
grouped 8-bit experts are widened to the model's dtype, as are act-order ones.

Layers the kernels refuse run the reference method instead, with a warning: a group size that is
not a multiple of 32, inputs or outputs above 65535, 4-bit layers whose packed dimension is not a
multiple of 8, act-order groups of unequal sizes.
"""

from __future__ import annotations

import logging

import torch

from kiln.interfaces.quantization import (
    LinearMethod,
    QuantLinear,
    QuantScheme,
    ReferenceLinearMethod,
    expert_tensors,
    group_index,
    quantize_per_token,
    replace_experts,
)

logger = logging.getLogger("kiln.ascend")

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_DIM = 65535  # npu_weight_quant_batchmatmul's limit on k and n (and npu_quant_matmul's on n)


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype inside the kernels: the model's if fp16/bf16, else fp16."""
    return dtype if dtype in KERNEL_DTYPES else torch.float16


def _register(layer: QuantLinear, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        layer.register_buffer(name, tensor, persistent=False)


def _set_bias(layer: QuantLinear, kernel_bias_dtype: torch.dtype) -> None:
    """``npu_bias``: the bias as the kernel adds it (fp16/bf16 models); ``npu_bias_after``: for fp32
    models, added to the widened result in fp32. At most one of them is set."""
    bias = None if layer.bias is None else layer.bias.data
    in_kernel = bias is not None and layer.dtype in KERNEL_DTYPES
    _register(
        layer,
        npu_bias=bias.to(kernel_bias_dtype) if in_kernel else None,
        npu_bias_after=bias.float() if bias is not None and not in_kernel else None,
    )


def _finish(layer: QuantLinear, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if layer.npu_bias_after is not None:
        out = out.float() + layer.npu_bias_after
    return out.to(x.dtype).view(*x.shape[:-1], layer.out_features)


class AscendW8A8Method(LinearMethod):
    """W8A8: ``npu_dynamic_quant`` then ``npu_quant_matmul`` with per-token and per-channel scales."""

    @staticmethod
    def unsupported(layer: QuantLinear) -> str | None:
        if layer.out_features > MAX_DIM:
            return f"{layer.out_features} outputs (npu_quant_matmul takes at most {MAX_DIM})"
        return None

    def process(self, layer: QuantLinear) -> None:
        layer.npu_dtype = kernel_dtype(layer.dtype)
        _register(
            layer,
            npu_weight=layer.weight.data.T.contiguous(),  # (in, out), as vllm-ascend's W8A8_DYNAMIC
            npu_scale=layer.weight_scale.data.reshape(-1).float().contiguous(),  # (out,) fp32
        )
        _set_bias(layer, torch.float32)  # fp32 bias: accepted with fp16 and bf16 outputs alike
        del layer.weight, layer.weight_scale

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        import torch_npu

        rows = x.reshape(-1, layer.in_features)
        if rows.shape[0] == 0:  # the kernels refuse empty tensors
            return x.new_empty(*x.shape[:-1], layer.out_features)
        if layer.dtype in KERNEL_DTYPES:
            q, token_scale = torch_npu.npu_dynamic_quant(rows)
        else:  # fp32: npu_dynamic_quant takes fp16/bf16, and rounding to fp16 first would move int8 roundings
            q, token_scale = quantize_per_token(rows)
            token_scale = token_scale.view(-1)
        out = torch_npu.npu_quant_matmul(
            q, layer.npu_weight, layer.npu_scale, pertoken_scale=token_scale, bias=layer.npu_bias,
            output_dtype=layer.npu_dtype,
        )  # fmt: skip
        return _finish(layer, out, x)


class AscendWeightOnlyMethod(LinearMethod):
    """W8A16 / W4A16: ``npu_weight_quant_batchmatmul`` on int8 or int4-packed weights."""

    @staticmethod
    def _sorted_groups(layer: QuantLinear) -> tuple[torch.Tensor | None, int]:
        """The input permutation (act-order only) and the kernel's group size (0: per channel)."""
        index = group_index(layer).to(layer.weight.device)
        perm = torch.argsort(index, stable=True) if layer.g_idx is not None else None
        groups = layer.weight_scale.shape[1]
        return perm, (layer.in_features // groups if groups > 1 else 0)

    @classmethod
    def unsupported(cls, layer: QuantLinear) -> str | None:
        k, n = layer.in_features, layer.out_features
        if k > MAX_DIM or n > MAX_DIM:
            return f"{k} inputs x {n} outputs (npu_weight_quant_batchmatmul takes at most {MAX_DIM} each)"
        perm, group = cls._sorted_groups(layer)
        if group and group % 32:
            return f"group size {group} (npu_weight_quant_batchmatmul takes multiples of 32)"
        if perm is not None:
            index = group_index(layer).to(perm.device)[perm]
            contiguous = torch.arange(k, device=perm.device) // (group or k)
            if not torch.equal(index, contiguous):
                return "act-order groups of unequal sizes"
        if layer.scheme.weight_bits == 4 and (n if group else k) % 8:
            return f"{n if group else k} {'outputs' if group else 'inputs'} (int4 packing needs a multiple of 8)"
        return None

    def process(self, layer: QuantLinear) -> None:
        dtype = kernel_dtype(layer.dtype)
        perm, group = self._sorted_groups(layer)
        weight = layer.weight.data if perm is None else layer.weight.data[:, perm]
        zero = layer.weight_zero.data if layer.weight_zero is not None else None
        # Unsigned 4-bit codes become signed int4: (q - zero) = (q - 8) + (8 - zero).
        shift = 8 if layer.scheme.weight_bits == 4 and zero is not None else 0
        scale, offset = layer.weight_scale.data, None if zero is None else shift - zero.float()
        if group:  # (groups, out); the weight (in, out) contiguous, as the reference recommends per group
            scale, offset = scale.T, None if offset is None else offset.T
            kernel_weight = weight.T
        else:  # (out,); the weight as a transposed (in, out) view of the (out, in) tensor
            scale, offset = scale.reshape(-1), None if offset is None else offset.reshape(-1)
            kernel_weight = weight
        if layer.scheme.weight_bits == 4:
            import torch_npu

            kernel_weight = torch_npu.npu_convert_weight_to_int4pack(
                (kernel_weight.to(torch.int32) - shift).contiguous()
            )
        else:  # int8 as it is (8-bit codes are never shifted)
            kernel_weight = kernel_weight.contiguous()
        layer.npu_dtype, layer.npu_group, layer.npu_transposed = dtype, group, not group
        _register(
            layer,
            npu_weight=kernel_weight,
            npu_scale=scale.to(dtype).contiguous(),
            npu_offset=None if offset is None else offset.to(dtype).contiguous(),
            npu_perm=perm,
        )
        _set_bias(layer, torch.float16 if dtype == torch.float16 else torch.float32)  # the kernel's rule
        del layer.weight, layer.weight_scale, layer.weight_zero, layer.g_idx

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        import torch_npu

        rows = x.reshape(-1, layer.in_features)
        if rows.shape[0] == 0:  # the kernel refuses empty tensors
            return x.new_empty(*x.shape[:-1], layer.out_features)
        if layer.npu_perm is not None:
            rows = rows[:, layer.npu_perm]
        weight = layer.npu_weight.T if layer.npu_transposed else layer.npu_weight
        out = torch_npu.npu_weight_quant_batchmatmul(
            rows.to(layer.npu_dtype), weight, layer.npu_scale, antiquant_offset=layer.npu_offset,
            bias=layer.npu_bias, antiquant_group_size=layer.npu_group,
        )  # fmt: skip
        return _finish(layer, out, x)


class AscendLinearMethod(LinearMethod):
    """Chooses per layer: the scheme's torch_npu kernels where the layer fits them, else the reference."""

    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme
        self.kernel = AscendW8A8Method() if scheme.activation_bits == 8 else AscendWeightOnlyMethod()
        self.reference = ReferenceLinearMethod()

    def process(self, layer: QuantLinear) -> None:
        reason = self.kernel.unsupported(layer)
        if reason is not None:
            logger.warning("%s: %s; using the (slow) reference method", layer, reason)
        layer.npu_method = self.reference if reason is not None else self.kernel
        layer.npu_method.process(layer)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return layer.npu_method.apply(layer, x)

    def process_experts(self, moe, experts: dict[tuple[int, str], dict[str, torch.Tensor]]) -> bool:
        """The experts' codes stacked (gate and up rows as ``w13`` stacks them) for
        ``npu_grouped_matmul``: W8A8 with per-token activations; weight-only int8 per channel and
        int4 pseudo-quantized. Other experts (grouped int8, act-order, groups not a multiple of 32,
        a dimension past the op's limit or outputs not a multiple of 8 for int4) are widened."""
        from kiln_ascend.moe import QuantizedExperts

        first, bits, group = experts[0, "gate_proj"], self.scheme.weight_bits, self.scheme.group_size or 0
        sizes = (*moe.w13.shape[1:], moe.w2.shape[1])
        if "g_idx" in first or max(sizes) > MAX_DIM or (bits == 8 and group) or group % 32:
            return False
        if bits == 4 and (group and moe.w2.shape[2] % group or min(moe.w13.shape[1], moe.w2.shape[1]) % 8):
            return False
        w8a8, dtype = self.scheme.activation_bits == 8, kernel_dtype(moe.w13.dtype)
        device = moe.gate.weight.device
        # Unsigned 4-bit codes become signed int4, as for a linear layer: (q - zero) = (q - 8) + (8 - zero).
        shift = 8 if bits == 4 and "weight_zero" in first else 0

        def stacked(projections: tuple[str, ...], shape: tuple[int, int, int]) -> QuantizedExperts:
            def leaf(name: str) -> torch.Tensor:  # (experts, N, groups or K)
                return torch.stack(expert_tensors(experts, moe.num_local, projections, name)).to(device)

            codes = leaf("weight")
            if bits == 4:
                import torch_npu

                pack = torch_npu.npu_convert_weight_to_int4pack
                weight = torch.stack([pack((w.T.to(torch.int32) - shift).contiguous()) for w in codes])  # (E, K, N/8)
            else:
                weight = codes.contiguous().transpose(1, 2)  # (experts, K, N), as the op reads it transposed
            scale = leaf("weight_scale").float().transpose(1, 2)  # (experts, groups, N)
            offset = shift - leaf("weight_zero").float().transpose(1, 2) if "weight_zero" in first else None
            if not group:  # per channel: (experts, N)
                scale, offset = scale.squeeze(1), None if offset is None else offset.squeeze(1)
            if w8a8:  # fp32 scales give fp16 outputs, bf16 scales bf16 ones (the API reference's table)
                scale = scale if dtype == torch.float16 else scale.to(torch.bfloat16)
            else:
                scale, offset = scale.to(dtype), None if offset is None else offset.to(dtype).contiguous()
            return QuantizedExperts(weight, scale.contiguous(), offset, w8a8, dtype, shape)

        replace_experts(
            moe, stacked(("gate_proj", "up_proj"), tuple(moe.w13.shape)), stacked(("down_proj",), tuple(moe.w2.shape))
        )
        return True


def linear_method(scheme: QuantScheme) -> LinearMethod | None:
    """The Ascend method for ``scheme``; None for schemes no torch_npu kernel computes (int8 activations
    with other than per-channel symmetric int8 weights, weights other than 4- or 8-bit)."""
    if scheme.weight_bits not in (4, 8):
        return None
    if scheme.activation_bits == 8 and (scheme.weight_bits != 8 or scheme.group_size or not scheme.symmetric):
        return None
    if scheme.activation_bits not in (None, 8):
        return None
    return AscendLinearMethod(scheme)
