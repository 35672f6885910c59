"""InternLM2 (remote code): a tiny Llama rewritten in InternLM2's checkpoint layout (fused,
group-interleaved wqkv; its own names) and config class serves the Llama's tokens, which
transformers computes, and needs --trust-remote-code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import LLM, SamplingParams
from kiln.testing.models import hf_greedy

CONFIG_CODE = """
from transformers import PretrainedConfig


class InternLM2Config(PretrainedConfig):
    model_type = "internlm2"

    def __init__(self, vocab_size=103168, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                 rms_norm_eps=1e-6, bias=True, rope_theta=10000, rope_scaling=None, tie_word_embeddings=False,
                 **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.hidden_act, self.max_position_embeddings, self.rms_norm_eps = hidden_act, max_position_embeddings, rms_norm_eps
        self.bias, self.rope_theta, self.rope_scaling = bias, rope_theta, rope_scaling
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
"""
NAMES = {"embed_tokens": "tok_embeddings", "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1",
         "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
         "post_attention_layernorm": "ffn_norm"}  # fmt: skip


def as_internlm2(llama_dir: str, out: Path) -> str:
    """The Llama checkpoint in InternLM2's layout, with its tokenizer and a remote-code config."""
    llama = json.loads(Path(llama_dir, "config.json").read_text())
    heads, kv_heads = llama["num_attention_heads"], llama["num_key_value_heads"]
    dim = llama["hidden_size"] // heads
    tensors, state = {}, load_file(str(Path(llama_dir, "model.safetensors")))
    for name, t in state.items():
        if ".self_attn.q_proj." in name:
            prefix = name.removesuffix("self_attn.q_proj.weight")
            q, k, v = (state[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv")
            groups = [
                q.view(kv_heads, heads // kv_heads, dim, -1),
                k.view(kv_heads, 1, dim, -1),
                v.view(kv_heads, 1, dim, -1),
            ]
            tensors[f"{prefix}attention.wqkv.weight"] = torch.cat(groups, dim=1).reshape(-1, t.shape[-1]).contiguous()
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        elif name == "lm_head.weight":
            tensors["output.weight"] = t
        else:
            for old, new in NAMES.items():
                name = name.replace(old, new)
            tensors[name] = t
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    for f in Path(llama_dir).glob("*token*"):
        shutil.copy(f, out)
    config = {key: llama[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
              "bos_token_id", "eos_token_id")}  # fmt: skip
    config |= {"model_type": "internlm2", "architectures": ["InternLM2ForCausalLM"], "bias": False,
               "rope_theta": 10000.0, "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"}}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    (out / "configuration_internlm2.py").write_text(CONFIG_CODE)
    return str(out)


@pytest.fixture(scope="module")
def internlm2(tiny_model_dir, tmp_path_factory):
    llama = tiny_model_dir("llama", head_dim=16)  # InternLM2's heads are hidden_size / heads wide
    return llama, as_internlm2(llama, tmp_path_factory.mktemp("internlm2") / "model")


def test_internlm2_serves_the_llama_it_was_made_from(internlm2, varied_prompts):
    llama, path = internlm2
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    outputs = LLM(path, trust_remote_code=True, dtype="float32").generate(
        [{"prompt_token_ids": p} for p in varied_prompts], params
    )
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(llama, varied_prompts, 16)


def test_internlm2_needs_trust_remote_code(internlm2):
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(internlm2[1], dtype="float32")
