"""GLM-4 (``GlmForCausalLM``, GLM-4-9B) and GLM-4-0414 (``Glm4ForCausalLM``): the Llama network
with q/k/v biases, gate/up fused in the checkpoint and a rotary over the first half of each
head in adjacent pairs (``kiln.models.rope`` reorders the heads for the platforms' rotary op);
GLM-4-0414 adds a norm after each sublayer."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kiln.models.llama import LlamaForCausalLM, SandwichDecoderLayer
from kiln.models.phi3 import split_gate_up


class GlmForCausalLM(LlamaForCausalLM):
    interleaved_rotary = True

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith(".gate_up_proj"):
                yield from split_gate_up(prefix, leaf, tensor)
            else:
                yield name, tensor


class Glm4DecoderLayer(SandwichDecoderLayer):
    norm_names = ("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


class Glm4ForCausalLM(GlmForCausalLM):
    decoder_layer = Glm4DecoderLayer
