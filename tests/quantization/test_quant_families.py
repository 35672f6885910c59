"""Quantized checkpoints of the families that fuse projections in their checkpoints (Phi-3's
qkv_proj and gate_up_proj, GLM-4's gate_up_proj, with its query/key rows reordered for an
interleaved rotary) or put other norms around them (Gemma, Gemma 2 and 3): every decoder projection
rounded here to AutoAWQ's and AutoGPTQ's act-order layouts, and served by Kiln exactly as
transformers serves the dequantized weights."""

from __future__ import annotations

import pytest

from kiln.testing.quantization import assert_serves_dequantized

GROUP = 32
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7]]


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("family", ["phi3", "glm4", "gemma", "gemma2", "gemma3_text"])
def test_quantized_family_serves_its_dequantized_weights(tiny_model_dir, tmp_path, monkeypatch, family, method):
    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")  # the exact products of the dequantized weights
    assert_serves_dequantized(tiny_model_dir(family), tmp_path, method, GROUP, PROMPTS)
