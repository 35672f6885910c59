"""DeepSeek-V2/V3 from llama.cpp's ``deepseek2`` GGUF files (``kiln.models.gguf_deepseek``), which
transformers' GGUF reading does not take: the config from the metadata (latent attention as one
key/value head, YaRN, routing), ``kv_b_proj`` rebuilt from its per-head key and value halves
(or read whole from older files), V3's routing bias. Kiln then serves exactly the values the
file holds. ``hf_as_gguf`` writes the files as llama.cpp's converter does (``test_hf_as_gguf``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.models.gguf_reader import FastGGUFReader
from kiln.testing.models import hf_as_gguf, hf_greedy

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7]]
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)  # fmt: skip
# V2 as the tiny models have it (groups of experts, a query projection without a low rank); V2-Lite's
# settings (no groups, YaRN as its released config has it); V3 (sigmoid routing with a score bias).
FAMILIES = {
    "v2": ("deepseek_v2", {}),
    "v2-lite": (
        "deepseek_v2",
        dict(n_group=1, topk_group=1, topk_method="greedy", max_position_embeddings=640, rope_parameters=YARN),
    ),  # fmt: skip
    "v3": ("deepseek_v3", {}),
}


def _source(tiny_model_dir, tmp_path: Path, family: str) -> str:
    model_type, overrides = FAMILIES[family]
    folder = tiny_model_dir(model_type, **overrides)
    if model_type != "deepseek_v3":
        return folder
    # A routing bias that moves experts' choice (the random model's is zero).
    copy = shutil.copytree(folder, tmp_path / "source")
    weights = load_file(str(copy / "model.safetensors"))
    for name in [n for n in weights if n.endswith("e_score_correction_bias")]:
        weights[name] = torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(0))
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return str(copy)


@pytest.mark.parametrize(
    ("family", "quant_type", "split_kv_b"),
    [("v2", "Q8_0", True), ("v2", "Q8_0", False), ("v2-lite", "F32", True), ("v3", "Q8_0", True)],
    ids=["v2", "v2-kv_b-whole", "v2-lite-yarn", "v3"],
)
def test_deepseek_gguf_serves_the_values_it_holds(
    tiny_model_dir, tmp_path, monkeypatch, family, quant_type, split_kv_b
):
    from kiln import LLM, SamplingParams

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    reference = str(tmp_path / "reference")
    source = _source(tiny_model_dir, tmp_path, family)
    gguf = hf_as_gguf(source, str(tmp_path / "model.gguf"), "deepseek2", quant_type, split_kv_b=split_kv_b,
                      reference=reference)  # fmt: skip
    llm = LLM(gguf, max_model_len=256, quantization="none", dtype="float32")  # the exact products of the file's values
    model = llm.engine.executor.runner.model
    assert type(model).__name__ == ("DeepseekV3ForCausalLM" if family == "v3" else "DeepseekV2ForCausalLM")
    if family == "v3":
        bias = load_file(str(Path(source) / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert torch.equal(model.layers[1].mlp.e_score_correction_bias, bias)
    # The file's EOS, not the config class's default (V3's is 1), stops generation.
    assert llm.engine.model_info.eos_token_ids == {
        FastGGUFReader(gguf).fields["tokenizer.ggml.eos_token_id"].contents()
    }
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(reference, PROMPTS, 16)


def test_deepseek_gguf_experts_stay_in_their_blocks(tiny_model_dir, tmp_path, monkeypatch):
    from kiln import LLM, SamplingParams

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    gguf = hf_as_gguf(tiny_model_dir("deepseek_v2"), str(tmp_path / "model.gguf"), "deepseek2", "Q8_0")
    llm = LLM(gguf, max_model_len=256)  # GGUF's own path: blocks times int8 activations
    moe = llm.engine.executor.runner.model.layers[1].mlp
    assert {w.fmt for w in moe.w13.experts + moe.w2.experts} == {8} and moe.w13.int8_activations
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=8, min_tokens=8, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 8
