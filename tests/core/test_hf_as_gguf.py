"""``kiln.testing.models.hf_as_gguf``, which writes the GGUF files the MoE and DeepSeek tests
load, lays them out as llama.cpp's own converter (``convert_hf_to_gguf.py``) does: the same
tensors, byte for byte, and every metadata field the converter writes. Runs where llama.cpp's
source is at hand (``../shared/peers/llama_server.sh setup`` fetches it). hf_as_gguf may write
more fields than the converter does for a tiny config (V3's gating function, which released V3
configs give it; lengths llama.cpp would derive)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from gguf import GGUFReader

from kiln.testing.models import hf_as_gguf, llama_cpp_source

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)  # fmt: skip
# family: (model type, tiny-model overrides, llama.cpp architecture)
FAMILIES = {
    "mixtral": ("mixtral", {}, "llama"),
    "qwen2_moe": ("qwen2_moe", {"mlp_only_layers": [], "norm_topk_prob": False}, "qwen2moe"),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}, "qwen3moe"),
    "deepseek_v2": ("deepseek_v2", {}, "deepseek2"),
    "deepseek_v2-lite": (
        "deepseek_v2",
        dict(n_group=1, topk_group=1, topk_method="greedy", max_position_embeddings=640, rope_parameters=YARN),
        "deepseek2",
    ),  # fmt: skip
    "deepseek_v3": ("deepseek_v3", {}, "deepseek2"),
}


@pytest.mark.skipif(
    llama_cpp_source() is None,
    reason="llama.cpp's source is not at hand: ../shared/peers/llama_server.sh setup fetches it",
)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_as_gguf_writes_what_llama_cpp_converter_writes(tiny_model_dir, tmp_path, family):
    model_type, overrides, arch = FAMILIES[family]
    if arch == "llama" and importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("llama.cpp's converter reads a llama-architecture vocabulary with sentencepiece, not installed")
    source = tiny_model_dir(model_type, **overrides)
    converter = llama_cpp_source() / "convert_hf_to_gguf.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(converter.parent / "gguf-py"), *filter(None, sys.path)])}
    theirs = tmp_path / "theirs.gguf"
    subprocess.run([sys.executable, str(converter), source, "--outfile", str(theirs), "--outtype", "f32"],
                   env=env, check=True, capture_output=True, timeout=300)  # fmt: skip
    ours = hf_as_gguf(source, str(tmp_path / "ours.gguf"), arch)

    def fields(path) -> dict:
        skip = ("GGUF.", "general.", "tokenizer.")
        return {f.name: f.contents() for f in GGUFReader(path).fields.values() if not f.name.startswith(skip)}

    def tensors(path) -> dict:
        return {t.name: (t.shape.tolist(), t.data.tobytes()) for t in GGUFReader(path).tensors}

    our_fields, their_fields = fields(ours), fields(str(theirs))
    assert their_fields.keys() <= our_fields.keys(), "fields the converter writes and hf_as_gguf does not"
    for key, value in their_fields.items():  # floats as float32 holds them
        assert our_fields[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key
    assert tensors(ours) == tensors(str(theirs))
