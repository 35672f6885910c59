"""Quantized mixtures of experts: AWQ, GPTQ act-order and compressed-tensors int8 checkpoints
of Mixtral and Qwen2-MoE (attention, dense and shared-expert projections and every expert
quantized, the router left in full precision, as AutoAWQ, AutoGPTQ and llm-compressor write
them). The experts are widened to the model's dtype at load, the other layers stay quantized,
and Kiln serves exactly what transformers serves from the dequantized weights, on one rank and
on two. DeepSeek keeps its layers quantized but ``kv_b_proj``; models without quantized layers
(the transformers fallback) widen every layer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.interfaces import model as REFERENCE
from kiln.testing.models import hf_greedy
from kiln.testing.quantization import assert_serves_dequantized, rounded_copy

GROUP = 16  # divides Qwen2-MoE's tiny experts (32) and shared expert (48)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7]]
EXPERT_FORMATS = {"awq": 6, "gptq": 32, "weight_only_int8": 8}  # TiledWeight.fmt on the CPU


@pytest.mark.parametrize("method", ["awq", "gptq", "weight_only_int8"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_quantized_moe_serves_its_dequantized_weights(tiny_model_dir, tmp_path, monkeypatch, family, method):
    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")  # the exact products of the dequantized weights
    llm = assert_serves_dequantized(tiny_model_dir(family), tmp_path, method, GROUP, PROMPTS)
    model = llm.engine.executor.runner.model
    assert type(model.layers[0].self_attn.qkv_proj).__name__ != "Linear"  # attention stays quantized
    moe = next(m for m in model.modules() if hasattr(m, "load_expert"))
    assert not moe._parts.pending  # every expert's parts arrived and were widened
    # The CPU plugin finds the integer codes back in the widened fp32 experts: int8 rows; AWQ's
    # 4-bit groups of 16 as 8-bit codes with a scale per 16 (groups of 32 or more: 4-bit blocks);
    # GPTQ act-order's groups of shuffled inputs fit no block and stay fp32.
    assert {w.fmt for w in moe.w13.experts + moe.w2.experts} == {EXPERT_FORMATS[method]}


@pytest.mark.parametrize("method", ["awq", "weight_only_int8"])
def test_quantized_experts_go_straight_into_their_tiles(tiny_model_dir, tmp_path, monkeypatch, method):
    """Groups of 32 inputs: the CPU plugin takes the experts' codes as they are (gate and up
    stacked), never widening them: AWQ's 4-bit codes stay 4-bit (found back from widened
    values, they had come out as 8-bit codes, and the search took most of a start)."""
    from kiln_cpu import tiled_weights

    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")
    recovered = []
    search = tiled_weights.recover_blocks
    monkeypatch.setattr(
        tiled_weights, "recover_blocks", lambda w, *a: recovered.append(tuple(w.shape)) or search(w, *a)
    )
    llm = assert_serves_dequantized(tiny_model_dir("mixtral"), tmp_path, method, 32, PROMPTS)
    moe = next(m for m in llm.engine.executor.runner.model.modules() if hasattr(m, "load_expert"))
    assert {w.fmt for w in moe.w13.experts + moe.w2.experts} == {4 if method == "awq" else 8}
    assert [w.shape for w in moe.w13.experts] == [(256, 64)] * 4 and moe.w13.shape == (4, 256, 64)
    assert recovered and not {(256, 64), (64, 128)} & set(recovered)  # the embeddings were; no expert
    assert not moe.quantized  # handed on, not held


def test_a_bf16_model_keeps_its_quantized_experts_in_tiles(tiny_model_dir, tmp_path, monkeypatch):
    """At ``--dtype bfloat16`` (the CPU's default with AMX) AWQ's experts stay 4-bit tiles, as
    at fp32, where they had been widened to bf16: bf16 rows go through the fp32 kernel and come
    back rounded, the dequantized weights' products to within bf16's rounding."""
    from kiln import LLM, SamplingParams
    from kiln_cpu.experts import PackedExperts
    from kiln_cpu.fused_ops import fused_experts

    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")  # the exact products of the dequantized weights
    quantized, dequantized = rounded_copy(tiny_model_dir("mixtral"), tmp_path, "awq", 32)
    llm = LLM(quantized, max_model_len=128, dtype="bfloat16")
    moe = llm.engine.executor.runner.model.layers[1].mlp
    assert isinstance(moe.w13, PackedExperts) and {w.fmt for w in moe.w13.experts + moe.w2.experts} == {4}
    weights = load_file(str(Path(dequantized) / "model.safetensors"))
    expert = "model.layers.1.block_sparse_moe.experts.{}.{}.weight".format
    w13 = torch.stack([torch.cat([weights[expert(e, "w1")], weights[expert(e, "w3")]]) for e in range(4)])
    w2 = torch.stack([weights[expert(e, "w2")] for e in range(4)])
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, w13.shape[2], generator=generator).to(torch.bfloat16)
    route = torch.rand(5, 2, generator=generator)
    ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(5)])
    got = fused_experts(x, moe.w13, moe.w2, route, ids)
    exact = REFERENCE.fused_experts(x.float(), w13, w2, route, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, rtol=1e-2, atol=1e-2 * exact.abs().max().item())
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)  # prefill and decode steps
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced-experts", "expert-parallel"])
@pytest.mark.parametrize(("family", "group"), [("mixtral", 32), ("deepseek_v2", GROUP)])
def test_quantized_experts_split_over_two_ranks(
    tiny_model_dir, cpu_plugins, tmp_path, monkeypatch, expert_parallel, family, group
):
    """Each rank's slice of every expert's codes, or its whole experts (Mixtral's groups of 32 go
    into the tiles either way; DeepSeek's groups of 16 fit none and are widened); DeepSeek's
    quantized query rows and scales cut per rank."""
    from kiln.testing.engine import run_and_shut_down

    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")
    source = tiny_model_dir(family)
    quantized, dequantized = rounded_copy(source, tmp_path, "awq", group)
    split, _ = run_and_shut_down(
        cpu_plugins, PROMPTS, model=quantized, device="cpu", dtype="float32", tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )  # fmt: skip
    assert split == hf_greedy(dequantized, PROMPTS, 8)


def test_quantized_experts_without_a_quantization_config_are_refused(tiny_model_dir, tmp_path):
    from kiln import LLM

    quantized, _ = rounded_copy(tiny_model_dir("mixtral"), tmp_path, "weight_only_int8", GROUP)
    config = json.loads((Path(quantized) / "config.json").read_text())
    del config["quantization_config"]
    (Path(quantized) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="without a quantization_config"):
        LLM(quantized, max_model_len=128)


EXPERT_2 = r"model\.layers\.1\.mlp\.experts\.2\.down_proj"


@pytest.mark.parametrize(
    ("method", "deleted", "message"),
    [
        (None, "experts.2.w2.", rf"missing experts' weights: \['{EXPERT_2}'\]"),  # Mixtral's down_proj: w2
        ("awq", "experts.2.w2.", rf"missing experts' weights: \['{EXPERT_2}'\]"),
        ("awq", "experts.2.w2.scales", r"missing model\.layers\.1\.block_sparse_moe\.experts\.2\.w2\.scales"),
        (None, "experts.", r"missing experts' weights: \['model\.layers\.1\.mlp\.experts\.0\.down_proj', "),
    ],
    ids=["expert", "quantized-expert", "quantized-part", "every-expert"],
)
def test_a_missing_expert_is_named(tiny_model_dir, tmp_path, method, deleted, message):
    from safetensors.torch import save_file

    from kiln import LLM

    folder = tiny_model_dir("mixtral")
    if method is not None:
        folder, _ = rounded_copy(folder, tmp_path, method, GROUP)
    else:
        folder = str(shutil.copytree(folder, tmp_path / "copy"))
    file = Path(folder) / "model.safetensors"
    tensors = load_file(str(file))
    for key in [k for k in tensors if k.startswith("model.layers.1.block_sparse_moe." + deleted)]:
        del tensors[key]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        LLM(folder, max_model_len=128)


def test_w8a8_experts_are_their_dequantized_weights(tiny_model_dir, tmp_path):
    """SmoothQuant (W8A8) checkpoints keep int8 weights unpacked: the experts widen from them to
    exactly the dequantized weights, while attention multiplies int8 activations."""
    from kiln import LLM

    source = tiny_model_dir("mixtral")
    quantized, dequantized = rounded_copy(source, tmp_path, "smooth_quant", GROUP)
    llm = LLM(quantized, max_model_len=128)
    model = llm.engine.executor.runner.model
    assert model.layers[0].self_attn.qkv_proj.scheme.activation_bits == 8
    assert {w.fmt for w in model.layers[1].mlp.w13.experts} == {8}  # int8 codes on the CPU ...
    assert model.layers[1].mlp.w13.int8_activations == 2  # ... times activations int8 per row, as W8A8 says
    expected = load_file(str(Path(dequantized) / "model.safetensors"))
    moe = model.layers[1].mlp
    for e in range(4):
        w13 = moe.w13.experts[e].unpack()  # the CPU plugin's tiles of the fp32 experts
        names = (f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w3"))
        assert torch.equal(w13, torch.cat([expected[n] for n in names]))
        assert torch.equal(
            moe.w2.experts[e].unpack(), expected[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"]
        )


@pytest.mark.parametrize(
    ("family", "method", "group", "expert_format"),
    [("deepseek_v2", "awq", 32, 4), ("deepseek_v2", "gptq", GROUP, 32), ("deepseek_v3", "weight_only_int8", None, 8)],
)
def test_quantized_deepseek_keeps_its_layers_quantized(
    tiny_model_dir, tmp_path, monkeypatch, family, method, group, expert_format
):
    """DeepSeek's latent attention projections, dense and shared-expert MLPs stay quantized and
    its routed experts go into the CPU's tiles; ``kv_b_proj``, whose per-head halves attention
    multiplies by directly, is widened. Query rows (reordered for the rotary, cut per rank) are
    reordered alike in every quantized tensor. GPTQ act-order experts are widened (fp32 tiles)."""
    from kiln.interfaces.quantization import QuantLinear

    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")
    llm = assert_serves_dequantized(tiny_model_dir(family), tmp_path, method, group, PROMPTS)
    model = llm.engine.executor.runner.model
    attention = model.layers[1].self_attn
    projections = ("q_a_proj", "q_b_proj") if family == "deepseek_v3" else ("q_proj",)
    for name in (*projections, "kv_a_proj_with_mqa", "o_proj"):
        assert isinstance(getattr(attention, name), QuantLinear), name
    assert attention.w_uk.dtype == torch.float32
    moe = model.layers[1].mlp
    assert isinstance(moe.shared_experts.down_proj, QuantLinear) and isinstance(
        model.layers[0].mlp.down_proj, QuantLinear
    )
    assert {w.fmt for w in moe.w13.experts + moe.w2.experts} == {expert_format}


@pytest.mark.parametrize("method", ["awq", "weight_only_int8"])
def test_a_model_without_quantized_layers_widens_its_checkpoint(tiny_model_dir, tmp_path, monkeypatch, caplog, method):
    """``--model-impl transformers`` (OPT) has no quantized layers: a quantized checkpoint's layers
    are widened as they are read, and serve what transformers serves from the dequantized weights."""
    from kiln.interfaces.quantization import QuantLinear

    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")
    with caplog.at_level("INFO", logger="kiln"):
        llm = assert_serves_dequantized(
            tiny_model_dir("opt"), tmp_path, method, GROUP, PROMPTS, model_impl="transformers"
        )
    assert "has no quantized layers: the" in caplog.text
    assert not any(isinstance(m, QuantLinear) for m in llm.engine.executor.runner.model.modules())


def test_weights_quantized_at_load_need_quantized_layers(tiny_model_dir, caplog):
    """--quantization weight_only_int8 on an unquantized checkpoint: refused for a model without
    quantized layers, and a mixture of experts says its routed experts stay unquantized."""
    from kiln import LLM

    with pytest.raises(ValueError, match="weight_only_int8: TransformersForCausalLM has no quantized layers"):
        LLM(tiny_model_dir("opt"), quantization="weight_only_int8", max_model_len=128, model_impl="transformers")
    with caplog.at_level("WARNING", logger="kiln"):
        LLM(tiny_model_dir("mixtral"), quantization="weight_only_int8", max_model_len=128)
    assert "the routed experts stay in the model's dtype" in caplog.text


def test_experts_partly_left_unquantized_are_widened(tiny_model_dir, tmp_path, monkeypatch):
    """A checkpoint whose experts' down projections were left in floats (a quantizer told to skip
    them): the quantized projections are widened beside them, not handed to the platform's
    experts kernel, which takes whole experts only."""
    from safetensors.torch import save_file

    from kiln.testing.models import assert_generates

    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")
    quantized, dequantized = rounded_copy(tiny_model_dir("mixtral"), tmp_path, "awq", 32)
    file = Path(quantized) / "model.safetensors"
    tensors, floats = load_file(str(file)), load_file(str(Path(dequantized) / "model.safetensors"))
    for name in [n for n in tensors if ".experts." in n and ".w2." in n]:
        del tensors[name]
    tensors |= {n: t for n, t in floats.items() if ".experts." in n and n.endswith(".w2.weight")}
    save_file(tensors, str(file), metadata={"format": "pt"})
    llm = assert_generates(quantized, PROMPTS, hf_greedy(dequantized, PROMPTS, 16))
    moe = next(m for m in llm.engine.executor.runner.model.modules() if hasattr(m, "load_expert"))
    assert not moe.quantized


@pytest.mark.parametrize("scheme", ["awq-groups", "int8-per-channel", "fp8-blocks"])
def test_a_rank_holds_its_slice_of_each_quantized_expert(scheme):
    """Under tensor parallelism (no expert parallelism) each rank holds its slice of every expert's
    codes (or float8 values), for the platform: gate and up by output rows, down by inputs with
    their groups (one scale per row whole). Widened, the slices are the rank's slice of the widened
    weights, which is what the rank stored before; a platform that declines them (the reference
    method) gets exactly those in its stacked weights."""
    from types import SimpleNamespace

    from kiln.distributed import TensorParallel
    from kiln.interfaces.quantization import ReferenceLinearMethod
    from kiln.models.moe import FusedMoE
    from kiln.quantization.checkpoint import widen_parts
    from kiln.quantization.config import QuantConfig, QuantScheme
    from kiln.testing.quantization import random_experts

    quant_scheme, method = {
        "awq-groups": (QuantScheme(4, 32, False), "awq"),
        "int8-per-channel": (QuantScheme(8, None, True), "compressed-tensors"),
        "fp8-blocks": (QuantScheme(8, 32, True, float_weights=True), "fp8"),
    }[scheme]
    parts, w13, w2 = random_experts(quant_scheme, 2, 64, 128, seed=3)
    quant = QuantConfig(method, quant_scheme)
    for rank in (0, 1):
        moe = FusedMoE(64, 2, 2, 128, True, SimpleNamespace(), TensorParallel(rank, 2), quant=quant)
        assert moe.w13.is_meta and moe.w13.shape == (2, 128, 64)  # this rank's gate and up rows, no memory
        for (e, proj), tensors in parts.items():
            for leaf, tensor in tensors.items():
                moe.load_expert(e, proj, leaf, tensor)
        held = moe.quantized
        for e in range(2):
            gate_up = torch.cat([widen_parts(held[e, "gate_proj"]), widen_parts(held[e, "up_proj"])])
            rows = torch.cat([w13[e, :128].chunk(2)[rank], w13[e, 128:].chunk(2)[rank]])
            assert torch.equal(gate_up, rows)
            assert torch.equal(widen_parts(held[e, "down_proj"]), w2[e].chunk(2, dim=1)[rank])
        moe.take_quantized(ReferenceLinearMethod())
        assert torch.equal(moe.w13.data, torch.cat([w13[:, :128].chunk(2, 1)[rank], w13[:, 128:].chunk(2, 1)[rank]], 1))
        assert torch.equal(moe.w2.data, w2.chunk(2, dim=2)[rank])
