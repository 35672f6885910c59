"""Gemma, Gemma 2 and Gemma 3 (text): the Llama network with embeddings scaled by
sqrt(hidden_size), a GELU-gated MLP, norms that multiply by ``1 + weight`` (stored here as
that sum, so every platform's ``rms_norm`` applies them) and tied embeddings. Gemma 2 and 3
add a norm after each sublayer, a query scale of their own (``query_pre_attn_scalar``) and
sliding-window layers (``layer_types``); Gemma 2 soft-caps its logits; Gemma 3 normalises
each query and key head and gives its sliding layers a rope of their own."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kiln.models.llama import LlamaForCausalLM, SandwichDecoderLayer


class GemmaForCausalLM(LlamaForCausalLM):
    scaled_embeddings = True

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith("norm.weight"):  # every RMS norm of the family: x * (1 + weight)
                tensor = tensor.float() + 1.0
            yield name, tensor


class Gemma2DecoderLayer(SandwichDecoderLayer):
    norm_names = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class Gemma2ForCausalLM(GemmaForCausalLM):
    decoder_layer = Gemma2DecoderLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    pass
