"""Quantized checkpoints of the families that fuse projections in their checkpoints (Phi-3's
qkv_proj and gate_up_proj, GLM-4's gate_up_proj, with its query/key rows reordered for an
interleaved rotary) or put other norms around them (Gemma, Gemma 2 and 3): every decoder projection
rounded here to AutoAWQ's and AutoGPTQ's act-order layouts, and served by Kiln exactly as
transformers serves the dequantized weights."""

from __future__ import annotations

import pytest

from kiln.testing.models import FAMILY_TOKENS, assert_generates, hf_greedy
from kiln.testing.quantization import rounded_copy

GROUP = 32
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7]]


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("family", ["phi3", "glm4", "gemma", "gemma2", "gemma3_text"])
def test_quantized_family_serves_its_dequantized_weights(tiny_model_dir, tmp_path, monkeypatch, family, method):
    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")  # the exact products of the dequantized weights
    source = tiny_model_dir(family)
    quantized, dequantized = rounded_copy(source, tmp_path, method, GROUP)
    expected = hf_greedy(dequantized, PROMPTS, FAMILY_TOKENS)
    assert expected != hf_greedy(source, PROMPTS, FAMILY_TOKENS)  # the rounding moved the outputs
    assert_generates(quantized, PROMPTS, expected)
