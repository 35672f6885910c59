"""fp8 checkpoints (``quant_method: fp8`` per tensor or in blocks, as DeepSeek-V3 and Qwen3-FP8 ship
them, and compressed-tensors float8 per channel): weights quantized here to float8 e4m3 with real
scales, served by Kiln after widening, token for token against transformers on the widened weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kiln.interfaces.quantization import QuantLinear, dequantize
from kiln.quantization.config import Fp8Layout, QuantConfig, QuantScheme, fp8_layout, fp8_scheme, resolve
from kiln.quantization.fp8 import fp8_weights, widen, widen_fp8
from kiln.testing.models import FAMILY_TOKENS, assert_generates, hf_greedy
from kiln.testing.quantization import fp8_copy, fp8_quantize

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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_checkpoints_generate_as_their_widened_weights(tiny_model_dir, tmp_path, layout):
    folder, widened = fp8_copy(tiny_model_dir("llama"), tmp_path / f"fp8-{layout}", LAYOUTS[layout])
    stored = load_file(str(folder / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    expected = hf_greedy(str(widened), PROMPTS, FAMILY_TOKENS)
    assert expected != hf_greedy(tiny_model_dir("llama"), PROMPTS, FAMILY_TOKENS)  # fp8 moved the outputs
    assert_generates(str(folder), PROMPTS, expected)
    assert_generates(str(folder), PROMPTS, expected, quantization="fp8")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_fp8_mixtures_generate_as_their_widened_weights(tiny_model_dir, tmp_path, model_type):
    """Experts in fp8 too (Mixtral's w1/w2/w3, the Qwen MoEs' projections), in blocks."""
    folder, widened = fp8_copy(
        tiny_model_dir(model_type), tmp_path / "fp8", BLOCK_CONFIG | {"weight_block_size": [16, 32]}
    )
    stored = load_file(str(folder / "model.safetensors"))
    assert any(".experts." in name and t.dtype == torch.float8_e4m3fn for name, t in stored.items())
    assert_generates(str(folder), PROMPTS, hf_greedy(str(widened), PROMPTS, FAMILY_TOKENS))


def test_block_scales_cover_partial_blocks():
    """Blocks of 32 rows by 48 columns (not square: rows and columns cannot be swapped unseen)."""
    weight = torch.randn(100, 70)
    q, scale = fp8_quantize(weight, (32, 48), per_row=False)
    assert scale.shape == (4, 2)
    back = widen(q, scale, (32, 48))
    for (r, c), s in zip([(0, 0), (99, 69), (40, 10), (70, 50)], [scale[0, 0], scale[3, 1], scale[1, 0], scale[2, 1]]):
        assert back[r, c] == q[r, c].float() * s  # each value with its own block's scale
    torch.testing.assert_close(back, weight, atol=0.0, rtol=0.07)  # e4m3 keeps 3 mantissa bits


def test_fp8_stream_pairs_weights_with_scales_in_any_order():
    w = torch.randn(4, 8)
    q, scale = fp8_quantize(w, None, per_row=False)
    assert scale.dim() == 0
    one = torch.tensor(1.0)
    kv_scales = [("k_proj.output_scale", one), ("attn.kv_scale", one), ("attn.k_scale", one), ("attn.v_scale", one)]
    stream = [("a.weight_scale", scale), ("a.weight", q), ("a.input_scale", one), *kv_scales, ("norm.weight", w)]
    out = dict(widen_fp8(stream, Fp8Layout("weight_scale")))
    assert set(out) == {"a.weight", "norm.weight"} and out["norm.weight"] is w
    with pytest.raises(ValueError, match=r"fp8 checkpoint: b.weight_scale is missing \(it has b.weight\)"):
        list(widen_fp8([("b.weight", q)], Fp8Layout("weight_scale")))


def test_fp8_weights_in_canonical_form():
    """What a platform with an fp8 kernel loads: each weight as stored, its scale (a scalar, one per
    row, or a grid of 32 x 48 blocks, the last partial) repeated to one per row and group of 48
    inputs, which the canonical widening turns into each value times its own scale."""
    w = torch.randn(100, 96)
    for block, per_row in ((None, False), (None, True), ((32, 48), False)):
        q, scale = fp8_quantize(w, block, per_row=per_row)
        if block is None:
            grid = scale.reshape(-1, 1) if per_row else scale
        else:
            grid = scale[torch.arange(100) // 32][:, torch.arange(96) // 48]
        stream = [("a.weight", q), ("a.weight_scale", scale), ("a.input_scale", torch.tensor(1.0))]
        out = dict(fp8_weights(stream, Fp8Layout("weight_scale", block)))
        assert set(out) == {"a.weight", "a.weight_scale"} and out["a.weight"] is q
        assert out["a.weight_scale"].shape == (100, 1 if block is None else 2)
        layer = QuantLinear(96, 100, False, fp8_scheme(Fp8Layout("weight_scale", block)), act_order=False)
        layer.weight.data.copy_(out["a.weight"])
        layer.weight_scale.data.copy_(out["a.weight_scale"])
        assert torch.equal(dequantize(layer), q.float() * grid)
    with pytest.raises(ValueError, match="fp8 checkpoint: b.weight is torch.float8_e5m2"):
        list(fp8_weights([("b.weight", q.to(torch.float8_e5m2)), ("b.weight_scale", scale)], Fp8Layout("weight_scale")))


def test_fp8_flag_resolution():
    """fp8 checkpoints resolve to fp8 weights (a platform without an fp8 kernel widens them)."""
    block = QuantConfig("fp8", QuantScheme(8, 48, True, float_weights=True), ("lm_head",))
    assert resolve(None, BLOCK_CONFIG) == block and block.label == "fp8 fp8a16 (group 48, symmetric)"
    assert resolve("fp8", CHANNEL_CONFIG) == QuantConfig("fp8", QuantScheme(8, None, True, float_weights=True))
    skipped = resolve(None, {**BLOCK_CONFIG, "modules_to_not_convert": ["model.layers.0.self_attn", "mlp.gate_proj"]})
    assert not skipped.quantizes("model.layers.0.self_attn.q_proj")  # a module's prefix, as transformers reads it
    assert not skipped.quantizes("model.layers.1.mlp.gate_proj") and not skipped.quantizes("lm_head")
    assert skipped.quantizes("model.layers.1.self_attn.q_proj") and skipped.quantizes("model.layers.0.mlp.up_proj")
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


def test_fp8_weights_only_where_a_method_takes_them():
    """fp8 weights stay fp8 only with a platform method that says it computes them, in a model with
    quantized layers, and with blocks that tile every layer's inputs on a rank (experts' included);
    else widened."""
    from types import SimpleNamespace

    from kiln.interfaces.quantization import ReferenceLinearMethod
    from kiln.models.llama import LlamaForCausalLM
    from kiln.models.moe import MixtralForCausalLM
    from kiln.worker.builder import _fp8_widened

    class IntegersOnly(ReferenceLinearMethod):  # a plugin's method written before fp8 weights
        takes_float_weights = False

    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=4, intermediate_size=192)  # head_dim 16
    one, two = SimpleNamespace(size=1), SimpleNamespace(size=2)
    scheme = fp8_scheme(Fp8Layout("weight_scale_inv", (32, 32)))
    assert _fp8_widened(scheme, ReferenceLinearMethod(), LlamaForCausalLM, cfg, one) is None
    assert _fp8_widened(scheme, IntegersOnly(), LlamaForCausalLM, cfg, one) == "the platform has no fp8 kernel"
    assert _fp8_widened(scheme, None, LlamaForCausalLM, cfg, one) == "the platform has no fp8 kernel"
    # a mixture keeps fp8 too (its experts where the platform takes them), if blocks tile its experts
    assert _fp8_widened(scheme, ReferenceLinearMethod(), MixtralForCausalLM, cfg, one) is None
    experts = SimpleNamespace(**vars(cfg), moe_intermediate_size=48)
    assert "blocks of 32 inputs" in _fp8_widened(scheme, ReferenceLinearMethod(), MixtralForCausalLM, experts, one)
    # 96 inputs per expert: sliced over two ranks 48 (no whole block); whole experts per rank, 96
    experts.moe_intermediate_size = 96
    assert "blocks of 32 inputs" in _fp8_widened(scheme, ReferenceLinearMethod(), MixtralForCausalLM, experts, two)
    ep = SimpleNamespace(size=2, expert_parallel=True)
    assert _fp8_widened(scheme, ReferenceLinearMethod(), MixtralForCausalLM, experts, ep) is None
    # DeepSeek: q_b_proj reads the q latent, o_proj heads * v_head_dim
    deepseek = SimpleNamespace(**vars(cfg), q_lora_rank=48, kv_lora_rank=32, v_head_dim=16)
    assert "blocks of 32 inputs" in _fp8_widened(scheme, ReferenceLinearMethod(), LlamaForCausalLM, deepseek, one)
    deepseek.q_lora_rank, deepseek.v_head_dim = 64, 12  # o_proj: 4 heads * 12 = 48 inputs
    assert "blocks of 32 inputs" in _fp8_widened(scheme, ReferenceLinearMethod(), LlamaForCausalLM, deepseek, one)
    # two ranks: the down projection's 96 inputs per rank are 3 blocks, o_proj's 32 one
    assert _fp8_widened(scheme, ReferenceLinearMethod(), LlamaForCausalLM, cfg, two) is None
    wide = fp8_scheme(Fp8Layout("weight_scale_inv", (64, 64)))
    assert "blocks of 64 inputs" in _fp8_widened(wide, ReferenceLinearMethod(), LlamaForCausalLM, cfg, two)
