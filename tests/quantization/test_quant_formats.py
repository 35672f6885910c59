"""Checkpoint layouts (AutoAWQ, AutoGPTQ, compressed-tensors) and method resolution."""

import pytest
import torch

from kiln.interfaces.quantization import QuantLinear, dequantize
from kiln.quantization.checkpoint import canonical_weights, checkpoint_tensors
from kiln.quantization.config import W8A8, W8A16, QuantScheme, from_hf, resolve
from kiln.quantization.packing import AWQ_ORDER, pack, unpack
from kiln.quantization.tool import hf_quantization_config


def test_awq_nibble_order():
    """AutoAWQ packs output columns 0,2,4,6,1,3,5,7 into nibbles 0..7 (low bits first)."""
    word = pack(torch.arange(8)[None], 4, 1, AWQ_ORDER)
    assert word.item() == 0x75316420
    assert unpack(word, 4, 1, AWQ_ORDER).tolist() == [list(range(8))]


@pytest.mark.parametrize("bits,dim,order", [(4, 0, None), (4, 1, AWQ_ORDER), (8, 1, None), (4, 1, None)])
def test_pack_round_trip(bits, dim, order):
    codes = torch.randint(0, 2**bits, (16, 32))
    packed = pack(codes, bits, dim, order)
    assert packed.dtype == torch.int32 and packed.shape[dim] == codes.shape[dim] * bits // 32
    assert torch.equal(unpack(packed, bits, dim, order), codes.to(torch.int16))


def test_gptq_symmetric_zeros_are_stored_minus_one():
    """AutoGPTQ's v1 layout stores zero - 1: a symmetric 4-bit layer's qzeros words are 0x77777777."""
    quant = from_hf(hf_quantization_config("gptq", 32, False))
    tensors = checkpoint_tensors(
        quant, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2), None, None, torch.float16
    )
    assert tensors["qzeros"].shape == (2, 1) and (tensors["qzeros"] == 0x77777777).all()
    assert tensors["qweight"].shape == (8, 8) and tensors["scales"].dtype == torch.float16
    assert tensors["g_idx"].tolist() == [i // 32 for i in range(64)]


def random_canonical(scheme: QuantScheme, act_order: bool, rows=32, cols=128):
    layer = QuantLinear(cols, rows, False, scheme, act_order)
    top = 2 ** (scheme.weight_bits - 1)
    low, high = (-top + 1, top) if scheme.symmetric else (0, 2 * top)
    with torch.no_grad():
        layer.weight.copy_(torch.randint(low, high, layer.weight.shape))
        layer.weight_scale.copy_((torch.rand(layer.weight_scale.shape) + 0.01).half().float())
        if layer.weight_zero is not None:
            layer.weight_zero.copy_(torch.randint(1, 16, layer.weight_zero.shape))
        if layer.g_idx is not None:
            layer.g_idx.copy_(torch.randperm(cols) % (cols // scheme.group_size))
    return layer


CASES = {
    "smooth_quant": (hf_quantization_config("smooth_quant", 0, False), False),
    "weight_only_int8": (hf_quantization_config("weight_only_int8", 0, False), False),
    "awq": (hf_quantization_config("awq", 32, False), False),
    "gptq": (hf_quantization_config("gptq", 32, False), False),
    "gptq-act-order-asym": ({**hf_quantization_config("gptq", 32, True), "sym": False}, True),
    "ct-w4a16": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                            "group_size": 32}}}}, False),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_round_trip(case):
    """canonical -> the format's tensors -> canonical gives the same weight, bit for bit."""
    qc, act_order = CASES[case]
    quant = from_hf(qc)
    layer = random_canonical(quant.scheme, act_order)
    zero = None if layer.weight_zero is None else layer.weight_zero.data
    g_idx = None if layer.g_idx is None else layer.g_idx.data
    written = checkpoint_tensors(quant, layer.weight.data, layer.weight_scale.data, zero, g_idx, torch.float32)
    stream = [(f"model.layers.0.mlp.up_proj.{k}", v) for k, v in written.items()]
    stream.append(("model.norm.weight", torch.ones(4)))
    back = dict(canonical_weights(stream, quant))
    assert torch.equal(back.pop("model.norm.weight"), torch.ones(4))
    loaded = QuantLinear(layer.in_features, layer.out_features, False, quant.scheme, quant.desc_act)
    for leaf, value in back.items():
        getattr(loaded, leaf.rpartition(".")[2]).data.copy_(value)
    assert torch.equal(dequantize(loaded), dequantize(layer))


def test_a_layer_split_across_shards_waits_for_all_its_tensors():
    quant = from_hf(hf_quantization_config("awq", 32, False))
    stream = [("a.qweight", torch.zeros(64, 1, dtype=torch.int32)), ("b.weight", torch.ones(2))]
    with pytest.raises(ValueError, match="missing a.qzeros, a.scales"):
        list(canonical_weights(stream, quant))


def test_llm_compressor_w8a8_config_is_read():
    """The config llm-compressor writes for INT8 W8A8 (dynamic per-token activations)."""
    args = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8, "observer_kwargs": {},
            "symmetric": True, "type": "int"}  # fmt: skip
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "format": "int-quantized",
              "weights": {**args, "dynamic": False, "observer": "minmax", "strategy": "channel"},
              "input_activations": {**args, "dynamic": True, "observer": None, "strategy": "token"}}},
          "quantization_status": "compressed", "version": "0.11.0"}  # fmt: skip
    quant = resolve(None, qc)
    assert quant.scheme == W8A8 and not quant.quantizes("lm_head") and quant.quantizes("model.layers.0.mlp.up_proj")


def test_resolve():
    awq = hf_quantization_config("awq", 128, False)
    assert resolve(None, awq).scheme == QuantScheme(4, 128, False)
    assert resolve("awq", awq).method == "awq"
    assert resolve(None, None) is None and resolve("none", None) is None
    assert resolve("weight_only_int8", None).scheme == W8A16  # quantized at load
    assert resolve("smooth_quant", hf_quantization_config("smooth_quant", 0, False)).scheme == W8A8
    with pytest.raises(ValueError, match="quantized with awq"):
        resolve("gptq", awq)
    with pytest.raises(ValueError, match="kiln quantize -i MODEL -o OUT -quant_type awq"):
        resolve("awq", None)
    with pytest.raises(ValueError, match="unknown method 'int3'"):
        resolve("int3", None)
    with pytest.raises(ValueError, match="--quantization fp8: needs an fp8 checkpoint"):
        resolve("fp8", None)
    with pytest.raises(ValueError, match="'bitsandbytes' in config.json is not supported"):
        resolve(None, {"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="3-bit"):
        resolve(None, {**awq, "bits": 3})


def test_ignore_patterns():
    quant = from_hf({**hf_quantization_config("smooth_quant", 0, False), "ignore": ["lm_head", "re:.*layers\\.1\\..*"]})
    assert not quant.quantizes("model.layers.1.mlp.up_proj")
    assert quant.quantizes("model.layers.0.mlp.up_proj")
