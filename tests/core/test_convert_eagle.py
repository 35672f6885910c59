"""``kiln convert-eagle`` (seed 001's conversion, same flags): a published EAGLE-1 head made
whole in vLLM 0.6's layout, which Kiln serves with the same drafts as the original."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
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
    assert config["model"] == json.loads((Path(head) / "config.json").read_text()) and config["eagle_fc_bias"]
    tensors = load_file(out / "model.safetensors")
    lm_head = AutoModelForCausalLM.from_pretrained(target).lm_head.weight
    assert torch.equal(tensors.pop("lm_head.weight"), lm_head)
    renamed = {name if name.startswith("fc.") else f"model.{name}": value for name, value in weights.items()}
    assert tensors.keys() == renamed.keys() and all(torch.equal(tensors[k], v) for k, v in renamed.items())
    assert proposals(target, str(out)) == proposals(target, head)
    # vLLM's way to say fc has no bias: the top level's eagle_fc_bias, over the head's own config.
    (nobias := tmp_path / "nobias").mkdir()
    del tensors["fc.bias"]
    save_file({**tensors, "lm_head.weight": lm_head.detach()}, nobias / "model.safetensors")
    (nobias / "config.json").write_text(json.dumps({**config, "eagle_fc_bias": False}))
    assert proposals(target, str(nobias))[1] == proposals(target, head)[1]
    # Served alone it is refused at once, as any head is.
    with pytest.raises(ValueError, match="model: EAGLEModel is an EAGLE head, which only drafts for its target"):
        LLM(str(out), **ENGINE)


def test_conversion_errors_say_what_is_wrong(tiny_model_dir, tmp_path, capsys):
    target = tiny_model_dir("llama")
    head, _ = build_eagle_head(target, tmp_path / "eagle")
    base = tmp_path / "base"  # tied embeddings: no LM head of its own, its embeddings serve
    shutil.copytree(target, base)
    weights = load_file(base / "model.safetensors")
    embeddings = weights.pop("model.embed_tokens.weight")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"} | {"model.embed_tokens.weight": embeddings},
              base / "model.safetensors")  # fmt: skip
    assert main(["convert-eagle", "--base-path", str(base), "--draft-path", head, "-o", str(tmp_path / "c")]) == 0
    assert torch.equal(load_file(tmp_path / "c" / "model.safetensors")["lm_head.weight"], embeddings)
    capsys.readouterr()

    def error(*args: str) -> str:
        assert main(["convert-eagle", *args]) == 2
        return capsys.readouterr().err

    assert "c exists and is not empty; give a new folder" in error("--base-path", target, "--draft-path", head,
                                                                   "-o", str(tmp_path / "c"))  # fmt: skip
    assert "base exists and is not empty" in error("--base-path", str(base), "--draft-path", head, "-o", str(base))
    assert "is converted already" in error("--base-path", target, "--draft-path", str(tmp_path / "c"))
    assert "--base-path org/model: not a local model folder" in error("--base-path", "org/model", "--draft-path", head)
    save_file({"model.norm.weight": weights["model.norm.weight"]}, base / "model.safetensors")
    assert "hold neither lm_head.weight nor model.embed_tokens.weight" in error(
        "--base-path", str(base), "--draft-path", head, "-o", str(tmp_path / "d")
    )
    with pytest.raises(ValueError, match="is an EAGLE-1 head \\(EAGLEModel\\); use method eagle"):
        LLM(target, speculative_config={"method": "eagle3", "model": str(tmp_path / "c"), "num_speculative_tokens": 2})
