"""Random quantized layers for the kernel tests of every platform, a quantized checkpoint's
weights dequantized into its original model (the reference transformers runs), rounded-to-nearest
quantized copies of a model beside their dequantized twins, and fp8 copies of a model."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from kiln.interfaces.quantization import QuantLinear, QuantScheme, dequantize, quantize_per_token
from kiln.models.loader import iter_weights, transformers_model
from kiln.quantization import rtn
from kiln.quantization.checkpoint import canonical_weights
from kiln.quantization.config import from_hf

# The scheme classes every platform's kernel tests cover (a platform adds its own on top).
SCHEMES = {
    "w8a8": QuantScheme(8, None, True, activation_bits=8),
    "w8a16": QuantScheme(8, None, True),
    "w4a16-awq": QuantScheme(4, 128, False),
    "w4a16-sym": QuantScheme(4, 64, True),
    "w4a16-actorder": QuantScheme(4, 32, False),
}


def random_quant_layer(
    scheme: QuantScheme, in_features: int, out_features: int, seed: int, bias: bool = False,
    act_order: bool = False, dtype: torch.dtype = torch.float32, g_idx: torch.Tensor | None = None,
) -> QuantLinear:  # fmt: skip
    """A ``QuantLinear`` (on the CPU) with random codes in the scheme's range, scales
    0.001..0.021 and zero points 0..15; act-order gets GPTQ's g_idx (groups of equal size,
    inputs shuffled) unless ``g_idx`` is given. ``dtype``: the activations'."""
    gen = torch.Generator().manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = QuantLinear(in_features, out_features, bias, scheme, act_order=act_order or g_idx is not None)
    finally:
        torch.set_default_dtype(default)
    top = 2 ** (scheme.weight_bits - 1)
    low, high = (-top + 1, top) if scheme.symmetric else (0, 2 * top)
    with torch.no_grad():
        if scheme.float_weights:  # fp8: every magnitude e4m3 has, subnormals among them
            layer.weight.copy_((torch.randn(layer.weight.shape, generator=gen) * 64).to(layer.weight.dtype))
        else:
            layer.weight.copy_(torch.randint(low, high, layer.weight.shape, generator=gen))
        layer.weight_scale.copy_(torch.rand(layer.weight_scale.shape, generator=gen) * 0.02 + 0.001)
        if layer.weight_zero is not None:
            layer.weight_zero.copy_(torch.randint(0, 16, layer.weight_zero.shape, generator=gen))
        if g_idx is not None:
            layer.g_idx.copy_(g_idx)
        elif layer.g_idx is not None:
            groups = in_features // scheme.group_size
            layer.g_idx.copy_(torch.arange(in_features)[torch.randperm(in_features, generator=gen)] % groups)
        if bias:
            layer.bias.normal_(generator=gen)
    return layer


def random_experts(
    scheme: QuantScheme, experts: int, hidden: int, inter: int, seed: int
) -> tuple[dict[tuple[int, str], dict[str, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """Random quantized experts (``random_quant_layer``'s codes) as ``LinearMethod.process_experts``
    is handed them, per (expert, projection), and the stacked weights they widen to: w13
    (experts, 2 * inter, hidden), gate rows then up rows, and w2 (experts, hidden, inter)."""
    parts, widened = {}, {}
    shapes = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    for e in range(experts):
        for i, (proj, shape) in enumerate(shapes.items()):
            layer = random_quant_layer(scheme, *shape, seed=seed + 3 * e + i)
            tensors = {"weight": layer.weight.data, "weight_scale": layer.weight_scale.data}
            if layer.weight_zero is not None:
                tensors["weight_zero"] = layer.weight_zero.data
            parts[e, proj] = tensors
            widened[e, proj] = dequantize(layer)
    w13 = torch.stack([torch.cat([widened[e, "gate_proj"], widened[e, "up_proj"]]) for e in range(experts)])
    w2 = torch.stack([widened[e, "down_proj"] for e in range(experts)])
    return parts, w13, w2


def w8a8_expert(
    parts: dict[tuple[int, str], dict[str, torch.Tensor]], e: int, rows: torch.Tensor, kernel: torch.dtype,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """Expert ``e`` of ``random_experts``' W8A8 ``parts`` on fp32 ``rows`` with W8A8's reference
    products (rows quantized per token, exact integer sums, channel and token scales), as a
    platform computes it: each product rounded to its kernels' output dtype ``kernel``, the SwiGLU
    between them to the activations' ``dtype`` (the next product's int8 roundings follow from
    those values)."""
    from kiln.interfaces.model import silu_and_mul

    def product(rows: torch.Tensor, projections: tuple[str, ...]) -> torch.Tensor:
        codes = torch.cat([parts[e, p]["weight"] for p in projections]).double()
        scale = torch.cat([parts[e, p]["weight_scale"] for p in projections]).view(-1)
        q, token_scale = quantize_per_token(rows)
        return ((q.double() @ codes.T).float() * scale * token_scale).to(kernel).float()

    hidden = silu_and_mul(product(rows, ("gate_proj", "up_proj"))).to(dtype).float()
    return product(hidden, ("down_proj",))


def gptq_act_order(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]:
    """Symmetric 4-bit codes of ``w`` rounded to nearest in groups of shuffled inputs, and the
    g_idx naming them (canonical tensors, as a GPTQ act-order checkpoint holds them): one order per
    input width, so projections of one input (q/k/v, gate/up) share it, as GPTQ's do."""
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(w.shape[1]))
    g = w[:, perm].reshape(w.shape[0], -1, group)
    scale = (g.abs().amax(-1) / 7.5).half().float()
    codes = torch.clamp(torch.round(g / scale[..., None]), -8, 7).reshape(w.shape)
    inverse = torch.argsort(perm)
    return codes[:, inverse].to(torch.int8), scale, None, (inverse // group).to(torch.int32)


# Every decoder projection, the experts' included; not the routers (mlp.gate, shared_expert_gate).
PROJECTION = re.compile(r"(_proj|_proj_with_mqa|experts\.\d+\.w[123])$")


def _rounded(method: str, w: torch.Tensor, group: int) -> tuple:
    """Canonical tensors of ``w`` rounded to nearest: AWQ 4-bit with zero points, GPTQ act-order
    4-bit, or int8 per channel (weight_only_int8, smooth_quant)."""
    if method == "awq":
        return (*rtn.int4_asymmetric(w, group), None)
    if method == "gptq":
        return gptq_act_order(w, group)
    return (*rtn.int8_per_channel(w), None, None)


def rounded_copy(source: str, folder: Path, method: str, group: int) -> tuple[str, str]:
    """``source`` (one safetensors file) with every decoder projection rounded to nearest and
    written as ``method``'s checkpoints are (``folder``/q), and the same model with those weights
    dequantized (``folder``/deq: what transformers can run). Checkpoint names, not transformers
    modules, pick the projections, so stacked experts and fused projections are covered too."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kiln.quantization.checkpoint import checkpoint_tensors, widen_quantized
    from kiln.quantization.tool import hf_quantization_config

    qc = hf_quantization_config(method, group, act_order=method == "gptq")
    quant = from_hf(qc)
    tensors = load_file(str(Path(source) / "model.safetensors"))
    written = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and ".layers." in module and PROJECTION.search(module):
            parts = _rounded(method, tensor.float(), group)
            written |= {f"{module}.{k}": v for k, v in checkpoint_tensors(quant, *parts, torch.float16).items()}
        else:
            written[name] = tensor
    dequantized = dict(widen_quantized(iter(written.items()), quant))
    folders = []
    for name, state, extra in (("q", written, {"quantization_config": qc}), ("deq", dequantized, {})):
        out = Path(folder) / name
        shutil.copytree(source, out)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **extra}))
        folders.append(str(out))
    return folders[0], folders[1]


def assert_serves_dequantized(
    source: str, folder: Path, method: str, group: int, prompts: list[list[int]], **engine_args: object
):
    """Kiln serves ``source`` rounded to ``method`` (``rounded_copy``) token for token as
    transformers serves the dequantized weights, and the rounding moved transformers' outputs
    from the original's; returns the ``LLM``."""
    from kiln.testing.models import FAMILY_TOKENS, assert_generates, hf_greedy

    quantized, dequantized = rounded_copy(source, folder, method, group)
    expected = hf_greedy(dequantized, prompts, FAMILY_TOKENS)
    assert expected != hf_greedy(source, prompts, FAMILY_TOKENS)
    return assert_generates(quantized, prompts, expected, **engine_args)


def dequantized_copy(quantized: str, original: str, target: str) -> str:
    """The original fp32 model with the quantized checkpoint's tensors: its quantized linears
    dequantized, and the ones the algorithm rescaled (norms) as written."""
    from transformers import AutoModelForCausalLM

    quant = from_hf(json.loads(open(os.path.join(quantized, "config.json")).read())["quantization_config"])
    tensors = dict(canonical_weights(iter_weights(quantized), quant))
    model = transformers_model(AutoModelForCausalLM, original, dtype=torch.float32)
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name in state and tensor.is_floating_point():
                state[name].copy_(tensor)
        for name, module in model.named_modules():
            if f"{name}.weight_scale" in tensors:
                layer = QuantLinear(module.in_features, module.out_features, False, quant.scheme, quant.desc_act)
                for leaf in ("weight", "weight_scale", "weight_zero", "g_idx"):
                    if f"{name}.{leaf}" in tensors:
                        getattr(layer, leaf).data.copy_(tensors[f"{name}.{leaf}"])
                module.weight.copy_(dequantize(layer))
    model.save_pretrained(target)
    return target


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def fp8_quantize(
    weight: torch.Tensor, block: tuple[int, int] | None, per_row: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 values and their scales (amax / 448 per block, row or tensor)."""
    from kiln.quantization.fp8 import widen

    rows, cols = weight.shape
    if block is not None:
        br, bc = block
        padded = torch.zeros(-(-rows // br) * br, -(-cols // bc) * bc)
        padded[:rows, :cols] = weight
        blocks = padded.unflatten(0, (-1, br)).unflatten(2, (-1, bc))  # (R, br, C, bc)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    elif per_row:
        scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
    else:
        scale = weight.abs().amax() / FP8_MAX
    grid = widen(torch.ones(rows, cols), scale, block)  # the scale of each value
    return (weight / grid).to(torch.float8_e4m3fn), scale


def fp8_copy(source: str, folder: Path, config: dict) -> tuple[Path, Path]:
    """``source`` with its decoder projections (experts' included) in fp8 as ``config`` (a ``quantization_config``)
    lays them out (``folder``), and the same model with those weights widened back to fp32
    (``folder``-widened: transformers' reference). A static activation scheme gets (unused)
    input scales, as such checkpoints carry."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kiln.quantization.config import fp8_layout
    from kiln.quantization.fp8 import widen

    layout = fp8_layout(config)
    per_row = config.get("quant_method") == "compressed-tensors" and layout.block is None
    widened = folder.parent / f"{folder.name}-widened"
    for target in (folder, widened):
        shutil.copytree(source, target)
    tensors = load_file(str(Path(source) / "model.safetensors"))
    quantized, plain = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and PROJECTION.search(name.removesuffix(".weight")):
            q, scale = fp8_quantize(tensor.float(), layout.block, per_row=per_row)
            layer = name.removesuffix(".weight")
            quantized[name], quantized[f"{layer}.{layout.scale_name}"] = q, scale
            if config.get("activation_scheme") == "static":
                quantized[f"{layer}.input_scale"] = torch.tensor(0.02)
            plain[name] = widen(q, scale, layout.block)
        else:
            quantized[name] = plain[name] = tensor
    save_file(quantized, str(folder / "model.safetensors"))
    save_file(plain, str(widened / "model.safetensors"))
    hf_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf_config, "quantization_config": config}))
    return folder, widened
