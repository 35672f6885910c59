"""The CPU's quantized linear methods against the reference (dequantize, then matmul)."""

import logging

import pytest
import torch

from kiln.interfaces.quantization import QuantLinear, ReferenceLinearMethod, dequantize
from kiln.quantization.config import QuantScheme
from kiln.testing.quantization import SCHEMES, random_quant_layer
from kiln_cpu import native
from kiln_cpu.quant_methods import TiledIntMethod, linear_method

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="no C compiler for the CPU kernels")


def random_layer(scheme: QuantScheme, in_features: int, out_features: int, seed: int, bias: bool) -> QuantLinear:
    return random_quant_layer(
        scheme, in_features, out_features, seed, bias, act_order=scheme is SCHEMES["w4a16-actorder"]
    )


def quantized_per_block(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to int8 per 32 inputs as ``csrc/int8_linear.c`` rounds it (x * 127 / absmax,
    llama.cpp's scheme), widened back."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)  # a true division, as the C (127 / t is not)
    return (torch.round(blocks * inv) * (amax / 127)).reshape(x.shape)


def processed(layer: QuantLinear) -> QuantLinear:
    layer.method = linear_method(layer.scheme)
    layer.method.process(layer)
    return layer


@pytest.mark.parametrize("rows", [1, 16, 64, 1000])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_cpu_method_matches_reference(name, rows):
    """W8A8: the reference's per-token integers. Weight-only: the dequantized weight times the
    activations rounded to int8 per 32 inputs (in act-order, blocks of the sorted inputs)."""
    scheme = SCHEMES[name]
    layer = random_layer(scheme, 256, 96, seed=rows, bias=name == "w4a16-awq")
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    expected = ReferenceLinearMethod().apply(layer, x)
    widened = dequantize(layer)
    bias = 0 if layer.bias is None else layer.bias.clone()
    got = processed(layer)(x)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    if scheme.activation_bits == 8:  # the same integers, summed exactly: equal up to the scales' rounding
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    order = slice(None) if layer.tiled.perm is None else layer.tiled.perm
    assert (layer.tiled.perm is None) == (name != "w4a16-actorder")
    torch.testing.assert_close(got, quantized_per_block(x[:, order]) @ widened[:, order].T + bias, rtol=1e-4, atol=1e-4)
    assert 0 < (got - expected).abs().max() < 0.05 * expected.abs().max()  # quantized, but close


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("name", [n for n, s in SCHEMES.items() if s.activation_bits is None])
def test_fp32_activations_on_request(name, rows, monkeypatch):
    """KILN_CPU_INT8_ACTIVATIONS=0: the products of the dequantized weight itself."""
    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")
    layer = random_layer(SCHEMES[name], 256, 96, seed=rows, bias=True)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    expected, widened, bias = ReferenceLinearMethod().apply(layer, x), dequantize(layer), layer.bias.clone()
    got = processed(layer)(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (got - x @ widened.T - bias).abs().max() < 1e-3  # and it is the layer's weight


def test_w8a8_quantizes_activations_per_token():
    """A token's int8 rounding depends only on its own row: a huge row elsewhere changes nothing."""
    scheme = SCHEMES["w8a8"]
    layer = processed(random_layer(scheme, 64, 32, seed=0, bias=False))
    x = torch.randn(2, 64)
    alone = layer(x[:1])
    with_outlier = layer(torch.cat([x[:1], x[1:] * 1000]))
    assert torch.equal(alone[0], with_outlier[0])
    exact = x[:1] @ dequantize(random_layer(scheme, 64, 32, seed=0, bias=False)).T
    assert 0 < (alone - exact).abs().max() < 0.05 * exact.abs().max()  # quantized, but close


@pytest.mark.parametrize("name", ["w4a16-awq", "w8a8"])
def test_bf16_activations_run_the_tiles_in_fp32(name):
    """A bf16 model's rows go through the fp32 kernels and come back rounded to bf16: the fp32
    layer's outputs exactly, and close to the (slow) reference's."""
    bf16, fp32 = (random_quant_layer(SCHEMES[name], 128, 32, 0, True, dtype=d) for d in (torch.bfloat16, torch.float32))
    fp32.bias.data.copy_(bf16.bias.data)  # the same bf16 values
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    reference = ReferenceLinearMethod().apply(bf16, x)
    got = processed(bf16)(x)
    assert got.dtype == torch.bfloat16 and isinstance(bf16.cpu_method, TiledIntMethod)
    assert torch.equal(got, processed(fp32)(x.float()).to(torch.bfloat16))
    torch.testing.assert_close(got.float(), reference.float(), rtol=0.05, atol=0.05 * reference.float().abs().max())


def test_act_order_blocks_that_would_span_two_groups_use_the_reference(caplog):
    layer = random_layer(SCHEMES["w4a16-actorder"], 128, 32, seed=0, bias=False)
    layer.g_idx.data[:40] = 0  # group 0 now holds more than 32 inputs: sorted, a block spans two groups
    x = torch.randn(3, 128)
    expected = ReferenceLinearMethod().apply(layer, x)
    with caplog.at_level(logging.WARNING, logger="kiln.cpu"):
        got = processed(layer)(x)
    assert "using the (slow) reference" in caplog.text
    torch.testing.assert_close(got, expected)


def test_w8a8_edge_rows_and_codes_match_the_reference():
    """A row of zeros, a row far below torch's 1e-10 scale floor, and weights at -128."""
    layers = [random_layer(SCHEMES["w8a8"], 64, 32, seed=0, bias=False) for _ in range(2)]
    for layer in layers:
        layer.weight.data[:, :8] = -128
    x = torch.randn(3, 64)
    x[1], x[2] = 0.0, x[2] * 1e-12
    expected = ReferenceLinearMethod().apply(layers[0], x)
    got = processed(layers[1])(x)
    assert torch.equal(got[1], torch.zeros(32))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
