"""Tiled weights on the CPU: fp32 tiles and GGUF blocks (recovered from fp32, widening
back to every value bit for bit), and the modules over them compute what the fp32
modules did."""

import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize, quantize
from torch import nn

from kiln.testing.kquants import KQUANTS, quantize_kquant
from kiln_cpu import native
from kiln_cpu.module_swap import replace_linears
from kiln_cpu.tiled_weights import TiledEmbedding, TiledLinear, find_gguf_form, tiled_form, use_tiled_weights

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="no C compiler for the CPU kernels")

FORMATS = {
    GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q8_0: 8,
    GGMLQuantizationType.Q5_0: 8, GGMLQuantizationType.Q5_1: 8, GGMLQuantizationType.Q4_K: 4,
    GGMLQuantizationType.Q5_K: 8, GGMLQuantizationType.Q6_K: 6, "bf16": 16, None: 32,
}  # fmt: skip
WITH_MIN = {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_1,
            GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K}  # fmt: skip


def gguf_weight(rows: int, cols: int, kind: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """An fp32 weight as a GGUF loader gives it: quantized by gguf-py (the K-quants by
    ``kiln.testing.kquants``: rows of 256 values), then widened."""
    x = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    x[0, :32] = 0.5  # a constant block: scale 0
    if kind is None:  # a plain fp32 weight
        return torch.from_numpy(x)
    if kind == "bf16":  # a bf16 checkpoint's weight, served in fp32
        return torch.from_numpy(x).bfloat16().float()
    data = quantize_kquant(x, kind) if kind in KQUANTS else quantize(x, kind)
    return torch.from_numpy(dequantize(data, kind).astype(np.float32).reshape(rows, cols))


@pytest.mark.parametrize("kind", FORMATS)
def test_tiles_hold_every_value(kind):
    w = gguf_weight(1104, 256, kind)  # more rows than one recovery chunk
    form = tiled_form(w)
    assert form is not None and form.fmt == FORMATS[kind] and form.shape == (1104, 256)
    assert (form.min is not None) == (kind in WITH_MIN)
    assert torch.equal(form.unpack(), w)
    rows = torch.tensor([1103, 0, 7, 7, 8, 15, 16])
    assert torch.equal(form.unpack(rows), w[rows])
    if kind == "bf16":
        assert form.q.nbytes == w.nbytes / 2 and form.scale is None
    elif kind is not None:
        assert form.q.nbytes + form.scale.nbytes < w.nbytes / 3


def test_weights_that_are_not_gguf_blocks():
    assert find_gguf_form(torch.randn(64, 64)) is None
    assert find_gguf_form(gguf_weight(8, 64, GGMLQuantizationType.Q8_0).bfloat16()) is None
    w8 = gguf_weight(16, 64, GGMLQuantizationType.Q8_0)
    assert tiled_form(w8[:, :32]) is None  # not contiguous
    assert find_gguf_form(w8.reshape(64, 16)) is None  # rows shorter than a block...
    assert tiled_form(w8.reshape(64, 16)).fmt == 32  # ...but fp32 tiles need no blocks
    assert tiled_form(w8[:8]) is None  # fewer rows than a tile of features
    w = gguf_weight(2048, 64, GGMLQuantizationType.Q4_1)
    w[1500, 3] += 1e-3  # one value off, in the second chunk: the whole weight stays fp32
    assert find_gguf_form(w) is None
    w = gguf_weight(2048, 64, "bf16")
    w[1500, 3] += 1e-6  # one value bf16 does not hold: fp32 tiles
    assert tiled_form(w).fmt == 32


# bf16 read in place (any rows with AVX-512; with AVX2 up to two passes of 6), widened first past that
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 12, 13, 25])
def test_bf16_tiles_compute_what_fp32_tiles_compute(monkeypatch, rows):
    w, x = gguf_weight(64, 96, "bf16"), torch.randn(rows, 96)
    narrow = TiledLinear(tiled_form(w), None)
    monkeypatch.setenv("KILN_CPU_GGUF_BLOCKS", "0")  # every weight in fp32 tiles
    wide = TiledLinear(tiled_form(w), None)
    assert (narrow.weight.fmt, wide.weight.fmt) == (16, 32)
    assert torch.equal(narrow(x), wide(x))  # the same values, summed in the same order


@pytest.mark.parametrize("kind", ["bf16", None])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13])
def test_tiles_taken_in_groups_sum_as_one_at_a_time(kind, rows):
    """Tiles read in place go two or four at a time (more FMA chains a row at decode sizes): each
    output is the same, bit for bit, as its tile's product on its own."""
    w, x, bias = gguf_weight(256, 96, kind, seed=rows), torch.randn(rows, 96), torch.randn(256)
    whole = TiledLinear(tiled_form(w), bias)(x)  # 16 tiles: in fours (AVX-512, up to 4 rows) or pairs
    for t in range(16):
        one = TiledLinear(tiled_form(w[16 * t : 16 * t + 16]), bias[16 * t : 16 * t + 16])(x)
        assert torch.equal(whole[:, 16 * t : 16 * t + 16], one)


@pytest.mark.parametrize("kind", FORMATS)
# passes over a tile of 1 to 6 rows (AVX2) or 1 to 12 (AVX-512), even sizes: 300 = 25 x 12, 127 = 10 x 12 + 7
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 11, 16, 64, 127, 128, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_the_fp32_linear(kind, rows, bias):
    torch.manual_seed(rows)
    fp32 = nn.Linear(256, 208, bias=bias)
    with torch.no_grad():
        fp32.weight.copy_(gguf_weight(208, 256, kind, seed=rows))
    packed = TiledLinear(tiled_form(fp32.weight), fp32.bias)
    assert packed.weight.fmt == FORMATS[kind]
    x = torch.randn(rows, 256)
    got = packed(x)
    assert got.shape == (rows, 208) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, fp32.weight, fp32.bias), rtol=1e-5, atol=5e-5)
    strided = torch.randn(rows, 272)[:, 8:264]
    torch.testing.assert_close(packed(strided), F.linear(strided, fp32.weight, fp32.bias), rtol=1e-5, atol=5e-5)


def test_model_swap_shares_tied_weights_and_frees_the_originals():
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(64, 32),
            "head": nn.Linear(32, 64, bias=False),
            "proj": nn.Linear(32, 32),
            "random": nn.Linear(32, 32),
            "narrow": nn.Linear(32, 32).bfloat16(),
        }
    )
    with torch.no_grad():
        model["embed"].weight.copy_(gguf_weight(64, 32, GGMLQuantizationType.Q8_0))
        model["proj"].weight.copy_(gguf_weight(32, 32, GGMLQuantizationType.Q4_1))
    model["head"].weight = model["embed"].weight
    embed_w, proj = model["embed"].weight.detach().clone(), model["proj"]
    originals = [weakref.ref(model[name].weight) for name in ("embed", "random")]
    assert use_tiled_weights(model) == (4, 3)
    assert all(ref() is None for ref in originals)  # the fp32 copies are freed
    assert isinstance(model["embed"], TiledEmbedding) and isinstance(model["head"], TiledLinear)
    assert model["head"].weight is model["embed"].weight  # recovered once, shared
    assert model["head"].weight.fmt == 8 and model["proj"].weight.fmt == 4 and model["random"].weight.fmt == 32
    assert type(model["narrow"]) is nn.Linear
    ids = torch.tensor([[3, 63], [0, 3]])
    assert torch.equal(model["embed"](ids), F.embedding(ids, embed_w))
    x = torch.randn(4, 32)
    torch.testing.assert_close(model["proj"](x), F.linear(x, proj.weight, proj.bias), rtol=1e-5, atol=1e-5)


def test_default_model_runs_on_its_gguf_blocks(default_model_dir):
    from kiln import LLM

    model = LLM(default_model_dir, dtype="float32").engine.executor.runner.model
    assert isinstance(model.embed_tokens, TiledEmbedding) and model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.fmt == 8  # Q8_0 in the file
    layer = model.layers[0]
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    assert {(type(m), m.weight.fmt) for m in linears} == {(TiledLinear, 4)}  # Q4_1
    assert not any(type(m) in (nn.Linear, nn.Embedding) for m in model.modules())


def test_layers_are_tiled_and_freed_as_they_load(default_model_dir, monkeypatch):
    """Each decoder layer is tiled once the checkpoint has filled it, and its fp32 weights are
    gone before the next layer's last tensor arrives: the whole model is never resident in fp32
    (nor written with random values first, which made every page resident at build)."""
    from kiln import LLM
    from kiln.models import llama
    from kiln_cpu.platform import CpuPlatform

    order, fp32 = [], []
    read = llama.LlamaForCausalLM.checkpoint_tensors
    repack = CpuPlatform.process_layer_weights

    def tensors(self, weights):
        for name, tensor in read(self, weights):
            order.append(name)
            yield name, tensor

    def layer_done(self, layer, config):
        assert all(ref() is None for ref in fp32)  # the layers before are tiled and their originals freed
        assert type(layer.mlp.gate_up_proj) is nn.Linear and layer.mlp.gate_up_proj.weight.abs().sum() > 0
        fp32.append(weakref.ref(layer.mlp.gate_up_proj.weight))
        repack(self, layer, config)
        assert type(layer.mlp.gate_up_proj) is TiledLinear
        order.append(f"done {layer.self_attn.layer_idx}")

    monkeypatch.setattr(llama.LlamaForCausalLM, "checkpoint_tensors", tensors)
    monkeypatch.setattr(CpuPlatform, "process_layer_weights", layer_done)
    model = LLM(default_model_dir, dtype="float32").engine.executor.runner.model
    done = [o for o in order if o.startswith("done")]
    assert sorted(done) == sorted(f"done {i}" for i in range(len(model.layers)))  # once each, in the file's order
    for i in range(len(model.layers)):  # right after the layer's last tensor
        last = max(j for j, name in enumerate(order) if name.startswith(f"model.layers.{i}."))
        assert order[last + 1] == f"done {i}"
    assert all(ref() is None for ref in fp32)


def test_replace_linears_keeps_tied_weights_and_skips_other_dtypes():
    embed = nn.Embedding(48, 16)
    model = nn.ModuleDict({"head": nn.Linear(16, 48, bias=False), "narrow": nn.Linear(16, 16).bfloat16()})
    model["head"].weight = embed.weight
    seen = []

    def wrap(linear):
        seen.append(linear.weight)
        return TiledLinear(tiled_form(linear.weight), linear.bias)

    assert replace_linears(model, {torch.float32: wrap}) == 1
    assert seen == [embed.weight] and isinstance(model["head"], TiledLinear)
    assert type(model["narrow"]) is nn.Linear


@pytest.mark.parametrize(("half", "fmt"), [(8, 4), (16, 8)])  # Q4_0, Q5_0
def test_q4_0_and_q5_0_blocks_with_fitted_scales(half, fmt):
    """With an importance matrix llama.cpp fits each block's d: its largest value need not take
    the code -half that ggml's reference quantizer gives it."""
    g = torch.Generator().manual_seed(half)
    codes = torch.randint(-half + 1, half - 1, (64, 96), generator=g).float()  # never -half
    d = (torch.rand(64, 3, 1, generator=g) - 0.5).half().float() / 16  # either sign, fp16 as GGUF stores it
    d[0, 1] = 0  # an all-zero block
    w = (codes.view(64, 3, 32) * d).view(64, 96)
    form = find_gguf_form(w)
    assert form is not None and form.fmt == fmt and torch.equal(form.unpack(), w)


@pytest.mark.parametrize(
    ("kinds", "fmt"),
    [
        ((GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0), 6),
        ((GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0), 8),
    ],
)  # fmt: skip
def test_rows_of_several_types(kinds, fmt):
    """A fused projection whose parts came from tensors of several GGUF types (llama.cpp's
    Q4_K_M gives q and k Q4_K, v Q6_K): held as int8 codes with a min, with a scale per 16
    inputs when a Q6_K part needs one; widens to every value and multiplies as fp32 does."""
    sizes = (1040, 48, 32)  # the first part spans two recovery chunks
    w = torch.cat([gguf_weight(n, 256, kind, seed=i) for i, (n, kind) in enumerate(zip(sizes, kinds))])
    form = find_gguf_form(w)
    assert form is not None and form.fmt == fmt and form.min is not None
    assert torch.equal(form.unpack(), w)
    assert form.q.nbytes + form.scale.nbytes + form.min.nbytes < w.nbytes / 2.5
    x = torch.randn(5, 256)
    torch.testing.assert_close(TiledLinear(form, None)(x), F.linear(x, w), rtol=1e-5, atol=5e-5)
    w[1100, 7] += 1e-3  # a row of no type: the whole weight stays fp32
    assert find_gguf_form(w) is None


@pytest.mark.parametrize(
    ("kind", "fmt"),
    [(GGMLQuantizationType.Q4_K, 4), (GGMLQuantizationType.Q5_K, 8), (GGMLQuantizationType.Q6_K, 6),
     (GGMLQuantizationType.Q3_K, 6), (GGMLQuantizationType.IQ4_NL, 8), (GGMLQuantizationType.IQ4_XS, 8)],
)  # fmt: skip
def test_blocks_of_any_codes_and_scales(kind, fmt):
    """Random bytes are valid K-quant and IQ4 blocks: codes that need not span their range and
    sub-block scales and mins of any value, as llama.cpp's search may leave them
    (``kiln.testing.kquants`` maps each range onto the full codes); only the fp16 (super-)block
    scales are set to sizes a file has. Q3_K (3-bit codes, a scale per 16 values) comes back in
    Q6_K's form, IQ4_NL and IQ4_XS (indices into 16 int8 values) as those int8 values."""
    rng = np.random.default_rng(int(kind))
    values, size = GGML_QUANT_SIZES[kind]  # per block, and its bytes
    raw = rng.integers(0, 256, (64, 512 // values, size), dtype=np.uint8)
    scales = (rng.random((*raw.shape[:2], 2)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)  # 4 bytes a block
    if kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        raw[..., :4] = scales  # d, dmin lead the block
    elif kind in (GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q6_K):
        raw[..., -2:] = scales[..., :2]  # d ends it
    else:
        raw[..., :2] = scales[..., :2]  # d leads it
    w = torch.from_numpy(dequantize(raw.reshape(64, -1), kind).astype(np.float32))
    form = find_gguf_form(w)
    assert form is not None and form.fmt == fmt and torch.equal(form.unpack(), w)


@pytest.mark.parametrize("per_code", [127, 127.5], ids=["absmax-127", "absmax-127.5"])
def test_per_channel_int8_rows(per_code):
    """Per-channel int8 weights widened at load (a quantized mixture's experts) come back as int8
    codes with each row's scale, under both quantizers' conventions: scale = absmax / 127, or
    absmax / 127.5 (llm-compressor's symmetric min-max: codes down to -128, inexact quotients)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1104, 256, generator=gen)
    w[5] = 0.0  # a row of zeros: scale 0
    scale = w.abs().amax(1, keepdim=True) / per_code
    codes = torch.clamp(torch.round(w / torch.where(scale > 0, scale, 1.0)), -128, 127)
    widened = codes * scale
    form = tiled_form(widened)
    assert form.fmt == 8 and form.min is None
    assert torch.equal(form.unpack(), widened)
    assert form.q.nbytes + form.scale.nbytes < widened.nbytes / 3
    if per_code == 127.5:
        assert (codes == -128).any()
    widened[7, 3] += 1e-4  # one value off a whole code: not int8 rows
    assert tiled_form(widened).fmt == 32
