"""InternLM2 / InternLM2.5 (``InternLM2ForCausalLM``, remote code: ``--trust-remote-code``): the
Llama network under other checkpoint names, with q/k/v fused per key/value group (each group's
query heads, then its key head, then its value head)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kiln.models.llama import LlamaForCausalLM, head_dim_of

RENAMES = {
    "model.tok_embeddings.": "model.embed_tokens.",
    ".attention.wo.": ".self_attn.o_proj.",
    ".feed_forward.w1.": ".mlp.gate_proj.",
    ".feed_forward.w3.": ".mlp.up_proj.",
    ".feed_forward.w2.": ".mlp.down_proj.",
    ".attention_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
}


class InternLM2ForCausalLM(LlamaForCausalLM):
    # LoRA adapters name its modules (attention.wqkv, feed_forward.w1...): ``checkpoint_tensors``
    # maps their lora_B rows as it maps the weights (``LlamaForCausalLM.adapter_rows``)

    def __init__(self, cfg, *args, **kwargs) -> None:
        if getattr(cfg, "bias", False):
            raise ValueError("InternLM2 with biases (config 'bias': true) is not supported")
        super().__init__(cfg, *args, **kwargs)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        cfg = self.config
        head_dim, kv_heads = head_dim_of(cfg), cfg.num_key_value_heads
        group = cfg.num_attention_heads // kv_heads
        for name, tensor in weights:
            if name == "output.weight":
                yield "lm_head.weight", tensor
            elif ".attention.wqkv." in name:
                block, _, leaf = name.partition(".attention.wqkv.")
                prefix = f"{block}.self_attn."
                if leaf == "g_idx":  # GPTQ act-order: one group per input, shared by q, k and v
                    yield from ((f"{prefix}{proj}.g_idx", tensor) for proj in ("q_proj", "k_proj", "v_proj"))
                    continue
                # rows (kv_heads, group + 2, head_dim): each group's query heads, its key, its value
                # (a weight's, or a quantized layer's scales and zero points)
                grouped = tensor.view(kv_heads, group + 2, head_dim, *tensor.shape[1:])
                q, k, v = grouped.split([group, 1, 1], dim=1)
                for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    yield f"{prefix}{proj}.{leaf}", part.reshape(-1, *tensor.shape[1:])
            else:
                for old, new in RENAMES.items():
                    name = name.replace(old, new)
                yield name, tensor
