"""BERT / XLM-RoBERTa encoders and cross-encoders on the Ascend code path (the platform's ops and
the backend's ``forward_encoder``: FIA with no mask) under the CPU emulation of torch_npu, against
Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest
from tests.ascend import fake_torch_npu, test_ascend

from kiln.testing.encoders import PROMPTS, TOKEN_TYPES, assert_matches_transformers, encoder_runner

# test_ascend.py's fixtures: the emulation installed as torch_npu and torchair (autouse), and the
# plugins with the "npu_emulated" platform (the Ascend platform with its device calls on the CPU).
emulated_torch_npu = test_ascend.emulated_torch_npu
npu_plugins = test_ascend.npu_plugins

MODELS = {
    "bert": ("bert", {}),
    "bert-classifier": ("bert", dict(architectures="BertForSequenceClassification", num_labels=1)),
    "xlm-roberta-classifier": ("xlm-roberta", dict(architectures="XLMRobertaForSequenceClassification", num_labels=1)),
}


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("name", MODELS)
def test_matches_transformers(tiny_model_dir, npu_plugins, name, block_size):
    model_type, overrides = MODELS[name]
    path = tiny_model_dir(model_type, **overrides)
    runner = encoder_runner(npu_plugins, path, device="npu_emulated", dtype="float32", block_size=block_size)
    assert runner.backend.name == "ascend" and runner.graphs is None  # encoders never take the graph path
    types = TOKEN_TYPES if model_type == "bert" else None
    assert_matches_transformers(runner, path, PROMPTS, types)
    # One fused attention call per layer for the whole step, no KV-cache write.
    fused = [c for c in fake_torch_npu.calls if c.startswith("npu_fused_infer_attention_score")]
    assert len(fused) == runner.model.config.num_hidden_layers
    assert "_npu_reshape_and_cache" not in fake_torch_npu.calls
