"""``kiln convert-eagle`` (seed 001's conversion, same flags): a published EAGLE-1 head made
whole in vLLM 0.6's layout, which Kiln serves with the same drafts as the original."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kiln import LLM, SamplingParams
from kiln.cli import main
from kiln.testing.spec_decode import build_eagle_head, record_proposals

ENGINE = dict(dtype="float32", max_model_len=128, block_size=16)
PROMPTS = [[1000, 7, 9], list(range(100, 119))]


def proposals(target: str, head: str) -> tuple[list, list[list[int]]]:
    """Every step's drafts and the greedy outputs of PROMPTS with ``head`` as the EAGLE head."""
    llm = LLM(target, speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 3}, **ENGINE)
    proposed = record_proposals(llm.engine.executor.draft)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    return proposed, [o.outputs[0].token_ids for o in outputs]


def test_a_converted_head_is_whole_and_drafts_the_same(tiny_model_dir, tmp_path, capsys):
    target = tiny_model_dir("llama")
    head, weights = build_eagle_head(target, tmp_path / "eagle")
    args = ["convert-eagle", "--base-path", target, "--draft-path", head, "--base-weight-name", "model.safetensors"]
    assert main([*args, "--draft-weight-name", "pytorch_model.bin"]) == 0
    out = Path(f"{head}-vllm")
    assert f"written to {out}" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EAGLEModel"] and config["model_type"] == "eagle"
    assert config["model"] == json.loads((Path(head) / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    lm_head = AutoModelForCausalLM.from_pretrained(target).lm_head.weight
    assert torch.equal(tensors.pop("lm_head.weight"), lm_head)
    assert tensors.keys() == {name if name.startswith("fc.") else f"model.{name}" for name in weights}
    assert all(torch.equal(tensors[f"model.{name}"], value) for name, value in weights.items() if "layers" in name)
    assert proposals(target, str(out)) == proposals(target, head)


def test_conversion_errors_say_what_is_wrong(tiny_model_dir, tmp_path, capsys):
    target = tiny_model_dir("llama")
    head, _ = build_eagle_head(target, tmp_path / "eagle")
    base = tmp_path / "base"  # tied embeddings claimed: the LM head is the embeddings, which this file has
    shutil.copytree(target, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert main(["convert-eagle", "--base-path", str(base), "--draft-path", head, "-o", str(tmp_path / "c")]) == 0
    (base / "model.safetensors").rename(base / "weights.safetensors")
    (base / "extra.safetensors").write_bytes((base / "weights.safetensors").read_bytes())
    assert main(["convert-eagle", "--base-path", str(base), "--draft-path", head]) == 2
    assert "holds 2 weight files (extra.safetensors, weights.safetensors); name one" in capsys.readouterr().out
    assert main(["convert-eagle", "--base-path", target, "--draft-path", str(tmp_path / "c")]) == 2
    assert "is converted already" in capsys.readouterr().out
    with pytest.raises(ValueError, match="is an EAGLE-1 head \\(EAGLEModel\\); use method eagle"):
        LLM(target, speculative_config={"method": "eagle3", "model": str(tmp_path / "c"), "num_speculative_tokens": 2})
