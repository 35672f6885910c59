"""The CUDA plugin's quantized linear kernels (kiln_cuda.quant) against ``ReferenceLinearMethod``:
W8A8, W8A16 per channel, W4A16 with zero points (groups of 32 and 128), symmetric W4A16, GPTQ
act-order and fp8 weights (per channel and in blocks), at 1, 16, 64 and 1000 rows, plus the per-token int8 kernel against
``quantize_per_token`` bit for bit. On GPU where one is present, else under Triton's interpreter
on CPU tensors (fp32 and fp16: the interpreter's bf16 arithmetic is broken); the tests marked
``cuda`` add bf16, larger layers and CUDA graph capture on a real GPU."""

from __future__ import annotations

import pytest
import torch

from kiln.interfaces.quantization import QuantLinear, ReferenceLinearMethod, dequantize, quantize_per_token
from kiln.quantization.config import QuantScheme
from kiln.testing import quantization as quant_testing
from kiln.testing.quantization import random_quant_layer
from kiln_cuda import quant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SCHEMES = {
    **quant_testing.SCHEMES, "w4a16-g32-zero": QuantScheme(4, 32, False),
    "fp8-channel": QuantScheme(8, None, True, float_weights=True),  # fp8 checkpoints: float8 weights,
    "fp8-block": QuantScheme(8, 64, True, float_weights=True),  # per row, or per (row, 64-input) block
}  # fmt: skip
# fp32 activations: the same widened weights, IEEE fp32 products, another summation order.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def random_layer(*args, **kwargs) -> QuantLinear:
    return random_quant_layer(*args, **kwargs).to(DEVICE)


def through_kernels(layer: QuantLinear) -> QuantLinear:
    method = quant.linear_method(layer.scheme)
    assert method is not None
    layer.method = method
    method.process(layer)
    return layer


def check(layer: QuantLinear, x: torch.Tensor, **tol) -> torch.Tensor:
    """The layer through the kernels matches the reference on ``x``; returns the output."""
    expected = ReferenceLinearMethod().apply(layer, x)
    got = through_kernels(layer)(x)
    assert got.shape == expected.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.float(), expected.float(), **(tol or TOL[x.dtype]))
    return got


@pytest.mark.parametrize("rows", [1, 16, 64, 1000])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_matches_reference_fp32(name, rows):
    scheme = SCHEMES[name]
    layer = random_layer(scheme, 256, 96, seed=rows, bias=rows != 16, act_order=name == "w4a16-actorder")
    widened = dequantize(layer).to(DEVICE)
    bias = 0 if layer.bias is None else layer.bias.clone()
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    if scheme.activation_bits == 8:  # the same integers, summed exactly, scaled in the same order
        got = check(layer, x, rtol=1e-6, atol=1e-6)
    else:
        got = check(layer, x)
        # and it is the layer's weight: not a matmul with something else
        assert (got - x @ widened.T - bias).abs().max() < 1e-3


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_matches_reference_fp16(name, rows):
    layer = random_layer(SCHEMES[name], 256, 96, seed=rows, bias=True, act_order=name == "w4a16-actorder",
                         dtype=torch.float16)  # fmt: skip
    check(layer, torch.randn(rows, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16))


@pytest.mark.parametrize(
    ("scheme", "in_features", "out_features"),
    [
        (QuantScheme(8, None, True), 200, 72),  # K and N tails
        (QuantScheme(4, None, True), 100, 40),  # K not a multiple of 8: the last word padded
        (QuantScheme(4, 48, False), 144, 64),  # K tiles of 16
        (QuantScheme(4, 40, False), 120, 64),  # groups no tile divides: each input reads its group
        (QuantScheme(8, 64, False), 128, 32),  # 8-bit with zero points: signed int8 codes
        (QuantScheme(8, None, True, activation_bits=8), 200, 72),
        (QuantScheme(8, None, True, float_weights=True), 200, 72),
        (QuantScheme(8, 40, True, float_weights=True), 120, 72),  # fp8 blocks of 40 inputs: per input
    ],
    ids=["w8-tails", "w4-pad", "w4-g48", "w4-g40", "w8-zero", "w8a8-tails", "fp8-tails", "fp8-g40"],
)
def test_odd_shapes(scheme, in_features, out_features):
    layer = random_layer(scheme, in_features, out_features, seed=3, bias=True)
    if scheme.weight_bits == 8 and not scheme.symmetric:
        with torch.no_grad():
            layer.weight.random_(-128, 128)
            layer.weight_zero.random_(-20, 20)
    x = torch.randn(3, 5, in_features, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    tol = dict(rtol=1e-6, atol=1e-6) if scheme.activation_bits else {}
    assert check(layer, x, **tol).shape == (3, 5, out_features)


def test_act_order_with_unequal_groups():
    """g_idx whose groups differ in size: after sorting, each input reads its own group."""
    k = 128
    g_idx = torch.randint(0, 4, (k,), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    layer = random_layer(QuantScheme(4, 32, False), k, 48, seed=4, g_idx=g_idx)
    check(layer, torch.randn(20, k, generator=torch.Generator().manual_seed(4)).to(DEVICE))
    assert layer.qgidx is not None and layer.qperm is not None


def test_act_order_gptq_groups_take_the_tile_path():
    layer = through_kernels(random_layer(SCHEMES["w4a16-actorder"], 256, 32, seed=5, act_order=True))
    assert layer.qgidx is None and layer.qblock[:2] == (32, 32)


def test_strided_rows():
    """Rows of a wider tensor (a stride along the tokens): read in place."""
    layer = random_layer(SCHEMES["w4a16-g32-zero"], 64, 32, seed=6)
    wide = torch.randn(9, 100, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    check(layer, wide[:, 10:74])
    w8a8 = random_layer(SCHEMES["w8a8"], 64, 32, seed=6)
    check(w8a8, wide[:, 10:74], rtol=1e-6, atol=1e-6)


def test_no_rows():
    layer = through_kernels(random_layer(SCHEMES["w4a16-sym"], 64, 32, seed=0))
    assert layer(torch.zeros(0, 64, device=DEVICE)).shape == (0, 32)


def test_packed_layout():
    """Word j of column n holds inputs 8j..8j+7, input 8j + i in bits 4i..4i+3; the tail is zero."""
    codes = torch.randint(0, 16, (3, 20))
    words = quant.pack_codes(codes, 4)
    assert words.shape == (3, 3) and words.dtype == torch.int32
    for j in range(3):
        for i in range(8):
            got = (words[j] >> (4 * i)) & 0xF
            assert torch.equal(got, codes[:, 8 * j + i] if 8 * j + i < 20 else torch.zeros(3, dtype=torch.int32))
    assert torch.equal(quant.pack_codes(torch.full((1, 4), 255), 8), torch.tensor([[-1]], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_quantization_is_exact(dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, 300, generator=gen) * torch.logspace(-3, 3, 40)[:, None]
    x[3] = 0  # an all-zero row: the scale's floor 1e-10
    # absmax 127: scale 1 exactly, and halves are ties (round to even, as torch.round)
    x[5, :12] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.4999998, 0.49999997, -127])
    x = x.to(DEVICE, dtype)
    q, scale = quant.quantize_per_token(x)
    want_q, want_scale = quantize_per_token(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q, want_q)
    if dtype == torch.float32:  # (fp16 rounds 3.4999998 and 0.49999997 to halves)
        assert q[5, :12].tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, 3, 0, -127]


def test_per_token_quantization_of_long_rows():
    """Rows longer than one block (4096): the absmax pass and the rounding pass both loop."""
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    x[1, 4999] = 50.0  # the row's max in the last block
    q, scale = quant.quantize_per_token(x)
    want_q, want_scale = quantize_per_token(x)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)


def test_w8a8_quantizes_activations_per_token():
    """A token's int8 rounding depends only on its own row: a huge row elsewhere changes nothing."""
    layer = through_kernels(random_layer(SCHEMES["w8a8"], 64, 32, seed=0))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    alone = layer(x[:1])
    with_outlier = layer(torch.cat([x[:1], x[1:] * 1000]))
    assert torch.equal(alone[0], with_outlier[0])


def test_platform_offers_the_methods():
    from kiln_cuda.platform import CudaPlatform

    platform = CudaPlatform()
    assert isinstance(platform.linear_method(SCHEMES["w8a8"]), quant.TritonInt8Method)
    for name in ("w8a16", "w4a16-awq", "w4a16-actorder", "fp8-channel", "fp8-block"):
        assert isinstance(platform.linear_method(SCHEMES[name]), quant.TritonDequantMethod)
    assert platform.linear_method(QuantScheme(4, 128, True, activation_bits=8)) is None
    assert platform.linear_method(SCHEMES["fp8-block"]).takes_float_weights
    assert platform.linear_method(QuantScheme(3, 128, True)) is None


def test_fp8_weights_only_where_triton_reads_fp8(monkeypatch):
    """Triton reads float8 e4m3 from compute capability 8.9: older GPUs get no fp8 method (their
    fp8 checkpoints are widened at load)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    assert quant.linear_method(SCHEMES["fp8-channel"]) is None
    assert isinstance(quant.linear_method(SCHEMES["w4a16-awq"]), quant.TritonDequantMethod)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    assert isinstance(quant.linear_method(SCHEMES["fp8-channel"]), quant.TritonDequantMethod)


# ---------------------------------------------------------------- real GPUs only


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 128, 777])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_gpu_model_sized_layers(name, rows, dtype):
    """Layers of a 1B model's size in each activation dtype. In half precision both sides round the
    output before adding the bias (rounded too), so a different summation order may land one
    rounding of x @ W.T away: where the bias nearly cancels it, far more than the result's own ulp."""
    layer = random_layer(SCHEMES[name], 2048, 1536, seed=rows, bias=True, act_order=name == "w4a16-actorder",
                         dtype=dtype)  # fmt: skip
    x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(10)).to(DEVICE, dtype)
    if dtype == torch.float32:
        check(layer, x, rtol=1e-4, atol=1e-3)
        return
    before_bias = x.float() @ dequantize(layer, torch.float32).T
    expected = ReferenceLinearMethod().apply(layer, x).float()
    got = through_kernels(layer)(x).float()  # (repacks the layer's weights)
    limit = torch.finfo(dtype).eps * (before_bias.abs() + expected.abs()) + 1e-3  # >= an ulp of each
    excess = (got - expected).abs() - limit
    worst = divmod(int(excess.argmax()), got.shape[1])
    assert excess.max() <= 0, f"{int((excess > 0).sum())} outputs beyond a rounding; the worst at {worst}"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["w8a8", "w4a16-awq", "w4a16-actorder"])
def test_gpu_apply_replays_in_a_cuda_graph(name):
    """Decode steps run as CUDA graphs: apply allocates nothing data-dependent and never syncs."""
    layer = through_kernels(random_layer(SCHEMES[name], 512, 256, seed=11, act_order=name == "w4a16-actorder"))
    x = torch.randn(8, 512, device=DEVICE)
    eager = layer(x)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn(8, 512, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, layer(x)) and not torch.equal(out, eager)
