"""Quantized experts on Ascend (``AscendLinearMethod.process_experts``) under the CPU emulation of
torch_npu: int8 codes per channel and 4-bit codes stay integers for ``npu_grouped_matmul``'s
quantized forms (W8A8 with per-token activations, weight-only int8 and int4 pseudo-quantized),
matching the reference products; other experts are widened; a quantized Mixtral on the emulated
NPU gives the CPU plugin's tokens."""

from __future__ import annotations

import pytest
import torch
from tests.ascend import fake_torch_npu, test_ascend
from tests.ascend.test_ascend_quant import assert_near, greedy_with_gaps
from torch import nn

from kiln.interfaces import model as REFERENCE
from kiln.quantization.config import QuantScheme
from kiln.testing import quantization as quant_testing
from kiln.testing.quantization import random_experts, w8a8_expert
from kiln_ascend.moe import QuantizedExperts, fused_experts
from kiln_ascend.quant import linear_method

emulated_torch_npu = test_ascend.emulated_torch_npu
npu_plugins = test_ascend.npu_plugins

SCHEMES = {
    "w8a8": quant_testing.SCHEMES["w8a8"],
    "w8a16": quant_testing.SCHEMES["w8a16"],
    "w8a16-zero": QuantScheme(8, None, False),  # 8-bit codes with zero points
    "w4a16-awq": QuantScheme(4, 32, False),  # int4 per group, zero points
    "w4a16-sym": quant_testing.SCHEMES["w4a16-sym"],  # groups of 64, signed codes
    "w4a16-channel": QuantScheme(4, None, True),
}
EXPERTS, HIDDEN, INTER = 4, 128, 64


def mixture(dtype: torch.dtype, hidden: int = HIDDEN, inter: int = INTER) -> nn.Module:
    """A mixture layer as the core hands it over: its router, stacked weights without memory."""
    moe = nn.Module()
    moe.num_local, moe.gate = EXPERTS, nn.Linear(hidden, EXPERTS, bias=False)
    moe.w13 = nn.Parameter(torch.empty(EXPERTS, 2 * inter, hidden, dtype=dtype, device="meta"))
    moe.w2 = nn.Parameter(torch.empty(EXPERTS, hidden, inter, dtype=dtype, device="meta"))
    return moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_int8_experts_stay_int8_and_match_the_reference(name, tokens, dtype):
    scheme = SCHEMES[name]
    parts, w13, w2 = random_experts(scheme, EXPERTS, HIDDEN, INTER, seed=tokens)
    moe = mixture(dtype)
    assert linear_method(scheme).process_experts(moe, parts)
    assert isinstance(moe.w13, QuantizedExperts)
    assert moe.w13.weight.dtype == (torch.int32 if scheme.weight_bits == 4 else torch.int8)
    assert moe.w13.shape == tuple(w13.shape) and "w13" not in dict(moe.named_parameters())
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    got = fused_experts(x, moe.w13, moe.w2, weights.to(dtype), ids)
    assert got.dtype == dtype
    if scheme.activation_bits == 8:
        want = REFERENCE.route_to_experts(
            x.float(), weights, ids, lambda e, rows: w8a8_expert(parts, e, rows, moe.w13.dtype, dtype)
        )
    else:
        want = REFERENCE.fused_experts(x.float(), w13, w2, weights, ids)
    assert_near(got.float(), want, dtype)
    assert "npu_grouped_matmul" in fake_torch_npu.calls
    assert ("npu_convert_weight_to_int4pack" in fake_torch_npu.calls) == (scheme.weight_bits == 4)


@pytest.mark.parametrize(
    ("scheme", "act_order"),
    [(QuantScheme(8, 32, True), False), (QuantScheme(8, INTER, True), False), (QuantScheme(4, 16, False), False),
     (QuantScheme(4, 32, False), True)],
    ids=["8-bit-groups", "8-bit-one-group-per-gate-row", "groups-of-16", "act-order"],
)  # fmt: skip
def test_other_experts_are_widened(scheme, act_order):
    """Among them 8-bit groups as long as the hidden size: the gate's rows have one group, the
    down projection's several."""
    hidden, inter = (INTER, HIDDEN) if scheme.group_size == INTER else (HIDDEN, INTER)
    parts, _, _ = random_experts(scheme, EXPERTS, hidden, inter, seed=0)
    if act_order:
        for tensors in parts.values():
            tensors["g_idx"] = torch.arange(tensors["weight"].shape[1], dtype=torch.int32) // 32
    assert not linear_method(scheme).process_experts(mixture(torch.float16, hidden, inter), parts)


def test_the_emulation_refuses_what_the_op_refuses():
    x, w = torch.randint(-127, 128, (4, 32), dtype=torch.int8), torch.randint(-127, 128, (2, 32, 16), dtype=torch.int8)
    ends, token_scale = torch.tensor([1, 4]), torch.rand(4)
    gmm = fake_torch_npu.npu_grouped_matmul
    common = dict(group_list=ends, split_item=3, group_type=0, per_token_scale=[token_scale])
    with pytest.raises(AssertionError, match="not in the table"):  # fp32 scales give fp16 outputs only
        gmm([x], [w], scale=[torch.rand(2, 16)], output_dtype=torch.bfloat16, **common)
    out = gmm([x], [w], scale=[torch.rand(2, 16).bfloat16()], output_dtype=torch.bfloat16, **common)[0]
    assert out.dtype == torch.bfloat16 and out.shape == (4, 16)
    half = torch.randn(4, 32).half()
    with pytest.raises(AssertionError, match="per channel"):  # int8 pseudo-quantization: per channel only
        gmm([half], [w], antiquant_scale=[torch.rand(2, 2, 16).half()], group_list=ends, split_item=3, group_type=0)


@pytest.mark.parametrize("method", ["smooth_quant", "weight_only_int8", "awq"])
def test_a_quantized_mixtral_on_the_npu_matches_the_cpu_plugin(tiny_model_dir, tmp_path, npu_plugins, monkeypatch,
                                                                method):  # fmt: skip
    """fp32, so the NPU's kernels run in fp16 (see tests/ascend/test_ascend_quant.py): its tokens are the
    CPU plugin's up to a near-tie there."""
    from kiln.testing.engine import make_engine, run_greedy
    from kiln.testing.quantization import rounded_copy

    quantized, _ = rounded_copy(tiny_model_dir("mixtral"), tmp_path, method, 32)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7], list(range(100, 119))]
    common = dict(model=quantized, dtype="float32", max_model_len=128, max_num_batched_tokens=64)
    engine = make_engine(npu_plugins, device="npu_emulated", block_size=64, enforce_eager=True, **common)
    moe = next(m for m in engine.executor.runner.model.modules() if hasattr(m, "load_expert"))
    assert isinstance(moe.w13, QuantizedExperts) and moe.w13.w8a8 == (method == "smooth_quant")
    npu = run_greedy(engine, prompts, 12)
    if method != "smooth_quant":
        monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")  # the CPU plugin's exact products
    cpu, gaps = greedy_with_gaps(npu_plugins, prompts, device="cpu", **common)
    tie = 0.1 if method == "smooth_quant" else 0.02  # as test_ascend_quant's checkpoints
    for mine, theirs, gap in zip(npu, cpu, gaps):
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        assert first is None or gap[first] < tie, f"left the CPU plugin's tokens at {first}, not a near-tie"


@pytest.mark.parametrize("method", ["smooth_quant", "awq"])
def test_quantized_experts_in_graph_mode(tiny_model_dir, tmp_path, npu_plugins, method):
    """Decode steps through the emulated torchair graphs (bf16): each graph holds one quantized grouped
    matmul per projection of every mixture (int8 or int4 weights), and the tokens are the eager path's."""
    from tests.ascend import fake_torchair

    from kiln.testing.engine import greedy_tokens, make_engine, run_greedy
    from kiln.testing.quantization import rounded_copy

    quantized, _ = rounded_copy(tiny_model_dir("mixtral"), tmp_path, method, 32)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7]]
    common = dict(model=quantized, dtype="bfloat16", max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4)
    before = len(fake_torchair.graphs)
    engine = make_engine(npu_plugins, device="npu_emulated", block_size=64, **common)
    graphs = fake_torchair.graphs[before:]
    graph = run_greedy(engine, prompts, 12)
    assert engine.executor.runner.graph_steps > 0 and graphs
    mixtures = sum(hasattr(m, "load_expert") for m in engine.executor.runner.model.modules())
    for g in graphs:
        nodes = g.graph.find_nodes(op="call_function", target=torch.ops.npu._grouped_matmul_quant_m.default)
        assert len(nodes) == 2 * mixtures > 0
    eager = greedy_tokens(npu_plugins, prompts, 12, device="npu_emulated", block_size=64, enforce_eager=True, **common)
    assert graph == eager
