"""Quantized checkpoints of the families that fuse projections in their checkpoints (Phi-3's
qkv_proj and gate_up_proj, GLM-4's gate_up_proj, with its query/key rows reordered for an
interleaved rotary) or put other norms around them (Gemma, Gemma 2 and 3): every decoder projection
rounded here to AutoAWQ's and AutoGPTQ's act-order layouts, and served by Kiln exactly as
transformers serves the dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kiln.quantization import rtn
from kiln.quantization.checkpoint import checkpoint_tensors
from kiln.quantization.config import from_hf
from kiln.quantization.tool import hf_quantization_config
from kiln.testing.models import FAMILY_TOKENS, assert_generates, hf_greedy
from kiln.testing.quantization import dequantized_copy, gptq_act_order

GROUP = 32
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7]]


def rounded_checkpoint(source: str, out: Path, method: str) -> str:
    """``source`` with each decoder projection rounded to nearest, written as ``method`` (awq or
    gptq act-order) checkpoints are."""
    from transformers import AutoModelForCausalLM

    qc = hf_quantization_config(method, GROUP, act_order=method == "gptq")
    quant = from_hf(qc)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tensors = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if ".layers." in module and leaf == "weight" and isinstance(model.get_submodule(module), torch.nn.Linear):
            w = tensor.float()
            parts = (*rtn.int4_asymmetric(w, GROUP), None) if method == "awq" else gptq_act_order(w, GROUP)
            tensors |= {f"{module}.{k}": v for k, v in checkpoint_tensors(quant, *parts, torch.float16).items()}
        elif not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            tensors[name] = tensor
    shutil.copytree(source, out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return str(out)


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("family", ["phi3", "glm4", "gemma", "gemma2", "gemma3_text"])
def test_quantized_family_serves_its_dequantized_weights(tiny_model_dir, tmp_path, monkeypatch, family, method):
    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")  # the exact products of the dequantized weights
    source = tiny_model_dir(family)
    quantized = rounded_checkpoint(source, tmp_path / "q", method)
    expected = hf_greedy(dequantized_copy(quantized, source, str(tmp_path / "deq")), PROMPTS, FAMILY_TOKENS)
    assert expected != hf_greedy(source, PROMPTS, FAMILY_TOKENS)  # the rounding moved the outputs
    assert_generates(quantized, PROMPTS, expected)
