"""Integer products over GGUF blocks (``csrc/int8_linear.c``): activations quantized to int8
per 32 inputs, exact int32 block sums. Checked against the same arithmetic in float64, on
every instruction-set path the kernel has, and end to end on the default model."""

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from test_tiled_weights import gguf_weight

from kiln_cpu import native
from kiln_cpu.tiled_weights import INT8_PER_BLOCK, INT8_PER_ROW, TiledLinear, TiledWeight, tiled_form, tiled_matmul

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="no C compiler for the CPU kernels")

KINDS = {
    "q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0, "q5_0": GGMLQuantizationType.Q5_0,  # in the Q4_1 / Q8_0 tiles
    "q4_k": GGMLQuantizationType.Q4_K, "q5_1": GGMLQuantizationType.Q5_1,  # Q4_1's / Q8_0's with mins
    "q5_k": GGMLQuantizationType.Q5_K, "q6_k": GGMLQuantizationType.Q6_K,  # Q6_K: a scale per 16
}  # fmt: skip


def activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, 32:64] = 0.0  # an all-zero block: scale 0
    return x


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` after the kernel's quantization: per 32 values, round(x * 127 / max|x|) * max|x| / 127."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, 0.0)
    return (torch.round(blocks * inv) * (amax / 127)).view(x.shape)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 64, 65, 131])
def test_products_are_the_quantized_rows_times_the_weight(kind, rows):
    w, bias = gguf_weight(208, 256, KINDS[kind], seed=rows), torch.randn(208)
    x = activations(rows, 256, seed=rows)
    got = tiled_matmul(tiled_form(w), x, bias, INT8_PER_BLOCK)
    want = (int8_rows(x).double() @ w.double().T + bias.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)  # fp32 sums of 8 blocks
    exact = F.linear(x, w, bias)
    assert 0 < (got - exact).abs().max() < 0.02 * exact.abs().max()  # quantized, and close


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_scales_give_the_same_products_bit_for_bit(kind):
    """Forms whose scales and mins fp16 holds exactly (GGUF's Q4_0/Q4_1/Q5_x/Q8_0 keep them in fp16)
    read them as fp16 (``narrow_scales``): the same outputs as from fp32 arrays, bit for bit, in
    the integer and the fp32 products, the embedding rows and the unpacked weight."""
    w, bias = gguf_weight(208, 256, KINDS[kind], seed=3), torch.randn(208)
    form = tiled_form(w)
    fp32 = TiledWeight(form.fmt, form.scale.float(), None if form.min is None else form.min.float(), form.q)
    assert form.scale.dtype == torch.float16 or kind not in ("q4_1", "q8_0")  # the default model's types
    if form.scale.dtype != torch.float16:
        pytest.skip(f"{kind}: its scales are not all fp16 values")
    for rows in (1, 5, 16, 70):
        x = activations(rows, 256, seed=rows)
        for mode in (INT8_PER_BLOCK, INT8_PER_ROW, 0):
            assert torch.equal(tiled_matmul(form, x, bias, mode), tiled_matmul(fp32, x, bias, mode))
    ids = torch.tensor([207, 0, 16, 5])
    assert torch.equal(form.unpack(ids), w[ids]) and torch.equal(form.unpack(), w)


def several_types(seed: int) -> torch.Tensor:
    """Rows of Q4_K, Q6_K and Q8_0 in one weight, as a fused q/k/v of a Q4_K_M file."""
    return torch.cat([gguf_weight(n, 256, KINDS[k], seed) for n, k in ((32, "q4_k"), (16, "q6_k"), (16, "q8_0"))])


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_products_over_rows_of_several_types(rows):
    w, x = several_types(rows), activations(rows, 256, seed=rows)
    form = tiled_form(w)
    assert form.fmt == 6 and form.min is not None  # int8 codes, a scale per 16, a min per 32
    want = (int8_rows(x).double() @ w.double().T).float()
    torch.testing.assert_close(tiled_matmul(form, x, None, INT8_PER_BLOCK), want, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("rows", [32, 45, 64])
def test_wide_q4_tiles_split_a_part_at_a_time_give_each_rows_products(rows):
    """From 32 rows a Q4 tile is split into bytes once for its passes, 64 blocks at a time, the sums
    of a tile wider than that (K 4192: two parts and 3 blocks) carried over between parts: each
    row's products are, bit for bit, those it gets alone (one row is never split), the bias added
    once, and the quantized rows times the weight."""
    k = 2 * 64 * 32 + 3 * 32
    w, bias = gguf_weight(48, k, KINDS["q4_1"], seed=rows), torch.randn(48)
    x = activations(rows, k, seed=rows)
    form = tiled_form(w)
    got = tiled_matmul(form, x, bias, INT8_PER_BLOCK)
    alone = torch.cat([tiled_matmul(form, x[i : i + 1], bias, INT8_PER_BLOCK) for i in range(rows)])
    assert torch.equal(got, alone)
    want = (int8_rows(x).double() @ w.double().T + bias.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)  # fp32 sums of 131 blocks


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "several"])
@pytest.mark.parametrize("rows", [15, 16, 31, 33, 300])
def test_a_rows_products_do_not_depend_on_the_rows_beside_it(kind, rows):
    """Every row count gives each row, bit for bit, its products alone: on an AMX machine
    (``int8_amx_rows``) the tile path from 16 or 32 rows against vpdpbusd's one row; elsewhere the
    panels. 300 rows: two of the tile path's row chunks and a part-filled A tile."""
    w = several_types(rows) if kind == "several" else gguf_weight(64, 512, KINDS[kind], seed=rows)
    form, bias = tiled_form(w), torch.randn(w.shape[0])
    x = activations(rows, w.shape[1], seed=rows)
    for mode in (INT8_PER_BLOCK, INT8_PER_ROW):
        got = tiled_matmul(form, x, bias, mode)
        alone = torch.cat([tiled_matmul(form, x[i : i + 1], bias, mode) for i in range(rows)])
        assert torch.equal(got, alone), mode


@pytest.mark.skipif("amx_int8" not in native._cpu_flags().split(), reason="no AMX-INT8 on this CPU")
def test_amx_machines_multiply_on_the_tiles():
    """The build enables AMX where the CPU has it, and the kernel gets the process its tiles."""
    lib = native.load_kernels()
    assert lib.int8_amx_rows(4) == 32 and lib.int8_amx_rows(8) == lib.int8_amx_rows(6) == 16


def test_strided_rows_and_the_exact_path():
    w = gguf_weight(64, 128, KINDS["q4_1"])
    x = torch.randn(5, 160)[:, 16:144]
    layer = TiledLinear(tiled_form(w), None, INT8_PER_BLOCK)
    torch.testing.assert_close(layer(x), layer(x.contiguous()), rtol=0, atol=0)
    exact = TiledLinear(tiled_form(w), None)  # int8_activations off: the weights widened to fp32
    torch.testing.assert_close(exact(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_fp32_tiles_ignore_the_int8_flag():
    w = torch.randn(32, 64)  # not GGUF blocks: fp32 tiles, whose activations stay fp32
    x = torch.randn(3, 64)
    form = tiled_form(w)
    assert form.fmt == 32
    torch.testing.assert_close(tiled_matmul(form, x, None, INT8_PER_BLOCK), x @ w.T, rtol=1e-5, atol=1e-5)


_PRODUCTS = """
import json, sys, torch
sys.path.insert(0, {here!r})
from test_int8_linear import KINDS, activations, gguf_weight, several_types
from kiln_cpu.tiled_weights import TiledWeight, pack_q8, pack_tiles, tiled_form, tiled_matmul
out = {{}}
g = torch.Generator().manual_seed(0)
codes = torch.randint(-128, 128, (48, 256), generator=g)
codes[:, :8] = -128  # the code no GGUF block has (W8A8 checkpoints may): |w| and 128 * sum(w) overflow int8
forms = {{kind: lambda rows, kind=kind: tiled_form(gguf_weight(48, 256, KINDS[kind], rows)) for kind in KINDS}}
forms["several"] = lambda rows: tiled_form(several_types(rows))
forms["int8"] = lambda rows: TiledWeight(8, pack_tiles(torch.rand(48, 8, generator=g) / 50), None, pack_q8(codes))
for kind, form in forms.items():
    for rows in (1, 3, 4, 6, 9, 70):
        for mode in (1, 2):  # int8 per block, per row
            out[f"{{kind}}-{{rows}}-{{mode}}"] = tiled_matmul(form(rows), activations(rows, 256, rows), None, mode).tolist()
wide = tiled_form(gguf_weight(48, 4192, KINDS["q4_1"], 0))  # split passes over 64 blocks at a time
out["wide"] = tiled_matmul(wide, activations(40, 4192, 0), torch.ones(48), 1).tolist()
# each row's products bit for bit those it gets alone (one row is never split), in this build too
for kind, form, k in (("q4_1", forms["q4_1"](0), 256), ("q8_0", forms["q8_0"](0), 256), ("wide", wide, 4192)):
    x = activations(33, k, 1)
    alone = torch.cat([tiled_matmul(form, x[i : i + 1], torch.ones(48), 1) for i in range(33)])
    out[f"{{kind}}-alone"] = bool(torch.equal(tiled_matmul(form, x, torch.ones(48), 1), alone))
print(json.dumps(out))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels")
# AVX2 with AVX-VNNI and no AVX-512 (Alder Lake: vpdpbusd on ymm); AVX2 without VNNI (vpmaddubsw); portable C
@pytest.mark.parametrize("march", ["alderlake", "x86-64-v3", "x86-64"])
def test_every_instruction_set_path_gives_the_same_products(march, march_cache_dir):
    """Against this machine's build (on an AVX-512 VNNI machine, the zmm path), activations int8 per block and per row."""
    if march == "alderlake" and "avx_vnni" not in native._cpu_flags().split():
        pytest.skip("this CPU has no AVX-VNNI to run that build")
    env = {**os.environ, "KILN_CPU_MARCH": march, "KILN_CACHE_DIR": str(march_cache_dir)}
    code = _PRODUCTS.format(here=os.path.dirname(__file__))
    other = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True).stdout)  # fmt: skip
    assert list(march_cache_dir.glob("cpu-kernels/*.so"))  # built for that level, not this machine's cached library
    here = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert [key for key, alone in other.items() if key.endswith("-alone") and not alone] == []
    for key, values in here.items():
        torch.testing.assert_close(torch.tensor(other[key]), torch.tensor(values), rtol=1e-5, atol=1e-4, msg=key)


def test_another_copy_of_the_sources_builds_beside_these(tmp_path):
    """``native.build_kernels`` (``bench/kernel_ab.py`` times two builds in one process): a copy
    of the sources builds into its own library, loaded beside this one, whose products are this
    one's bit for bit, even where it lacks an entry point (an older revision's, from before an
    op was added); a folder without them is an error that says which."""
    shutil.copytree(native.CSRC, tmp_path / "csrc")
    fused = tmp_path / "csrc" / "fused_ops.c"
    fused.write_text("#define gelu_tanh_and_mul_f32 not_in_older_builds\n" + fused.read_text())
    other = native.build_kernels(tmp_path / "csrc", tmp_path / "other.so")
    assert other._name == str(tmp_path / "other.so") != native.load_kernels()._name
    weight, x = tiled_form(gguf_weight(48, 256, KINDS["q4_1"], 0)), activations(9, 256, 0)
    outs = []
    for lib in (native.load_kernels(), other):
        out = torch.empty(9, 48)
        assert lib.int8_linear(out.data_ptr(), x.data_ptr(), 9, 256, *weight.kernel_args, None, 256, 48, 0) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0
    with pytest.raises(RuntimeError, match=f"building the CPU kernels of {tmp_path / 'none'} failed"):
        native.build_kernels(tmp_path / "none", tmp_path / "none.so")


def test_gguf_models_multiply_in_int8_unless_told_not_to(default_model_dir):
    from kiln import LLM
    from kiln.models.loader import default_model_path
    from kiln.sampling_params import SamplingParams

    def qkv(llm):
        return llm.engine.executor.runner.model.layers[0].self_attn.qkv_proj

    def kv_dtype(llm):
        return llm.engine.executor.runner.kv_caches[0].dtype

    gguf = LLM(default_model_path(), max_model_len=256)  # K/V in bf16, as llama.cpp keeps them in f16
    assert gguf.engine.config.quantization == "gguf" and qkv(gguf).int8_activations
    assert kv_dtype(gguf) == torch.bfloat16
    reference = LLM(default_model_path(), max_model_len=256, attention_backend="torch_ref")
    assert qkv(reference).int8_activations and kv_dtype(reference) == torch.float32  # a backend without bf16 K/V
    exact = LLM(default_model_path(), max_model_len=256, quantization="none", dtype="float32")  # AMX: auto is bf16
    assert not qkv(exact).int8_activations and kv_dtype(exact) == torch.float32
    folder = LLM(default_model_dir, max_model_len=256, dtype="float32")  # the same weights as safetensors: exact
    assert folder.engine.config.quantization is None and not qkv(folder).int8_activations
    assert kv_dtype(folder) == torch.float32
    prompt = [{"prompt_token_ids": list(range(1000, 1040))}]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = [llm.generate(prompt, params)[0].outputs[0].token_ids for llm in (exact, folder)]
    assert ids[0] == ids[1]
    with pytest.raises(ValueError, match="--quantization gguf: the model is not a .gguf file"):
        LLM(default_model_dir, max_model_len=256, quantization="gguf")


HELDOUT = (Path(__file__).parent.parent / "data" / "heldout.txt").read_text()[:3000]


@pytest.fixture(scope="module")
def default_file_perplexity() -> float:
    """The default model's file, served as it is, on ``HELDOUT``."""
    from kiln import LLM
    from kiln.models.loader import default_model_path
    from kiln.quantization.evaluate import perplexity

    return perplexity(LLM(default_model_path(), max_model_len=512), HELDOUT)


@pytest.mark.parametrize(
    ("quant_type", "overrides", "fmts"),
    [
        ("Q6_K", {}, (4, 4, 4, 6)),
        # Q4_0 whole in gate/up and down, Q5_0 whole in o, and Q4_0 and Q5_1 in one q/k/v
        ("Q4_0", {"attn_v.weight": "Q5_1", "attn_output.weight": "Q5_0"}, (8, 8, 4, 4)),
    ],
)  # fmt: skip
def test_other_gguf_types_stay_in_blocks(tmp_path, default_file_perplexity, quant_type, overrides, fmts):
    """The default model's file re-quantized to other GGUF types: served from its blocks
    (Q4_0 as Q4_1-style tiles, Q5_0 and Q5_1 as 8-bit ones, Q6_K as 8-bit ones with a scale per
    16 inputs) with int8 activations, close in perplexity to the exact products of the same
    weights and to the original file. Expected formats of q/k/v (fused), o, gate/up (fused) and
    down: the K-quants take rows of 256 inputs, so only the down projection (1536 inputs; the
    others have 576) changes type; a q/k/v of two types (as in llama.cpp's Q4_K_M files) is
    held as 8-bit codes with a min. Each case converts a new file (~20 s), so the mixed case
    stands for Q4_0 and Q5_0 whole, and Q5_1 in part."""
    import shutil

    from kiln import LLM
    from kiln.models.loader import default_model_path, resolve_model
    from kiln.quantization.evaluate import perplexity
    from kiln.testing.models import requantized_gguf

    path = requantized_gguf(default_model_path(), str(tmp_path / f"model.{quant_type}.gguf"), quant_type, overrides)
    try:
        llm = LLM(path, max_model_len=512)
        layer = llm.engine.executor.runner.model.layers[0]
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        assert tuple(p.weight.fmt for p in projections) == fmts and all(p.int8_activations for p in projections)
        ppl = perplexity(llm, HELDOUT)
        exact = perplexity(LLM(path, max_model_len=512, quantization="none"), HELDOUT)
    finally:
        shutil.rmtree(resolve_model(path, "auto").path)  # the converted folder this test made in the cache
    assert ppl != exact and abs(ppl / exact - 1) <= 0.02  # int8 activations: another rounding, as close
    # the same model, rounded twice (Q4_1's blocks re-quantized to Q4_0 cost ~30 % here)
    assert ppl < 1.5 * default_file_perplexity
