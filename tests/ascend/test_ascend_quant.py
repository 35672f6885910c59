"""The Ascend plugin's quantized linear methods (kiln_ascend.quant) under the CPU emulation of
torch_npu: the emulated kernels follow torch_npu's documented contracts (fake_torch_npu.py), each
scheme's method matches ``ReferenceLinearMethod``, and ``kiln quantize`` checkpoints give the CPU
plugin's greedy tokens on the emulated NPU."""

from __future__ import annotations

import logging

import pytest
import torch
from tests.ascend import fake_torch_npu, fake_torchair, test_ascend

from kiln.interfaces.quantization import QuantLinear, ReferenceLinearMethod, dequantize, quantize_per_token
from kiln.quantization.config import QuantScheme
from kiln.testing import quantization as quant_testing
from kiln.testing.quantization import random_quant_layer
from kiln_ascend.quant import AscendLinearMethod, AscendW8A8Method, AscendWeightOnlyMethod, linear_method

# test_ascend.py's fixtures: the emulation installed as torch_npu and torchair (autouse), and the
# plugins with the "npu_emulated" platform (the Ascend platform with its device calls on the CPU).
emulated_torch_npu = test_ascend.emulated_torch_npu
npu_plugins = test_ascend.npu_plugins

SCHEMES = {
    **quant_testing.SCHEMES,
    "w4a16-channel": QuantScheme(4, None, True),  # GPTQ group_size -1: per channel, int4 passed transposed
}
# Worst error relative to the output's largest value: a couple of roundings in the kernel's dtype
# (fp32 models run the kernels in fp16). Wrong signs, layouts or group maps are off by far more.
TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def random_layer(
    name: str, in_features: int, out_features: int, seed: int, bias: bool, dtype: torch.dtype = torch.float32
) -> QuantLinear:
    """As tests/cpu/test_quant_methods.py, built under ``dtype`` (the activations' dtype)."""
    scheme = SCHEMES[name] if isinstance(name, str) else name
    return random_quant_layer(
        scheme, in_features, out_features, seed, bias, act_order=name == "w4a16-actorder", dtype=dtype
    )


def install(layer: QuantLinear) -> None:
    method = linear_method(layer.scheme)
    layer.method = method
    method.process(layer)


def assert_near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("rows", [1, 16, 64, 1000])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_ascend_method_matches_reference(name, rows, dtype):
    layer = random_layer(name, 256, 96, seed=rows, bias=name in ("w8a8", "w4a16-awq"), dtype=dtype)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = ReferenceLinearMethod().apply(layer, x)
    exact = x.double() @ dequantize(layer, torch.float64).T + (0 if layer.bias is None else layer.bias.double())
    install(layer)
    assert not hasattr(layer, "weight")  # the canonical tensors are gone: the kernels' copies are used
    got = layer(x)
    assert got.shape == (rows, 96) and got.dtype == dtype
    assert_near(got, expected, dtype)
    if layer.scheme.activation_bits != 8:  # and it is the layer's weight, not a matmul with something else
        assert_near(got, exact, dtype)
    kernels = {"npu_dynamic_quant", "npu_quant_matmul"} if name == "w8a8" else {"npu_weight_quant_batchmatmul"}
    if dtype == torch.float32 and name == "w8a8":
        kernels = {"npu_quant_matmul"}  # fp32 activations are quantized by torch ops (quantize_per_token)
    if layer.scheme.weight_bits == 4:
        kernels.add("npu_convert_weight_to_int4pack")
    assert set(fake_torch_npu.calls) == kernels


def test_fp32_w8a8_quantizes_activations_exactly_as_the_reference():
    """fp32 models: the same int8 activations as the reference; only the fp16 output rounds."""
    layer = random_layer("w8a8", 256, 96, seed=0, bias=False)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    expected = ReferenceLinearMethod().apply(layer, x)
    install(layer)
    torch.testing.assert_close(layer(x), expected.half().float(), rtol=1e-3, atol=1e-3 * expected.abs().max().item())


def test_w8a8_quantizes_activations_per_token():
    """A token's int8 rounding depends only on its own row: a huge row elsewhere changes nothing."""
    layer = random_layer("w8a8", 64, 32, seed=0, bias=False, dtype=torch.bfloat16)
    install(layer)
    x = torch.randn(2, 64).bfloat16()
    alone = layer(x[:1])
    with_outlier = layer(torch.cat([x[:1], x[1:] * 1000]))
    assert torch.equal(alone[0], with_outlier[0])


def test_leading_dimensions_and_empty_inputs():
    for name in ("w8a8", "w4a16-awq"):
        layer = random_layer(name, 128, 32, seed=0, bias=True, dtype=torch.float16)
        install(layer)
        x = torch.randn(2, 3, 128).half()
        assert torch.equal(layer(x), layer(x.view(6, 128)).view(2, 3, 32))
        assert layer(torch.empty(0, 128).half()).shape == (0, 32)


@pytest.mark.parametrize(
    ("scheme", "in_features", "out_features", "reason"),
    [
        (QuantScheme(4, 16, False), 128, 32, "group size 16"),
        (QuantScheme(4, 32, False), 128, 36, "36 outputs"),  # int4 packs 8 outputs per int32 per group
        (QuantScheme(4, None, True), 132, 32, "132 inputs"),  # per channel: 8 inputs per int32
    ],
)
def test_layers_the_kernels_refuse_use_the_reference(scheme, in_features, out_features, reason, caplog):
    layer = random_layer(scheme, in_features, out_features, seed=0, bias=False, dtype=torch.float16)
    x = torch.randn(5, in_features).half()
    expected = ReferenceLinearMethod().apply(layer, x)
    with caplog.at_level(logging.WARNING, logger="kiln.ascend"):
        install(layer)
    assert reason in caplog.text and isinstance(layer.npu_method, ReferenceLinearMethod)
    assert torch.equal(layer(x), expected) and fake_torch_npu.calls == []


def test_act_order_groups_of_unequal_sizes_use_the_reference(caplog):
    layer = random_layer("w4a16-actorder", 128, 32, seed=0, bias=False, dtype=torch.float16)
    layer.g_idx.data[:40] = 0  # group 0 now holds more than 32 inputs
    with caplog.at_level(logging.WARNING, logger="kiln.ascend"):
        install(layer)
    assert "act-order groups of unequal sizes" in caplog.text


def test_platform_linear_method():
    from kiln_ascend.platform import NpuPlatform

    platform = NpuPlatform()
    method = platform.linear_method(SCHEMES["w8a8"])
    assert isinstance(method, AscendLinearMethod) and isinstance(method.kernel, AscendW8A8Method)
    assert isinstance(platform.linear_method(SCHEMES["w4a16-awq"]).kernel, AscendWeightOnlyMethod)
    assert platform.linear_method(QuantScheme(4, None, True, activation_bits=8)) is None  # no W4A8 kernel here
    assert platform.linear_method(QuantScheme(3, 128, False)) is None


# The emulation itself: the documented formulas, layouts and dtype rules, so that a plugin bug
# (a flipped offset sign, an untransposed weight, a wrong dtype) fails here as it would on an NPU.


def test_int4pack_layout():
    """Eight consecutive values of the last dimension per int32, the first in the lowest bits."""
    w = torch.tensor([[1, 2, 3, 4, 5, 6, 7, -8], [-1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    packed = fake_torch_npu.npu_convert_weight_to_int4pack(w)
    assert packed.dtype == torch.int32 and packed.shape == (2, 1)
    assert packed[0, 0].item() == 0x87654321 - 2**32 and packed[1, 0].item() == 0xF
    assert torch.equal(fake_torch_npu._unpack_int4(packed), w)
    with pytest.raises(AssertionError, match="int4's range"):
        fake_torch_npu.npu_convert_weight_to_int4pack(w + 8)


def test_weight_quant_batchmatmul_formula():
    """y = x @ ((weight + offset) * scale) + bias, per channel and per group, int8 and int4 (both layouts)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).half()
    w = torch.randint(-8, 8, (64, 16), generator=gen, dtype=torch.int32)
    scale, offset = torch.rand(2, 16, generator=gen).half(), torch.randint(-3, 4, (2, 16), generator=gen).half()
    bias = torch.randn(16, generator=gen).half()
    per_input = lambda t: t.float().repeat_interleave(32, dim=0)  # noqa: E731
    want = x.float() @ ((w.float() + per_input(offset)) * per_input(scale)) + bias.float()
    npu = fake_torch_npu
    for weight in (w.to(torch.int8), npu.npu_convert_weight_to_int4pack(w)):
        got = npu.npu_weight_quant_batchmatmul(x, weight, scale, offset, bias=bias, antiquant_group_size=32)
        assert got.dtype == torch.float16
        assert_near(got, want, torch.float16)
    transposed = npu.npu_convert_weight_to_int4pack(w.T.contiguous()).T  # (k / 8, n): a packed (n, k / 8)
    got = npu.npu_weight_quant_batchmatmul(x, transposed, scale[0], offset[0])
    assert_near(got, x.float() @ ((w.float() + offset[0].float()) * scale[0].float()), torch.float16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(x=torch.ones(3, 64)), "float16/bfloat16"),  # fp32 activations
        (dict(antiquant_scale=torch.ones(16)), "antiquant_scale must be torch.float16"),
        (dict(bias=torch.ones(16)), "bias: torch.float16"),  # fp16 x takes an fp16 bias
        (dict(antiquant_group_size=48), "multiple of 32"),
        (dict(antiquant_group_size=64), "multiple of 32"),  # must be below k
        (dict(weight=torch.ones(16, 64, dtype=torch.int8)), "The k of x and weight"),  # (n, k) passed as is
        (dict(weight=torch.ones(64, 32, dtype=torch.int8)[:, ::2]), "a transpose"),
    ],
)
def test_weight_quant_batchmatmul_refuses_what_the_npu_refuses(change, message):
    args = dict(
        x=torch.ones(3, 64).half(), weight=torch.ones(64, 16, dtype=torch.int8),
        antiquant_scale=torch.ones(16).half(), bias=None, antiquant_group_size=0,
    )  # fmt: skip
    args.update(change)
    with pytest.raises(AssertionError, match=message):
        fake_torch_npu.npu_weight_quant_batchmatmul(**args)


def test_quant_matmul_formula_and_dtype_rules():
    gen = torch.Generator().manual_seed(0)
    x1 = torch.randint(-127, 128, (4, 64), generator=gen, dtype=torch.int8)
    x2 = torch.randint(-127, 128, (64, 8), generator=gen, dtype=torch.int8)
    scale, token = torch.rand(8, generator=gen), torch.rand(4, generator=gen)
    bias = torch.randn(8, generator=gen)
    want = (x1.double() @ x2.double()).float() * scale * token[:, None] + bias
    npu = fake_torch_npu
    for out_dtype in (torch.float16, torch.bfloat16):
        got = npu.npu_quant_matmul(x1, x2, scale, pertoken_scale=token, bias=bias, output_dtype=out_dtype)
        assert got.dtype == out_dtype
        torch.testing.assert_close(got.float(), want.to(out_dtype).float())
    with pytest.raises(AssertionError, match="fp16 output: scale fp32"):
        npu.npu_quant_matmul(x1, x2, scale.bfloat16(), pertoken_scale=token, output_dtype=torch.float16)
    with pytest.raises(AssertionError, match="fp16 output: bias"):
        npu.npu_quant_matmul(x1, x2, scale, bias=bias, output_dtype=torch.float16)  # a float bias needs pertoken
    with pytest.raises(AssertionError, match=r"\(m, k\) @ \(k, n\)"):
        npu.npu_quant_matmul(x1, x2.T.contiguous(), scale, pertoken_scale=token, output_dtype=torch.bfloat16)


def test_dynamic_quant():
    x = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]]).half()
    q, scale = fake_torch_npu.npu_dynamic_quant(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (2,)
    assert q.tolist() == [[64, -127, 32], [0, 0, 0]]  # 63.5 rounds half to even
    torch.testing.assert_close(scale, torch.tensor([1 / 127, 0.0]))
    with pytest.raises(AssertionError, match="float16/bfloat16"):
        fake_torch_npu.npu_dynamic_quant(x.float())


# Engine parity: `kiln quantize` checkpoints of the tiny llama, served on the emulated NPU and by
# the CPU plugin, both in fp32. The torch_npu kernels take and return fp16/bf16 activations, so an
# fp32 model runs them in fp16 (kiln_ascend.quant) while the CPU plugin computes in fp32: exact
# equality of the computation is impossible. For the weight-only schemes the fp16 rounding moves
# logprobs by ~0.01: the tokens must be the CPU plugin's (its exact path) up to a choice whose top
# two candidates were within 0.02 there (gptq act-order meets one, 0.005 apart). W8A8 amplifies it: an fp16-rounded output moves the next layer's int8
# activation roundings, and logprobs move by up to ~0.1, enough to flip a near-tie. There the
# closest meaningful property is checked: the NPU's tokens are exactly those of the CPU plugin
# computing the reference W8A8 product with its output rounded to fp16 as npu_quant_matmul returns
# it, and where they leave the plain CPU plugin's, that plugin's top two candidates were a near-tie.


class Fp16OutputW8A8Reference(ReferenceLinearMethod):
    """``ReferenceLinearMethod``'s W8A8 product (per-token int8 activations, exact integer sums),
    dequantized in fp32 and rounded to fp16, then widened: what npu_quant_matmul returns in fp32 models."""

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        assert layer.scheme.activation_bits == 8
        q, token_scale = quantize_per_token(x.reshape(-1, layer.in_features))
        acc = (q.double() @ layer.weight.double().T).float()
        out = (acc * layer.weight_scale.view(-1) * token_scale).half().float()
        if layer.bias is not None:
            out = out + layer.bias.float()
        return out.view(*x.shape[:-1], layer.out_features)


def greedy_with_gaps(plugins, prompts, **engine_args) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and, at each position, the gap between the top two logprobs."""
    from kiln.sampling_params import SamplingParams
    from kiln.testing.engine import make_engine

    engine = make_engine(plugins, **engine_args)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0]
    outs = [done[str(i)] for i in range(len(prompts))]
    gaps = [[lps[0] - lps[1] for lps in (sorted((v.logprob for v in p.values()), reverse=True) for p in o.logprobs)]
            for o in outs]  # fmt: skip
    return [o.token_ids for o in outs], gaps


@pytest.mark.parametrize(
    ("quant_type", "extra"),
    [("awq", ()), ("gptq", ()), ("gptq", ("--act-order", "--no-sym")), ("smooth_quant", ("-sq", "0.5"))],
    ids=["awq", "gptq", "gptq-actorder", "smooth_quant"],
)
def test_quantized_checkpoint_on_the_npu_matches_the_cpu_plugin(
    tiny_model_dir, tmp_path, npu_plugins, monkeypatch, quant_type, extra
):
    from tests.quantization.test_quantize_tool import PROMPTS, quantize

    from kiln.testing.engine import greedy_tokens
    from kiln_cpu.platform import CpuPlatform

    out = quantize(tiny_model_dir("llama"), str(tmp_path / quant_type), quant_type, *extra)
    common = dict(model=out, dtype="float32", max_model_len=128, max_num_batched_tokens=64)
    npu = greedy_tokens(npu_plugins, PROMPTS, 12, device="npu_emulated", block_size=64, enforce_eager=True, **common)
    kernel = "npu_quant_matmul" if quant_type == "smooth_quant" else "npu_weight_quant_batchmatmul"
    assert kernel in fake_torch_npu.calls and len(npu) == 3 and all(len(t) == 12 for t in npu)
    if quant_type != "smooth_quant":  # the CPU plugin's exact path: its default rounds activations to int8
        monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")
    cpu, gaps = greedy_with_gaps(npu_plugins, PROMPTS, device="cpu", **common)
    tie = 0.1 if quant_type == "smooth_quant" else 0.02  # twice the logprob moves fp16 rounding makes
    for mine, theirs, gap in zip(npu, cpu, gaps):
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        assert first is None or gap[first] < tie, f"left the CPU plugin's tokens at {first}, not a near-tie"
    if quant_type != "smooth_quant":
        return
    monkeypatch.setattr(CpuPlatform, "linear_method", lambda self, scheme: Fp16OutputW8A8Reference())
    assert npu == greedy_tokens(npu_plugins, PROMPTS, 12, device="cpu", **common)


def test_quantized_checkpoint_in_graph_mode(tiny_model_dir, tmp_path, npu_plugins):
    """Decode steps through the emulated torchair graphs (bf16, the NPU's default): the quantized
    matmuls are nodes of every graph, and the tokens are the eager path's."""
    from tests.quantization.test_quantize_tool import PROMPTS, quantize

    from kiln.testing.engine import greedy_tokens, make_engine, run_greedy

    out = quantize(tiny_model_dir("llama"), str(tmp_path / "sq"), "smooth_quant", "-sq", "0.5")
    common = dict(model=out, dtype="bfloat16", max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4)
    before = len(fake_torchair.graphs)
    engine = make_engine(npu_plugins, device="npu_emulated", block_size=64, **common)
    graphs = fake_torchair.graphs[before:]
    graph = run_greedy(engine, PROMPTS, 12)
    assert engine.executor.runner.graph_steps > 0 and len(graphs) == len(engine.executor.runner.graph_sizes) > 0
    quantized = sum(isinstance(m, QuantLinear) for m in engine.executor.runner.model.modules())
    for g in graphs:
        nodes = g.graph.find_nodes(op="call_function", target=torch.ops.npu.npu_quant_matmul.default)
        assert len(nodes) == quantized > 0
    eager = greedy_tokens(npu_plugins, PROMPTS, 12, device="npu_emulated", block_size=64, enforce_eager=True, **common)
    assert graph == eager
