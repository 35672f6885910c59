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
from kiln.cli import main
from kiln.lora.request import LoRARequest
from kiln.testing.lora import build_lora_adapter, hf_lora_greedy
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


def fuse_wqkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int, dim: int) -> torch.Tensor:
    """q/k/v rows (a weight's, or a quantized layer's scales) as InternLM2's wqkv rows: per key/value
    group, its query heads, then its key head, then its value head."""
    rest = q.shape[1:]
    group = q.shape[0] // (kv_heads * dim)
    grouped = [q.view(kv_heads, group, dim, *rest), k.view(kv_heads, 1, dim, *rest), v.view(kv_heads, 1, dim, *rest)]
    return torch.cat(grouped, dim=1).reshape(-1, *rest)


def as_internlm2(llama_dir: str, out: Path) -> str:
    """The Llama checkpoint in InternLM2's layout, with its tokenizer and a remote-code config."""
    llama = json.loads(Path(llama_dir, "config.json").read_text())
    heads, kv_heads = llama["num_attention_heads"], llama["num_key_value_heads"]
    dim = llama["hidden_size"] // heads
    tensors, state = {}, load_file(str(Path(llama_dir, "model.safetensors")))
    for name, t in state.items():
        if ".self_attn.q_proj." in name:  # a weight, or an int8 checkpoint's weight_scale: rows regrouped
            prefix, _, leaf = name.partition("self_attn.q_proj.")
            q, k, v = (state[f"{prefix}self_attn.{p}_proj.{leaf}"] for p in "qkv")
            tensors[f"{prefix}attention.wqkv.{leaf}"] = fuse_wqkv(q, k, v, kv_heads, dim).contiguous()
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
    if "quantization_config" in llama:
        config["quantization_config"] = llama["quantization_config"]
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


def test_quantized_internlm2_serves_the_quantized_llama(internlm2, tmp_path, varied_prompts):
    """A W8A8 checkpoint of the Llama (int8 weights, a scale per row) in InternLM2's layout: the
    scales regrouped with their rows into the fused wqkv, and split back with them at load."""
    llama = str(tmp_path / "llama-w8a8")
    assert main(["quantize", "-i", internlm2[0], "-o", llama, "-quant_type", "smooth_quant", "-t", "fp32",
                 "--num-calibration-samples", "4", "--seq-len", "32"]) == 0  # fmt: skip
    path = as_internlm2(llama, tmp_path / "internlm2-w8a8")
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    prompts = [{"prompt_token_ids": p} for p in varied_prompts]
    expected = [o.outputs[0].token_ids for o in LLM(llama, dtype="float32").generate(prompts, params)]
    got = LLM(path, trust_remote_code=True, dtype="float32").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert expected != hf_greedy(internlm2[0], varied_prompts, 16)  # quantized: not the fp32 model's tokens


def test_quantized_wqkv_leaves_map_to_q_k_v():
    """Every canonical leaf of a quantized wqkv (codes, scales and zero points by rows in the
    grouped order; GPTQ's g_idx, one per input) maps to the q/k/v leaves it fuses."""
    from types import SimpleNamespace

    from kiln.models.internlm2 import InternLM2ForCausalLM

    cfg = SimpleNamespace(num_attention_heads=6, num_key_value_heads=2, hidden_size=48, head_dim=8)
    gen = torch.Generator().manual_seed(0)
    rows = {"q_proj": 48, "k_proj": 16, "v_proj": 16}
    leaves = {  # leaf -> trailing shape of each row
        "weight": (48,), "weight_scale": (3,), "weight_zero": (3,),
    }  # fmt: skip
    parts = {p: {leaf: torch.randint(0, 16, (n, *shape), generator=gen) for leaf, shape in leaves.items()}
             for p, n in rows.items()}  # fmt: skip
    g_idx = torch.randperm(48, generator=gen) % 3
    fused = {}
    for leaf in leaves:
        fused[f"model.layers.0.attention.wqkv.{leaf}"] = fuse_wqkv(*(parts[p][leaf] for p in rows), kv_heads=2, dim=8)
    fused["model.layers.0.attention.wqkv.g_idx"] = g_idx
    mapped = dict(InternLM2ForCausalLM.checkpoint_tensors(SimpleNamespace(config=cfg), fused.items()))
    for proj in rows:
        for leaf in leaves:
            assert torch.equal(mapped[f"model.layers.0.self_attn.{proj}.{leaf}"], parts[proj][leaf])
        assert torch.equal(mapped[f"model.layers.0.self_attn.{proj}.g_idx"], g_idx)
    assert len(mapped) == 12


def test_internlm2_needs_trust_remote_code(internlm2):
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(internlm2[1], dtype="float32")


ADAPTER_NAMES = {"self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1",
                 "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2"}  # fmt: skip


def as_internlm2_adapter(llama_adapter: str, llama_dir: str, out: Path) -> str:
    """A PEFT adapter of the Llama, as an adapter of its InternLM2 form: o/gate/up/down renamed,
    and q/k/v as one update of the fused wqkv of rank 3r (A stacks their As; B is block-diagonal,
    its rows grouped as wqkv's), which ``rank_pattern`` / ``alpha_pattern`` scale as before."""
    llama = json.loads(Path(llama_dir, "config.json").read_text())
    heads, kv_heads = llama["num_attention_heads"], llama["num_key_value_heads"]
    dim = llama["hidden_size"] // heads
    config = json.loads(Path(llama_adapter, "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    state, tensors = load_file(str(Path(llama_adapter, "adapter_model.safetensors"))), {}
    for name, t in state.items():
        if ".self_attn.q_proj.lora_A." in name:
            prefix = name.removesuffix("self_attn.q_proj.lora_A.weight")
            a = [state[f"{prefix}self_attn.{p}_proj.lora_A.weight"] for p in "qkv"]
            b = [state[f"{prefix}self_attn.{p}_proj.lora_B.weight"] for p in "qkv"]
            fused = torch.zeros(kv_heads, heads // kv_heads + 2, dim, 3 * rank)
            fused[:, :-2, :, :rank] = b[0].view(kv_heads, heads // kv_heads, dim, rank)
            fused[:, -2, :, rank : 2 * rank] = b[1].view(kv_heads, dim, rank)
            fused[:, -1, :, 2 * rank :] = b[2].view(kv_heads, dim, rank)
            tensors[f"{prefix}attention.wqkv.lora_A.weight"] = torch.cat(a)
            tensors[f"{prefix}attention.wqkv.lora_B.weight"] = fused.reshape(-1, 3 * rank)
        elif not any(f".self_attn.{p}_proj." in name for p in "qkv"):
            for old, new in ADAPTER_NAMES.items():
                name = name.replace(f".{old}.", f".{new}.")
            tensors[name] = t
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config |= {"target_modules": ["wqkv", "wo", "w1", "w3", "w2"], "rank_pattern": {"wqkv": 3 * rank},
               "alpha_pattern": {"wqkv": 3 * alpha}}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return str(out)


def test_internlm2_adapters_match_the_llamas_under_peft(internlm2, tmp_path, varied_prompts):
    """An adapter of the fused, group-interleaved wqkv: Kiln splits its lora_B rows as it splits
    wqkv, and serves what transformers gives with PEFT's merged weights on the Llama."""
    llama, path = internlm2
    adapter = build_lora_adapter(llama, tmp_path / "llama-adapter", rank=4, seed=7)
    expected = hf_lora_greedy(llama, adapter, varied_prompts, 16)
    assert expected != hf_greedy(llama, varied_prompts, 16)
    converted = as_internlm2_adapter(adapter, llama, tmp_path / "internlm2-adapter")
    llm = LLM(path, trust_remote_code=True, dtype="float32", enable_lora=True, max_lora_rank=16, max_model_len=256)
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in varied_prompts], params,
                           lora_request=LoRARequest("a", 1, converted))  # fmt: skip
    assert [o.outputs[0].token_ids for o in outputs] == expected
