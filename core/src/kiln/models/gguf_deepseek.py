"""llama.cpp's ``deepseek2`` GGUF files (DeepSeek-V2, V2-Lite, V3, R1), which transformers' GGUF
reading does not take: the Hugging Face config their metadata describes, and the tensors that
llama.cpp's converter lays out other than transformers' names map them.

- Latent attention: llama.cpp stores it as one key/value head (``head_count_kv`` 1, key and value
  lengths of the compressed latent); the Hugging Face config keeps a head count per query head
  and the per-head sizes, which newer files give as ``key_length_mla`` / ``value_length_mla``
  and older ones as the key and value lengths themselves.
- ``kv_b_proj``: newer converters split each head's rows into ``attn_k_b`` (keys, transposed)
  and ``attn_v_b``; older files keep ``attn_kv_b`` whole, which transformers' map names.
- Routing: V3's score bias is ``exp_probs_b.bias``; the gating function (sigmoid for V3) is in
  the metadata, or, in files of V2 written before it was, softmax.
- YaRN: the file keeps 0.1 * ``mscale_all_dim`` as ``yarn_log_multiplier``; DeepSeek's released
  configs have ``mscale`` equal to it, which is taken.
"""

from __future__ import annotations

import logging
import re

import numpy as np

from kiln.models.gguf_fields import field as gguf_field

logger = logging.getLogger("kiln.loader")

ARCH = "deepseek2"
SIGMOID = 2  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
K_B = re.compile(r"blk\.(?P<layer>\d+)\.attn_k_b\.weight")
SCORE_BIAS = re.compile(r"blk\.(?P<layer>\d+)\.exp_probs_b\.bias")


def deepseek_config(reader):
    """The ``DeepseekV2Config`` (or V3, for sigmoid routing with a score bias) of a ``deepseek2``
    file's metadata."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    def field(key: str, default=None, prefix: str = ARCH):
        return gguf_field(reader, f"{prefix}.{key}", default)

    def required(key: str):
        if (value := field(key)) is None:
            raise ValueError(f"model: the GGUF file has no {ARCH}.{key}")
        return value

    rope = required("rope.dimension_count")
    latent = field("attention.kv_lora_rank")
    if field("attention.key_length_mla") is not None:
        nope, v_dim = field("attention.key_length_mla") - rope, field("attention.value_length_mla")
    else:  # written before the latent lengths were split out: the per-head lengths themselves
        nope, v_dim = required("attention.key_length") - rope, required("attention.value_length")
    names = {t.name for t in reader.tensors}
    v3 = field("expert_gating_func") == SIGMOID or any(SCORE_BIAS.fullmatch(n) for n in names)
    layers, heads = required("block_count"), required("attention.head_count")
    groups = field("expert_group_count", 1)
    rope_parameters = {"rope_type": "default", "rope_theta": field("rope.freq_base", 10000.0)}
    if field("rope.scaling.type") == "yarn":
        rope_parameters |= {
            "rope_type": "yarn", "factor": required("rope.scaling.factor"),
            "original_max_position_embeddings": required("rope.scaling.original_context_length"),
            "beta_fast": field("rope.scaling.yarn_beta_fast", 32.0), "beta_slow": field("rope.scaling.yarn_beta_slow", 1.0),
        }  # fmt: skip
        if (log_multiplier := field("rope.scaling.yarn_log_multiplier")) is not None:
            rope_parameters["mscale"] = rope_parameters["mscale_all_dim"] = log_multiplier / 0.1
    if not v3 and field("expert_weights_norm"):
        logger.warning("the GGUF file asks for renormalised softmax routing, which DeepSeek-V2 (as transformers "
                       "runs it) does not do: served without")  # fmt: skip
    settings = dict(
        vocab_size=field("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=required("embedding_length"),
        intermediate_size=required("feed_forward_length"),
        moe_intermediate_size=field("expert_feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=field("context_length", 4096),
        rms_norm_eps=field("attention.layer_norm_rms_epsilon", 1e-6),
        q_lora_rank=field("attention.q_lora_rank"),
        kv_lora_rank=latent,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        v_head_dim=v_dim,
        head_dim=rope,
        n_routed_experts=field("expert_count"),
        n_shared_experts=field("expert_shared_count"),
        num_experts_per_tok=field("expert_used_count"),
        first_k_dense_replace=field("leading_dense_block_count", 0),
        routed_scaling_factor=field("expert_weights_scale", 1.0),
        norm_topk_prob=bool(field("expert_weights_norm", False)),
        n_group=groups,
        topk_group=field("expert_group_used_count", 1),
        rope_parameters=rope_parameters,
        tie_word_embeddings="output.weight" not in names,
        # The configs' own defaults are other models' ids (V2's EOS 2 is "#" in its vocabulary).
        bos_token_id=field("bos_token_id", prefix="tokenizer.ggml"),
        eos_token_id=field("eos_token_id", prefix="tokenizer.ggml"),
        pad_token_id=field("padding_token_id", prefix="tokenizer.ggml"),
    )
    if v3:
        return DeepseekV3Config(**settings, rope_interleave=True)
    return DeepseekV2Config(**settings, topk_method="group_limited_greedy" if groups > 1 else "greedy")


def deepseek_parts(reader) -> list[tuple[str, list[int], dict]]:
    """(Hugging Face name, shape, source) of the tensors transformers' map does not name:
    ``kv_b_proj`` rebuilt from a layer's ``attn_k_b`` and ``attn_v_b`` (source ``{"kv_b": [k_b,
    v_b], "heads", "latent"}``, read by ``kv_b_values``), and V3's routing score bias (``{"tensor": name}``)."""
    tensors = {t.name: t for t in reader.tensors}
    parts = []
    for name, t in tensors.items():
        if (m := K_B.fullmatch(name)) and f"blk.{m['layer']}.attn_kv_b.weight" not in tensors:  # else read whole
            v_b = tensors.get(f"blk.{m['layer']}.attn_v_b.weight")
            if v_b is None:
                raise ValueError(f"model: the GGUF file has {name} but no blk.{m['layer']}.attn_v_b.weight")
            heads, latent, nope = (int(d) for d in reversed(t.shape.tolist()))  # (heads, latent, nope)
            v_dim = int(v_b.shape[1])  # (heads, v_dim, latent)
            parts.append(
                (f"model.layers.{m['layer']}.self_attn.kv_b_proj.weight", [heads * (nope + v_dim), latent],
                 {"kv_b": [name, v_b.name], "heads": heads, "latent": latent})
            )  # fmt: skip
        elif m := SCORE_BIAS.fullmatch(name):
            parts.append((f"model.layers.{m['layer']}.mlp.gate.e_score_correction_bias", [int(t.shape[0])],
                          {"tensor": name}))  # fmt: skip
    return parts


def kv_b_values(k_b: np.ndarray, v_b: np.ndarray, heads: int, latent: int) -> np.ndarray:
    """``kv_b_proj`` from the values of its key half ``k_b`` (heads, latent, nope) and value half
    ``v_b`` (heads, v_dim, latent): each head's key rows, then its value rows."""
    keys = k_b.reshape(heads, latent, -1).transpose(0, 2, 1)
    return np.concatenate([keys, v_b.reshape(heads, -1, latent)], axis=1).reshape(-1, latent)
