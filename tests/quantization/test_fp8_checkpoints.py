"""fp8 checkpoints (``quant_method: fp8`` per tensor or in blocks, as DeepSeek-V3 and Qwen3-FP8 ship
them, and compressed-tensors float8 per channel): weights quantized here to float8 e4m3 with real
scales, served by Kiln after widening, token for token against transformers on the widened weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.quantization.config import Fp8Layout, fp8_layout, resolve
from kiln.quantization.fp8 import widen, widen_fp8
from kiln.testing.models import FAMILY_TOKENS, assert_generates, hf_greedy

FP8_MAX = 448.0  # the largest float8 e4m3 value
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7]]
BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [48, 48]}
TENSOR_CONFIG = {"quant_method": "fp8", "activation_scheme": "static"}
CHANNEL_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
    }},
}  # fmt: skip
LAYOUTS = {"block": BLOCK_CONFIG, "tensor": TENSOR_CONFIG, "channel": CHANNEL_CONFIG}


def quantize(weight: torch.Tensor, block: tuple[int, int] | None, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 values and their scales (amax / 448 per block, row or tensor)."""
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
    """``source`` with its decoder projections in fp8 (``folder``), and the same model with those
    weights widened back to fp32 (``folder``-widened: transformers' reference)."""
    layout = fp8_layout(config)
    widened = folder.parent / f"{folder.name}-widened"
    for target in (folder, widened):
        shutil.copytree(source, target)
    tensors = load_file(str(Path(source) / "model.safetensors"))
    quantized, plain = {}, {}
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight"):
            q, scale = quantize(tensor.float(), layout.block, per_row=config is CHANNEL_CONFIG)
            layer = name.removesuffix(".weight")
            quantized[name], quantized[f"{layer}.{layout.scale_name}"] = q, scale
            if config is TENSOR_CONFIG:
                quantized[f"{layer}.input_scale"] = torch.tensor(0.02)
            plain[name] = widen(q, scale, layout.block)
        else:
            quantized[name] = plain[name] = tensor
    save_file(quantized, str(folder / "model.safetensors"))
    save_file(plain, str(widened / "model.safetensors"))
    hf_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf_config, "quantization_config": config}))
    return folder, widened


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_checkpoints_generate_as_their_widened_weights(tiny_model_dir, tmp_path, layout):
    folder, widened = fp8_copy(tiny_model_dir("llama"), tmp_path / f"fp8-{layout}", LAYOUTS[layout])
    stored = load_file(str(folder / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    expected = hf_greedy(str(widened), PROMPTS, FAMILY_TOKENS)
    assert expected != hf_greedy(tiny_model_dir("llama"), PROMPTS, FAMILY_TOKENS)  # fp8 moved the outputs
    assert_generates(str(folder), PROMPTS, expected)
    assert_generates(str(folder), PROMPTS, expected, quantization="fp8")


def test_block_scales_cover_partial_blocks():
    """Blocks of 32 rows by 48 columns (not square: rows and columns cannot be swapped unseen)."""
    weight = torch.randn(100, 70)
    q, scale = quantize(weight, (32, 48), per_row=False)
    assert scale.shape == (4, 2)
    back = widen(q, scale, (32, 48))
    for (r, c), s in zip([(0, 0), (99, 69), (40, 10), (70, 50)], [scale[0, 0], scale[3, 1], scale[1, 0], scale[2, 1]]):
        assert back[r, c] == q[r, c].float() * s  # each value with its own block's scale
    torch.testing.assert_close(back, weight, atol=0.0, rtol=0.07)  # e4m3 keeps 3 mantissa bits


def test_fp8_stream_pairs_weights_with_scales_in_any_order():
    w = torch.randn(4, 8)
    q, scale = quantize(w, None, per_row=False)
    assert scale.dim() == 0
    one = torch.tensor(1.0)
    kv_scales = [("k_proj.output_scale", one), ("attn.kv_scale", one), ("attn.k_scale", one), ("attn.v_scale", one)]
    stream = [("a.weight_scale", scale), ("a.weight", q), ("a.input_scale", one), *kv_scales, ("norm.weight", w)]
    out = dict(widen_fp8(stream, Fp8Layout("weight_scale")))
    assert set(out) == {"a.weight", "norm.weight"} and out["norm.weight"] is w
    with pytest.raises(ValueError, match=r"fp8 checkpoint: b.weight_scale is missing \(it has b.weight\)"):
        list(widen_fp8([("b.weight", q)], Fp8Layout("weight_scale")))


def test_fp8_flag_resolution():
    assert resolve(None, BLOCK_CONFIG) is None and resolve("fp8", CHANNEL_CONFIG) is None
    with pytest.raises(ValueError, match="--quantization awq: the checkpoint's weights are fp8"):
        resolve("awq", BLOCK_CONFIG)
    with pytest.raises(ValueError, match="fp8: format 'e5m2'"):
        fp8_layout({**BLOCK_CONFIG, "fmt": "e5m2"})
    groups = {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "channel"}}}
    with pytest.raises(ValueError, match="compressed-tensors: float weights"):
        fp8_layout({"quant_method": "compressed-tensors", "config_groups": groups})
    groups["g"]["weights"].update(num_bits=8, strategy="block", block_structure="128x128")
    with pytest.raises(ValueError, match=r"block strategy needs block_structure \[rows, columns\], got '128x128'"):
        fp8_layout({"quant_method": "compressed-tensors", "config_groups": groups})
    groups["g"]["weights"]["block_structure"] = [128, 64]
    assert fp8_layout({"quant_method": "compressed-tensors", "config_groups": groups}) == Fp8Layout(
        "weight_scale", (128, 64)
    )
