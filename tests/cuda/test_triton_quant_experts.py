"""Quantized experts on the CUDA plugin (``TritonDequantMethod.process_experts``): AWQ, GPTQ,
weight-only int8 and fp8 experts stay packed and the grouped GEMM widens them tile by tile, giving the
core's reference ``fused_experts`` on the widened weights; a quantized Mixtral through the Triton
kernels serves what the CPU plugin serves from it (tests/quantization/test_quant_moe.py matches
that to transformers on the dequantized weights). On GPU where one is
present, else under Triton's interpreter on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.interfaces import model as REFERENCE
from kiln.quantization.config import QuantScheme
from kiln.testing import quantization as quant_testing
from kiln.testing.quantization import random_experts, w8a8_expert
from kiln_cuda import moe as triton_moe
from kiln_cuda import ops, quant
from kiln_cuda.moe import TILES, Int8Experts, QuantizedExperts, gemm_split, gemm_tile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
SCHEMES = {
    "w8a8": quant_testing.SCHEMES["w8a8"],  # int8 rows per token times int8 weights
    "w8a16": quant_testing.SCHEMES["w8a16"],  # weight-only int8, per channel
    "w4a16-awq": QuantScheme(4, 32, False),  # zero points, groups of 32
    "w4a16-sym": quant_testing.SCHEMES["w4a16-sym"],  # GPTQ without act-order, groups of 64
    "w8a16-zero": QuantScheme(8, 64, False),  # 8-bit codes with zero points
    "fp8-block": QuantScheme(8, 32, True, float_weights=True),  # float8 values, a scale per (row, 32 inputs)
    "fp8-channel": QuantScheme(8, None, True, float_weights=True),  # float8 values, a scale per row
}
EXPERTS, HIDDEN, INTER = 4, 128, 64


def mixture(dtype: torch.dtype = torch.float32, hidden: int = HIDDEN, inter: int = INTER) -> nn.Module:
    """A mixture layer as the core hands it over: its router, stacked weights without memory."""
    moe = nn.Module()
    moe.num_local, moe.gate = EXPERTS, nn.Linear(hidden, EXPERTS, bias=False, device=DEVICE)
    moe.w13 = nn.Parameter(torch.empty(EXPERTS, 2 * inter, hidden, dtype=dtype, device="meta"))
    moe.w2 = nn.Parameter(torch.empty(EXPERTS, hidden, inter, dtype=dtype, device="meta"))
    return moe


def packed(scheme: QuantScheme, experts: dict, dtype: torch.dtype) -> nn.Module:
    moe = mixture(dtype)
    assert quant.linear_method(scheme).process_experts(moe, experts)
    return moe


@pytest.mark.parametrize("split", [True, False])  # these layers are small: their K splits unless told not to
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 40, 80])  # each size of tile
@pytest.mark.parametrize("name", list(SCHEMES))
def test_packed_experts_match_the_reference_on_the_widened_weights(name, tokens, dtype, split, monkeypatch):
    if not split:
        monkeypatch.setattr(triton_moe, "MAX_SPLIT", 1)
    scheme = SCHEMES[name]
    experts, w13, w2 = random_experts(scheme, EXPERTS, HIDDEN, INTER, seed=tokens)
    moe = packed(scheme, experts, dtype)
    w8a8 = scheme.activation_bits == 8
    assert isinstance(moe.w13, Int8Experts if w8a8 else QuantizedExperts) and moe.w13.shape == tuple(w13.shape)
    stored = torch.int8 if w8a8 else torch.float8_e4m3fn if scheme.float_weights else torch.int32
    assert (moe.w13.weight if w8a8 else moe.w13.qweight).dtype == stored
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:2] for _ in range(tokens)]).to(DEVICE)
    ids[0, 1] = -1  # another rank's expert
    weights = torch.rand(tokens, 2, generator=gen).to(DEVICE)
    if w8a8:
        cpu = (x.float().cpu(), weights.cpu(), ids.cpu())
        want = REFERENCE.route_to_experts(*cpu, lambda e, rows: w8a8_expert(experts, e, rows, dtype, dtype))
    else:
        want = REFERENCE.fused_experts(x, w13.to(DEVICE, dtype), w2.to(DEVICE, dtype), weights.to(dtype), ids)
    got = ops.fused_experts(x, moe.w13, moe.w2, weights, ids)
    assert got.dtype == dtype
    # Random codes make large intermediates: the tolerance is relative to the outputs' scale.
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float().cpu() / scale, want.float().cpu() / scale, **TOL[dtype])


def test_act_order_experts_are_left_to_be_widened():
    act_order = QuantScheme(4, 32, False)
    experts, _, _ = random_experts(act_order, EXPERTS, HIDDEN, INTER, seed=0)
    for parts in experts.values():
        parts["g_idx"] = torch.arange(parts["weight"].shape[1], dtype=torch.int32) // 32
    assert not quant.linear_method(act_order).process_experts(mixture(), experts)


def test_groups_the_k_tiles_cannot_lie_in_are_left_to_be_widened():
    odd = QuantScheme(4, 24, False)  # 24 inputs per group: no K tile of 16 or more lies in one
    experts, _, _ = random_experts(odd, EXPERTS, 96, 48, seed=0)
    assert not quant.linear_method(odd).process_experts(mixture(hidden=96, inter=48), experts)


@pytest.mark.parametrize("group", [16, 32, 48, 64, 128, 4096])
@pytest.mark.parametrize("slots", [1, 16, 64, 1024])
def test_each_k_tile_of_packed_experts_lies_in_one_group(group, slots):
    """The kernel reads one scale row per K tile: the tile must divide the group (or the group be
    every input); a tile grows with the rows, and floats get tiles of their own."""
    codes = torch.zeros(EXPERTS, 4096 // 8, 256, dtype=torch.int32)
    scale = torch.ones(EXPERTS, 4096 // group, 256)
    packed = QuantizedExperts(codes, scale, None, 4, group, 8.0, (EXPERTS, 256, 4096))
    bm, bn, bk = gemm_tile(packed, slots)
    assert group % bk == 0 and bk >= 16
    assert gemm_tile(packed, 1024)[0] >= bm  # taller tiles for more rows per expert
    floats = torch.empty(EXPERTS, 256, 4096, device="meta")
    assert gemm_tile(floats, slots) in {tile for _, tile in TILES["float"]}


def test_k_splits_only_where_the_tiles_are_too_few():
    """Mixtral-8x7B's sizes: a token's down projection has 128 tiles with rows (2 experts x 64
    column tiles) and splits its 14,336 inputs in 4; its gate/up projection (896 tiles) and larger
    batches do not split; a part keeps one K tile at least."""
    assert gemm_split(8, 2, 4096, 14336, (16, 64, 64)) == 4
    assert gemm_split(8, 2, 2 * 14336, 4096, (16, 64, 64)) == 1
    assert gemm_split(8, 1024, 4096, 14336, (64, 128, 64)) == 1
    assert gemm_split(8, 2, 4096, 128, (16, 64, 64)) == 2
    assert gemm_split(8, 2, 4096, 64, (16, 64, 64)) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter path on CPU")
@pytest.mark.parametrize("method", ["awq", "weight_only_int8", "smooth_quant"])
def test_a_quantized_mixtral_through_triton_kernels_matches_the_cpu_plugin(
    tiny_model_dir, kiln_plugins, tmp_path, monkeypatch, method
):
    import test_triton_ops

    import kiln_cpu.plugin
    import kiln_cuda.plugin
    from kiln.testing.engine import greedy_tokens, make_engine, run_greedy
    from kiln.testing.quantization import rounded_copy

    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")  # the CPU's exact products of the dequantized weights

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_cuda.plugin, "cuda"), (test_triton_ops, "test")):
        kiln_plugins.register(module, name=name)
    quantized, _ = rounded_copy(tiny_model_dir("mixtral"), tmp_path, method, 32)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7]]
    common = dict(model=quantized, dtype="float32", block_size=16)
    engine = make_engine(kiln_plugins, device="cpu_triton", **common)
    moe = next(m for m in engine.executor.runner.model.modules() if hasattr(m, "load_expert"))
    kind = Int8Experts if method == "smooth_quant" else QuantizedExperts  # W8A8: int8 rows on both
    assert isinstance(moe.w13, kind) and isinstance(moe.w2, kind)
    assert "w13" not in dict(moe.named_parameters())  # no widened copy beside them
    assert run_greedy(engine, prompts, 8) == greedy_tokens(kiln_plugins, prompts, 8, device="cpu", **common)
