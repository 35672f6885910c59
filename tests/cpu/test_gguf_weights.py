"""GGUF weights on the CPU: the 4/8-bit blocks recovered from fp32 widen back to every
value bit for bit, and the modules over them compute what the fp32 modules did."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, dequantize, quantize
from torch import nn

from kiln_cpu import native
from kiln_cpu.gguf_weights import GgufEmbedding, GgufLinear, find_gguf_form, use_gguf_weights

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="no C compiler for the CPU kernels")

FORMATS = {GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}


def gguf_weight(rows: int, cols: int, kind: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """An fp32 weight as a GGUF loader gives it: quantized by gguf-py, then widened."""
    x = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    x[0, :32] = 0.5  # a constant block: scale 0
    return torch.from_numpy(dequantize(quantize(x, kind), kind).astype(np.float32))


@pytest.mark.parametrize("kind", FORMATS)
def test_blocks_are_recovered_exactly(kind):
    w = gguf_weight(1104, 96, kind)  # more rows than one recovery chunk
    form = find_gguf_form(w)
    assert form is not None and form.fmt == FORMATS[kind] and form.shape == (1104, 96)
    assert torch.equal(form.unpack(), w)
    rows = torch.tensor([1103, 0, 7, 7, 8, 15, 16])
    assert torch.equal(form.unpack(rows), w[rows])
    assert form.q.nbytes + form.scale.nbytes < w.nbytes / 3


def test_other_weights_are_left_alone():
    assert find_gguf_form(torch.randn(64, 64)) is None
    assert find_gguf_form(gguf_weight(8, 64, GGMLQuantizationType.Q8_0).bfloat16()) is None
    w8 = gguf_weight(8, 64, GGMLQuantizationType.Q8_0)
    assert find_gguf_form(w8[:, :32]) is None  # not contiguous
    assert find_gguf_form(w8.reshape(32, 16)) is None  # rows shorter than a block
    assert find_gguf_form(w8[:4]) is None  # fewer rows than a tile of features
    w = gguf_weight(2048, 64, GGMLQuantizationType.Q4_1)
    w[1500, 3] += 1e-3  # one value off, in the second chunk: the whole weight stays fp32
    assert find_gguf_form(w) is None


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 127, 128, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_the_fp32_linear(kind, rows, bias):
    torch.manual_seed(rows)
    fp32 = nn.Linear(96, 208, bias=bias)
    with torch.no_grad():
        fp32.weight.copy_(gguf_weight(208, 96, kind, seed=rows))
    packed = GgufLinear(find_gguf_form(fp32.weight), fp32.bias)
    x = torch.randn(rows, 96)
    got = packed(x)
    assert got.shape == (rows, 208) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, fp32.weight, fp32.bias), rtol=1e-5, atol=1e-5)
    strided = torch.randn(rows, 112)[:, 8:104]
    torch.testing.assert_close(packed(strided), F.linear(strided, fp32.weight, fp32.bias), rtol=1e-5, atol=1e-5)


def test_model_swap_shares_tied_weights_and_frees_nothing_it_needs():
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
    assert use_gguf_weights(model) == 3
    assert isinstance(model["embed"], GgufEmbedding) and isinstance(model["head"], GgufLinear)
    assert model["head"].weight is model["embed"].weight  # recovered once, shared
    assert type(model["random"]) is nn.Linear and type(model["narrow"]) is nn.Linear
    ids = torch.tensor([[3, 63], [0, 3]])
    assert torch.equal(model["embed"](ids), F.embedding(ids, embed_w))
    x = torch.randn(4, 32)
    torch.testing.assert_close(model["proj"](x), F.linear(x, proj.weight, proj.bias), rtol=1e-5, atol=1e-5)


def test_default_model_runs_on_its_gguf_blocks(default_model_dir):
    from kiln import LLM

    model = LLM(default_model_dir, dtype="float32").engine.runner.model
    assert isinstance(model.embed_tokens, GgufEmbedding) and model.lm_head.weight is model.embed_tokens.weight
    layer = model.layers[0]
    kinds = {type(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj)}
    assert kinds == {GgufLinear}
    assert not any(type(m) in (nn.Linear, nn.Embedding) for m in model.modules())
