"""BERT / XLM-RoBERTa encoders and cross-encoders on the CPU platform (its backend's encoder
attention, its tiled fp32 matmuls) against Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from kiln.testing.encoders import (
    PROMPTS,
    TOKEN_TYPES,
    assert_matches_transformers,
    encoder_runner,
    hf_encoder_outputs,
    run_encoder_step,
)
from kiln_cpu import native
from kiln_cpu.tiled_weights import TiledLinear

MODELS = {
    "bert": ("bert", {}),
    "bert-classifier": ("bert", dict(architectures="BertForSequenceClassification", num_labels=1)),
    "xlm-roberta": ("xlm-roberta", {}),
    "xlm-roberta-classifier": ("xlm-roberta", dict(architectures="XLMRobertaForSequenceClassification", num_labels=2)),
}


def types_for(model_type: str) -> list[list[int]] | None:
    return TOKEN_TYPES if model_type == "bert" else None


@pytest.mark.parametrize("name", MODELS)
def test_matches_transformers_in_fp32(tiny_model_dir, cpu_plugins, name):
    model_type, overrides = MODELS[name]
    path = tiny_model_dir(model_type, **overrides)
    runner = encoder_runner(cpu_plugins, path, device="cpu", dtype="float32")
    assert runner.backend.name == "cpu"
    if native.load_kernels() is not None:  # the platform's own matmul kernel runs
        assert isinstance(runner.model.encoder[0].qkv_proj, TiledLinear)
    assert_matches_transformers(runner, path, PROMPTS, types_for(model_type))


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_bfloat16_embeddings_point_the_same_way(tiny_model_dir, cpu_plugins, model_type):
    """bf16 (8 mantissa bits) against fp32 Hugging Face: every token's final vector within a
    cosine of 0.999 of the reference."""
    path = tiny_model_dir(model_type)
    runner = encoder_runner(cpu_plugins, path, device="cpu", dtype="bfloat16")
    hidden = run_encoder_step(runner, PROMPTS, types_for(model_type))
    assert hidden.dtype == torch.bfloat16
    expected = torch.cat([h for h, _ in hf_encoder_outputs(path, PROMPTS, types_for(model_type))])
    cosine = torch.nn.functional.cosine_similarity(hidden.float(), expected, dim=-1)
    assert len(cosine) == sum(map(len, PROMPTS)) and float(cosine.min()) > 0.999, cosine.min()
