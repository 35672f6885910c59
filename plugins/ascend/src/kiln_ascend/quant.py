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
    group_index,
    quantize_per_token,
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
