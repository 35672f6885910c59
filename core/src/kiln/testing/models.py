"""Tiny random-weight Hugging Face models built on the fly, for fast exact-match tests."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

# Multi-head latent attention (a 32-wide latent, 16 rotary dims) and grouped routing: DeepSeek V2 / V3.
DEEPSEEK = dict(
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
    v_head_dim=24, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
)  # fmt: skip
# Small shapes that still exercise GQA, qkv bias and q/k norm. Head size 64 is what
# real models use (and what fast kernels specialise on); qwen2 keeps 16 so the
# generic code paths run too.
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64),
    # Ministral: Mistral with a window on the layers layer_types marks (Ministral-8B's interleaving)
    "ministral": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # The other dense families: fused checkpoint projections, partial and interleaved rotaries,
    # GeGLU, norms after each sublayer, soft caps, and two kinds of layer with their own rope.
    "phi3": dict(num_attention_heads=4, num_key_value_heads=2),
    "glm": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, pad_token_id=None),
    "glm4": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, pad_token_id=None),
    "gemma": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32),
    "gemma2": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8
    ),
    "gemma3_text": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # Mixtures of experts: 4 experts, 2 per token; Qwen2-MoE with a shared expert and a dense
    # first layer (mlp_only_layers), Qwen3-MoE with q/k norms and unnormalised top-k weights.
    "mixtral": dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
        norm_topk_prob=True,
    ),
    "qwen3_moe": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
    ),
    "deepseek_v2": DEEPSEEK | dict(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5),
    "deepseek_v3": DEEPSEEK | dict(q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True),
    # Architectures Kiln has no class for, served by --model-impl transformers.
    "gpt2": dict(num_attention_heads=4),
    "opt": dict(num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64),
}
TIED = ("qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")  # families whose checkpoints tie the head


def build_tiny_model(
    model_type: str, path: str | os.PathLike, tokenizer_dir: str, *, seed: int = 0, **overrides: object
) -> str:
    """Save a 2-layer, hidden-64 ``model_type`` model with random fp32 weights and the
    tokenizer from ``tokenizer_dir`` into ``path``; returns the folder. ``overrides`` replace
    config entries (e.g. ``sliding_window=8``); those that add no parameters leave the
    weights as they are without them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kiln.testing.encoders import ENCODER_TYPES, build_tiny_encoder

    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    if model_type in ENCODER_TYPES:  # BERT / XLM-RoBERTa, with a WordPiece tokenizer of their own
        return build_tiny_encoder(model_type, path, tokenizer_dir, seed=seed, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    base = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        # Wide weights give peaked logits, so greedy ties cannot flip on rounding.
        initializer_range=0.2,
        tie_word_embeddings=model_type in TIED,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = AutoConfig.for_model(model_type, **{**base, **TINY_CONFIGS[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


FAMILY_TOKENS = 16  # new tokens per prompt in the model-family checks
# Engine settings under which every model family must match transformers: the defaults, a
# 16-token step budget (chunked prefill), and 12 usable blocks of 16 tokens for 5 prompts of up
# to 77 + 16 tokens (forced preemption).
FAMILY_VARIANTS: dict[str, dict] = {
    "default": {},
    "chunked-prefill-tiny-budget": dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    "forced-preemption": dict(block_size=16, num_gpu_blocks_override=13, max_model_len=160),
}


def assert_generates(path: str, prompts: list[list[int]], expected: list[list[int]], **engine_args: object):
    """Kiln's greedy tokens for ``prompts`` (``FAMILY_TOKENS`` each, fp32) equal ``expected``, and
    again on the same engine, where the prompts' full blocks come from the prefix cache; returns
    the ``LLM``."""
    from kiln import LLM, SamplingParams

    llm = LLM(path, **{"max_model_len": 256, "dtype": "float32", **engine_args})
    params = SamplingParams(max_tokens=FAMILY_TOKENS, min_tokens=FAMILY_TOKENS, temperature=0)
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    return llm


def hf_greedy(
    model_dir: str, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = False
) -> list[list[int]]:
    """Reference: Hugging Face ``generate`` greedy, one prompt at a time, fp32.

    Unless ``stop_at_eos``, EOS is suppressed so every output is ``max_new_tokens`` long."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.models.loader import transformers_model

    model = transformers_model(AutoModelForCausalLM, model_dir, dtype=torch.float32).eval()
    return greedy_with(model, prompts, max_new_tokens, stop_at_eos)


def greedy_with(model, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = False) -> list[list[int]]:
    """``hf_greedy`` on a transformers model already built (e.g. with a PEFT adapter merged)."""
    import torch

    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=0 if stop_at_eos else max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def hf_beam_search(
    model_dir: str,
    prompt: list[int],
    num_beams: int,
    max_new_tokens: int,
    *,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    eos_token_ids: list[int],
) -> list[tuple[list[int], float]]:
    """Reference: Hugging Face beam search (no sampling), fp32: the ``num_beams`` hypotheses
    as (generated tokens up to and including the first EOS, score), best first."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.models.loader import transformers_model

    model = transformers_model(AutoModelForCausalLM, model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            num_beams=num_beams,
            num_return_sequences=num_beams,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=eos_token_ids,
            pad_token_id=eos_token_ids[0],  # pads after the EOS, cut below
            return_dict_in_generate=True,
            output_scores=True,
        )
    hypotheses = []
    for seq, score in zip(out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist()):
        end = next((i + 1 for i, t in enumerate(seq) if t in eos_token_ids), len(seq))
        hypotheses.append((seq[:end], score))
    return hypotheses


def requantized_gguf(src: str, dst: str, quant_type: str, overrides: dict[str, str] | None = None) -> str:
    """A copy of the GGUF file ``src`` whose Q4_1 / Q8_0 tensors are re-quantized to
    ``quant_type`` (a ``gguf.GGMLQuantizationType`` name that gguf-py can quantize: Q4_0,
    Q5_0, Q5_1..., or a K-quant of ``kiln.testing.kquants``, which takes only rows of whole
    super-blocks: other tensors stay), or to ``overrides[suffix]`` for tensors whose names end
    in a suffix there (a mix of types, as llama.cpp's Q4_K_M); the metadata and every other
    tensor as they were; returns ``dst``."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, dequantize, quantize

    from kiln.models.gguf_reader import FastGGUFReader
    from kiln.testing.kquants import KQUANTS, QK_K, quantize_kquant

    reader = FastGGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        writer.add_key_value(
            field.name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None
        )
    for tensor in reader.tensors:
        data, kind = tensor.data, tensor.tensor_type
        if kind in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
            chosen = [t for suffix, t in (overrides or {}).items() if tensor.name.endswith(suffix)]
            target = GGMLQuantizationType[chosen[0] if chosen else quant_type]
            values = dequantize(data, kind)
            if target not in KQUANTS:
                data, kind = quantize(values, target), target
            elif values.shape[-1] % QK_K == 0:
                data, kind = quantize_kquant(values, target), target
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def llama_cpp_source() -> Path | None:
    """llama.cpp's source tree (its converter, its vocabularies and their test texts) where
    ``../shared/peers/llama_server.sh setup`` left it under ``$PEERS`` (``~/.cache/kiln-peers``)."""
    import glob

    peers = Path(os.environ.get("PEERS") or Path.home() / ".cache" / "kiln-peers")
    found = sorted(glob.glob(str(peers / "dl" / "llama_cpp_python-*" / "vendor" / "llama.cpp")))
    return Path(found[-1]) if found else None


def _deepseek2_fields(writer, cfg: dict, split_kv_b: bool) -> None:
    """A DeepSeek-V2/V3 config as llama.cpp's converter writes it: latent attention as one
    key/value head of the latent's lengths (the per-head ones apart), the routing settings."""
    from gguf import ExpertGatingFuncType, RopeScalingType

    rope, latent = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    writer.add_head_count_kv(1)
    if split_kv_b:
        writer.add_key_length(latent + rope)
        writer.add_value_length(latent)
        writer.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
        writer.add_value_length_mla(cfg["v_head_dim"])
    else:
        writer.add_key_length(cfg["qk_nope_head_dim"] + rope)
        writer.add_value_length(cfg["v_head_dim"])
    writer.add_rope_dimension_count(rope)
    writer.add_kv_lora_rank(latent)
    if cfg.get("q_lora_rank"):
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_expert_group_count(cfg["n_group"])
    writer.add_expert_group_used_count(cfg["topk_group"])
    if cfg["model_type"] == "deepseek_v3":  # its released configs say scoring_func "sigmoid"
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    rope_parameters = cfg["rope_parameters"]
    if rope_parameters.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope_parameters["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope_parameters["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope_parameters["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope_parameters["mscale_all_dim"])


@functools.cache
def _default_tokenizer_fields() -> list[tuple[str, object, list]]:
    """The default model GGUF's ``tokenizer.*`` fields as (name, value, types): read once per
    process (its 49k tokens and merges)."""
    from kiln.models.gguf_reader import FastGGUFReader
    from kiln.models.loader import default_model_path

    fields = FastGGUFReader(default_model_path()).fields.values()
    return [(f.name, f.contents(), list(f.types)) for f in fields if f.name.startswith("tokenizer.")]


def hf_as_gguf(
    src: str,
    dst: str,
    arch: str,
    quant_type: str = "F32",
    *,
    stacked_experts: bool = True,
    split_kv_b: bool = True,
    reference: str | None = None,
    split_max_tensors: int = 0,
) -> str:
    """The Hugging Face model in ``src`` (a ``build_tiny_model`` folder) as a GGUF file of
    llama.cpp's ``arch`` (``llama``, with experts for Mixtral; ``qwen2moe``; ``qwen3moe``;
    ``deepseek2`` for DeepSeek-V2/V3), laid out as llama.cpp's converter lays it out: its tensor
    names, the ``llama`` architecture's query and key rows in GGUF's rotary order, each layer's
    experts stacked in one tensor per projection (or, ``stacked_experts=False``, one tensor per
    expert, as older Mixtral files have them), DeepSeek's latent attention as one key/value head
    with its ``kv_b_proj`` split per head into transposed key rows and value rows (or,
    ``split_kv_b=False``, whole, with the per-head lengths, as older files have them), and the
    tokenizer of the default model's GGUF. Matrices whose rows are whole blocks of 32 are
    quantized to ``quant_type``; the rest, and the routers, stay F32. ``reference``: also write there ``src``'s
    checkpoint holding exactly the values the GGUF holds. ``split_max_tensors``: split the model
    into files of at most that many tensors, named as llama.cpp names them (``dst`` less
    ``.gguf``, then ``-00001-of-0000N.gguf`` and on). Returns the (first) file's path."""
    import json
    import shutil

    import numpy as np
    import torch
    from gguf import (
        MODEL_ARCH_NAMES,
        GGMLQuantizationType,
        GGUFValueType,
        GGUFWriter,
        dequantize,
        get_tensor_name_map,
        quantize,
    )
    from safetensors.torch import load_file, save_file

    cfg = json.loads((Path(src) / "config.json").read_text())
    weights = load_file(str(Path(src) / "model.safetensors"))
    layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    kind = GGMLQuantizationType[quant_type]

    writer = GGUFWriter(dst, arch, split_max_tensors=split_max_tensors)
    for name, value, types in _default_tokenizer_fields():
        writer.add_key_value(name, value, types[0], sub_type=types[-1] if types[0] == GGUFValueType.ARRAY else None)
    writer.add_block_count(layers)
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg["rope_theta"]}
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch == "deepseek2":
        _deepseek2_fields(writer, cfg, split_kv_b)
    else:
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])

    def rotary_order(w: torch.Tensor, n_head: int) -> torch.Tensor:  # llama.cpp's rows of q and k
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    def add(name: str, values: torch.Tensor) -> torch.Tensor:
        """Write one tensor; returns the values it holds."""
        array = values.float().numpy()
        router = name.endswith("ffn_gate_inp.weight")  # llama.cpp's quantize keeps routers F32
        if values.dim() >= 2 and values.shape[-1] % 32 == 0 and kind != GGMLQuantizationType.F32 and not router:
            data = quantize(array, kind)
            writer.add_tensor(name, data, raw_dtype=kind)
            return torch.from_numpy(np.ascontiguousarray(dequantize(data, kind))).reshape(values.shape)
        writer.add_tensor(name, np.ascontiguousarray(array))
        return values

    names = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), layers)
    expert_tensor = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
    projections = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    held, stacks = {}, {}
    for hf_name, tensor in weights.items():
        if (layer := re.match(r"model\.layers\.(\d+)\.", hf_name)) and int(layer[1]) >= layers:
            continue  # a multi-token-prediction layer past the last (DeepSeek-V3's): llama.cpp skips it
        if m := expert_tensor.fullmatch(hf_name):
            stacks.setdefault((int(m[1]), projections[m[3]]), {})[int(m[2])] = hf_name
            continue
        base, _, suffix = hf_name.rpartition(".")
        if arch == "deepseek2" and base.endswith("kv_b_proj") and split_kv_b:
            layer = hf_name.split(".")[2]
            nope = cfg["qk_nope_head_dim"]
            per_head = tensor.reshape(heads, nope + cfg["v_head_dim"], -1)
            keys = add(f"blk.{layer}.attn_k_b.weight", per_head[:, :nope].transpose(1, 2).contiguous())
            values = add(f"blk.{layer}.attn_v_b.weight", per_head[:, nope:].contiguous())
            held[hf_name] = torch.cat([keys.transpose(1, 2), values], dim=1).reshape(tensor.shape)
            continue
        if suffix == "e_score_correction_bias":  # DeepSeek-V3's routing bias
            held[hf_name] = add(f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias", tensor)
            continue
        rows = torch.arange(tensor.shape[0])
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            rows = rotary_order(rows, heads if base.endswith("q_proj") else kv_heads)
        values = tensor[rows]
        stored = add(f"{names.get_name(base)}.{suffix}", values)
        held[hf_name] = stored.reshape(tensor.shape)[rows.argsort()]  # back in transformers' row order
    for (layer, proj), per_expert in sorted(stacks.items()):
        ordered = [per_expert[e] for e in range(experts)]
        if stacked_experts:
            stored = add(f"blk.{layer}.ffn_{proj}_exps.weight", torch.stack([weights[n] for n in ordered]))
            held.update(zip(ordered, stored))
        else:
            held.update((n, add(f"blk.{layer}.ffn_{proj}.{e}.weight", weights[n])) for e, n in enumerate(ordered))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if reference is not None:
        shutil.copytree(src, reference)
        save_file({n: t.contiguous() for n, t in held.items()}, str(Path(reference) / "model.safetensors"))
    return str(writer.format_shard_names(Path(dst))[0])
