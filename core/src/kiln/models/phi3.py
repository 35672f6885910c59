"""Phi-3 (and Phi-4-mini): the Llama network with q/k/v and gate/up fused in the checkpoint,
LongRoPE (``kiln.models.rope``), an optional partial rotary and a sliding window on every layer."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kiln.models.llama import LlamaForCausalLM, head_dim_of


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        cfg = self.config
        q = cfg.num_attention_heads * head_dim_of(cfg)
        kv = cfg.num_key_value_heads * head_dim_of(cfg)
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith(".qkv_proj"):
                yield from zip(
                    _names(prefix, "qkv_proj", ("q_proj", "k_proj", "v_proj"), leaf),
                    split_rows(leaf, tensor, [q, kv, kv]),
                )
            elif prefix.endswith(".gate_up_proj"):
                yield from split_gate_up(prefix, leaf, tensor)
            else:
                yield name, tensor


def split_gate_up(prefix: str, leaf: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    """A fused ``gate_up_proj`` tensor as the ``gate_proj`` and ``up_proj`` halves it stacks."""
    half = tensor.shape[0] // 2
    return zip(_names(prefix, "gate_up_proj", ("gate_proj", "up_proj"), leaf), split_rows(leaf, tensor, [half, half]))


def split_rows(leaf: str, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """A fused projection's tensor ``leaf`` as its parts' (output rows; a quantized layer's scales
    and zero points too). GPTQ's ``g_idx`` names each input's group, which the parts share."""
    return [tensor] * len(sizes) if leaf == "g_idx" else list(tensor.split(sizes))


def _names(prefix: str, fused: str, parts: tuple[str, ...], leaf: str) -> list[str]:
    base = prefix.removesuffix(fused)
    return [f"{base}{part}.{leaf}" for part in parts]
