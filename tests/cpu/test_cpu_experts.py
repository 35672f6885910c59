"""The CPU plugin's mixtures of experts: fp32 experts tiled (``kiln_cpu.experts``) and bf16
experts as loaded, each layer in one C call (``csrc/experts.c``);
the plugin's ``fused_experts`` equals the reference, including another rank's experts (id -1), on
every instruction-set path."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from torch import nn

from kiln.interfaces.model import REFERENCE_OPS, route_to_experts
from kiln_cpu import native
from kiln_cpu.experts import PackedExperts, use_packed_experts
from kiln_cpu.fused_ops import (
    BF16_EXPERTS_CHUNK,
    TILED_EXPERTS_CHUNK,
    _bf16_experts_kernel_takes,
    _fused_experts_bf16,
    fused_experts,
)
from kiln_cpu.packed_linear import padded_rows
from kiln_cpu.tiled_weights import INT8_PER_BLOCK, INT8_PER_ROW, tiled_matmul

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="the C kernels did not build")


class Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w13 = nn.Parameter((torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype))
        self.w2 = nn.Parameter((torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype))


def routed(tokens: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, ids = REFERENCE_OPS["moe_route"](torch.randn(tokens, experts, generator=gen), top_k, True)
    ids[0, 1] = -1  # another rank's expert
    if tokens > 2:
        ids[2] = -1  # a token none of whose experts are here: a zero row
    return x, weights, ids


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """``w`` rounded to int8 codes with a scale per row, widened (a per-channel int8 checkpoint)."""
    scale = w.abs().amax(-1, keepdim=True) / 127
    return torch.round(w / scale) * scale


# The experts' values: any fp32; bf16-exact (tiled as bf16); int8 rows (tiled as int8 codes).
KINDS = {"fp32": (lambda w: w, 32), "bf16-exact": (lambda w: w.bfloat16().float(), 16), "int8-rows": (int8_rows, 8)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, 7, 40, TILED_EXPERTS_CHUNK + 44])  # the last: a prefill in two calls
def test_tiled_fp32_experts_match_the_reference(tokens, kind):
    rounding, fmt = KINDS[kind]
    module = Experts(8, 64, 96, torch.float32)
    with torch.no_grad():
        for p in (module.w13, module.w2):
            p.copy_(torch.stack([rounding(w) for w in p]))
    w13, w2 = module.w13.detach().clone(), module.w2.detach().clone()
    assert use_packed_experts(module) == 1
    assert isinstance(module.w13, PackedExperts) and not list(module.parameters())  # the originals are freed
    assert {w.fmt for w in module.w13.experts + module.w2.experts} == {fmt}
    x, weights, ids = routed(tokens, 8, 2, 64, torch.float32)
    expected = REFERENCE_OPS["fused_experts"](x, w13, w2, weights, ids)
    got = fused_experts(x, module.w13, module.w2, weights, ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if tokens > 2:
        assert not got[2].any()


@pytest.mark.parametrize("tokens", [1, 5, 13, 40])  # up to 6 tokens an expert: bf16 read in place; more: widened
def test_bf16_experts_compute_what_fp32_experts_compute(monkeypatch, tokens):
    modules = [Experts(8, 64, 96, torch.float32) for _ in range(2)]
    with torch.no_grad():
        for p in (modules[0].w13, modules[0].w2):
            p.copy_(p.bfloat16().float())
        modules[1].load_state_dict(modules[0].state_dict())
    assert use_packed_experts(modules[0]) == 1
    monkeypatch.setenv("KILN_CPU_GGUF_BLOCKS", "0")  # every weight in fp32 tiles
    assert use_packed_experts(modules[1]) == 1
    assert [{w.fmt for w in m.w13.experts + m.w2.experts} for m in modules] == [{16}, {32}]
    x, weights, ids = routed(tokens, 8, 2, 64, torch.float32)
    narrow, wide = (fused_experts(x, m.w13, m.w2, weights, ids) for m in modules)
    assert torch.equal(narrow, wide) and wide.abs().sum() > 0  # the same values, summed in the same order


@pytest.mark.parametrize("mode", [INT8_PER_BLOCK, INT8_PER_ROW], ids=["int8-per-block", "int8-per-row"])
@pytest.mark.parametrize(
    ("tokens", "inter"), [(1, 96), (7, 96), (40, 96), (TILED_EXPERTS_CHUNK + 44, 96), (7, 48)]
)  # 48: w2's rows of 48 inputs fit no block, so it stays fp32 beside int8 w13  # fmt: skip
def test_integer_experts_multiply_as_their_linear_layers(tokens, inter, mode):
    """Experts in int8 blocks with int8 activations: each expert's matmuls as ``tiled_matmul``
    computes them in that mode (the same integer kernel), summed by routing weight; and within
    int8 rounding of the fp32 products."""
    module = Experts(8, 64, inter, torch.float32)
    with torch.no_grad():
        for p in (module.w13, module.w2):
            p.copy_(torch.stack([int8_rows(w) for w in p]))
    w13, w2 = module.w13.detach().clone(), module.w2.detach().clone()
    assert use_packed_experts(module, mode) == 1
    assert {w.fmt for w in module.w13.experts} == {8} and {w.fmt for w in module.w2.experts} == {
        8 if inter % 32 == 0 else 32
    }
    assert module.w13.int8_activations == module.w2.int8_activations == mode
    x, weights, ids = routed(tokens, 8, 2, 64, torch.float32)
    got = fused_experts(x, module.w13, module.w2, weights, ids)

    def expert(e, rows):
        gate_up = tiled_matmul(module.w13.experts[e], rows, None, mode)
        return tiled_matmul(module.w2.experts[e], REFERENCE_OPS["silu_and_mul"](gate_up), None, mode)

    torch.testing.assert_close(got, route_to_experts(x, weights, ids, expert), atol=1e-5, rtol=1e-5)
    exact = REFERENCE_OPS["fused_experts"](x, w13, w2, weights, ids)
    assert not torch.equal(got, exact)  # the activations were rounded to int8 ...
    torch.testing.assert_close(got, exact, atol=0.05, rtol=0.05)  # ... and no more


def test_fp32_experts_ignore_an_integer_mode():
    """The model's quantized linear layers multiply in int8, but experts that hold no integer
    blocks keep the one fused fp32 call."""
    module = Experts(8, 64, 96, torch.float32)
    assert use_packed_experts(module, INT8_PER_BLOCK) == 1
    assert {w.fmt for w in module.w13.experts} == {32} and module.w13.int8_activations == 0


@pytest.mark.parametrize("bad", [8, -2])
def test_an_expert_id_outside_the_experts_is_refused_not_read(bad):
    x, weights, ids = routed(4, 8, 2, 64, torch.bfloat16)
    ids[3, 0] = bad
    module = Experts(8, 64, 96, torch.bfloat16)
    with pytest.raises(ValueError, match="an expert id outside the layer's 8 experts"):
        _fused_experts_bf16(x, module.w13.detach(), module.w2.detach(), weights, ids)
    tiled = Experts(8, 64, 96, torch.float32)
    assert use_packed_experts(tiled) == 1
    with pytest.raises(ValueError, match="fused_experts_tiled: an expert id outside"):
        fused_experts(x.float(), tiled.w13, tiled.w2, weights, ids)


def test_an_intermediate_size_off_the_tiles_stays_stacked():
    module = Experts(4, 64, 40, torch.float32)  # gate tile 2 would hold up rows
    assert use_packed_experts(module) == 0 and isinstance(module.w13, nn.Parameter)


# (experts, top_k, hidden, intermediate): Mixtral-like top 2; Qwen-MoE-like top 4, with sizes
# that are odd multiples of 32 (the AVX-512 kernel's step).
BF16_SHAPES = [(8, 2, 64, 96), (16, 4, 96, 160)]


def bf16_cases():
    for shape in BF16_SHAPES:
        experts, top_k, hidden, inter = shape
        module = Experts(experts, hidden, inter, torch.bfloat16)
        for tokens in (1, 5, 33, 64):  # every machine's kernel takes 64 (AMX tiles: from 3 rows an expert)
            yield (
                f"{shape}-{tokens}",
                module.w13.detach(),
                module.w2.detach(),
                routed(tokens, experts, top_k, hidden, torch.bfloat16),
            )


def assert_close_in_bf16(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The kernel rounds where the reference does; only the order of each dot product's sum
    differs, which moves a few outputs by an ulp of bf16 (2**-8 relative) or two, and where a
    hidden value's rounding flips, a small output by a few (AVX2's 8-float sums: 0.002 at 0.12)."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=2.5e-3)
    assert (got == expected).float().mean() > 0.9


def test_bf16_experts_run_in_the_decode_kernel_as_loaded():
    module = Experts(8, 64, 96, torch.bfloat16)
    assert use_packed_experts(module) == 0 and isinstance(module.w13, nn.Parameter)  # no copy
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    assert _bf16_experts_kernel_takes(x, module.w13, module.w2)
    if not native.load_kernels().fused_experts_bf16_amx():  # there a prefill goes to oneDNN's GEMM
        assert not _bf16_experts_kernel_takes(torch.zeros(65, 64, dtype=torch.bfloat16), module.w13, module.w2)
    narrow = Experts(8, 40, 96, torch.bfloat16)  # rows the kernel's vectors (16 or 32 values) do not divide
    assert not _bf16_experts_kernel_takes(torch.zeros(4, 40, dtype=torch.bfloat16), narrow.w13, narrow.w2)
    assert not _bf16_experts_kernel_takes(x.float(), module.w13.float(), module.w2.float())


@pytest.mark.parametrize("case", list(bf16_cases()), ids=lambda c: c[0])
def test_the_bf16_decode_kernel_matches_the_reference(case):
    _, w13, w2, (x, weights, ids) = case
    assert _bf16_experts_kernel_takes(x, w13, w2)
    got = fused_experts(x, w13, w2, weights, ids)
    assert_close_in_bf16(got, REFERENCE_OPS["fused_experts"](x, w13, w2, weights, ids))
    if x.shape[0] > 2:
        assert not got[2].any()


@pytest.mark.skipif(not native.load_kernels().fused_experts_bf16_amx(), reason="no AMX tiles to multiply on")
@pytest.mark.parametrize("shape", BF16_SHAPES, ids=str)
def test_on_amx_tiles_prefill_sized_bf16_experts_match_the_reference(shape):
    """Several groups of 16 of an expert's tokens (the tiles' columns), experts with a few
    tokens beside experts with many, and more tokens than one call of the kernel takes."""
    experts, top_k, hidden, inter = shape
    module = Experts(experts, hidden, inter, torch.bfloat16)
    x, weights, ids = routed(BF16_EXPERTS_CHUNK + 300, experts, top_k, hidden, torch.bfloat16)  # two calls
    ids[ids == 1] = -1  # expert 1 here for none (another rank's)
    ids[5:8, 0] = 1  # but for three tokens
    w13, w2 = module.w13.detach(), module.w2.detach()
    assert _bf16_experts_kernel_takes(x, w13, w2)
    got = fused_experts(x, w13, w2, weights, ids)
    assert_close_in_bf16(got, REFERENCE_OPS["fused_experts"](x, w13, w2, weights, ids))
    assert not got[2].any()


@pytest.mark.parametrize("fma_outruns", [False, True])
def test_bf16_prefills_take_widened_gemms_where_fmas_outrun_bf16_products(monkeypatch, fma_outruns):
    """Past the decode kernel's tokens, bf16 experts multiply as fp32 GEMMs on widened weights
    where FMAs outrun bf16 products (the reference's roundings, only the sums' order differs),
    else as the reference's bf16 matmuls on each expert's rows padded to ``padded_rows`` (a new
    row count is a new kernel for oneDNN to compile)."""
    from kiln_cpu import fused_ops

    monkeypatch.setattr(native, "fma_outruns_bf16_dots", lambda: fma_outruns)
    monkeypatch.setattr(fused_ops, "bf16_experts_max_tokens", lambda: 64)  # AMX machines' kernel takes any
    widened, padded = [], []
    kernel, pad = fused_ops.widened_linear, fused_ops.on_padded_rows
    monkeypatch.setattr(fused_ops, "widened_linear", lambda *a: widened.append(a[1].shape) or kernel(*a))
    monkeypatch.setattr(fused_ops, "on_padded_rows", lambda fn, rows: padded.append(len(rows)) or pad(fn, rows))
    module = Experts(8, 64, 96, torch.bfloat16)
    x, weights, ids = routed(6 * 64 + 7, 8, 2, 64, torch.bfloat16)  # ~100 rows an expert
    got = fused_experts(x, module.w13.detach(), module.w2.detach(), weights, ids)
    expected = REFERENCE_OPS["fused_experts"](x, module.w13.detach(), module.w2.detach(), weights, ids)
    assert_close_in_bf16(got, expected)
    chosen = torch.bincount(ids[ids >= 0], minlength=8)
    if fma_outruns:
        assert len(widened) == 2 * int((chosen > 0).sum()) and padded == []  # each expert chosen: w13, w2
    else:
        assert widened == [] and padded == [n for n in chosen.tolist() if n] and torch.equal(got, expected)
        assert any(padded_rows(n) > n for n in padded)
    assert not got[2].any()


_BF16_RESULTS = """
import json, sys, torch
sys.path.insert(0, {here!r})
from test_cpu_experts import bf16_cases
from kiln_cpu.fused_ops import fused_experts
print(json.dumps({{name: fused_experts(x, w13, w2, w, ids).float().tolist() for name, w13, w2, (x, w, ids) in bf16_cases()}}))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels")
# AVX512-BF16 without AMX (vdpbf16ps at every token count); AVX-512 without BF16; AVX2; SSE2
@pytest.mark.parametrize("march", ["cooperlake", "x86-64-v4", "x86-64-v3", "x86-64"])
def test_every_instruction_set_path_of_the_bf16_kernel_matches_the_reference(march, march_cache_dir):
    needs = {"cooperlake": "avx512_bf16", "x86-64-v4": "avx512bw"}.get(march)
    if needs and needs not in native._cpu_flags().split():
        pytest.skip(f"this CPU has no {needs} to run that build")
    env = {**os.environ, "KILN_CPU_MARCH": march, "KILN_CACHE_DIR": str(march_cache_dir)}
    done = subprocess.run([sys.executable, "-c", _BF16_RESULTS.format(here=os.path.dirname(__file__))], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert list(march_cache_dir.glob("cpu-kernels/*.so"))  # built for that level, not this machine's cached library
    got = json.loads(done.stdout)
    for name, w13, w2, (x, weights, ids) in bf16_cases():
        expected = REFERENCE_OPS["fused_experts"](x, w13, w2, weights, ids)
        assert_close_in_bf16(torch.tensor(got[name]).bfloat16(), expected)


def test_without_the_c_kernels_the_experts_stay_stacked(tiny_model_dir):
    """KILN_CPU_NATIVE=0 (or no compiler): no plugin fused_experts to read packed experts, so the
    platform leaves them as they are and the reference runs them."""
    code = (
        "from kiln import LLM, SamplingParams\n"
        f"llm = LLM({tiny_model_dir('mixtral')!r}, max_model_len=128)\n"
        "out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "moe = next(m for m in llm.engine.executor.runner.model.modules() if hasattr(m, 'load_expert'))\n"
        "print(type(moe.w13).__name__, len(out[0].outputs[0].token_ids))\n"
    )
    env = {**os.environ, "KILN_CPU_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["Parameter", "4"]


def test_a_bf16_moe_model_decodes_through_the_kernel(tiny_model_dir, monkeypatch):
    """A bf16 Mixtral's decode steps (and short prefills) run the kernel, and greedy output
    equals the reference's."""
    from kiln import LLM, SamplingParams
    from kiln_cpu import fused_ops

    calls = []
    kernel = fused_ops._fused_experts_bf16
    monkeypatch.setattr(fused_ops, "_fused_experts_bf16", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    llm = LLM(tiny_model_dir("mixtral"), dtype="bfloat16", max_model_len=128)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [40, 41]]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls.count(len(prompts)) >= 7 * 2  # the layers of the decode steps of all three
    monkeypatch.setattr(fused_ops, "bf16_experts_max_tokens", lambda: 0)  # every step through the reference
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == got
