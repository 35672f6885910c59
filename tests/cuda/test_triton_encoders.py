"""BERT / XLM-RoBERTa encoders and cross-encoders with the Triton backend's encoder kernel
(``encoder_attention_kernel``) against Hugging Face transformers on the same weights: on the GPU
where one is present, else on the CPU platform under Triton's interpreter."""

from __future__ import annotations

import sys

import pytest
import torch

import kiln
from kiln.testing.encoders import PROMPTS, TOKEN_TYPES, assert_matches_transformers, encoder_runner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODELS = {
    "bert": ("bert", {}),
    "bert-classifier": ("bert", dict(architectures="BertForSequenceClassification", num_labels=1)),
    "xlm-roberta-classifier": ("xlm-roberta", dict(architectures="XLMRobertaForSequenceClassification", num_labels=1)),
}


@kiln.hookimpl
def register_attention_backends(register) -> None:
    """The Triton backend for the CPU platform too (the plugin registers it for "cuda" only).
    Registered after the plugin, so called first: this one wins."""
    from kiln.registry import AttentionBackendSpec

    register(AttentionBackendSpec("triton", "kiln_cuda.attention:TritonAttentionBackend", ("cuda", "cpu")))


@pytest.fixture
def triton_plugins(kiln_plugins):
    import kiln_cpu.plugin
    import kiln_cuda.plugin

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_cuda.plugin, "cuda"), (sys.modules[__name__], "test")):
        kiln_plugins.register(module, name=name)
    return kiln_plugins


@pytest.mark.parametrize("name", MODELS)
def test_matches_transformers(tiny_model_dir, triton_plugins, name):
    model_type, overrides = MODELS[name]
    path = tiny_model_dir(model_type, **overrides)
    runner = encoder_runner(triton_plugins, path, device=DEVICE, dtype="float32", attention_backend="triton")
    assert runner.backend.name == "triton"
    types = TOKEN_TYPES if model_type == "bert" else None
    assert_matches_transformers(runner, path, PROMPTS, types)
