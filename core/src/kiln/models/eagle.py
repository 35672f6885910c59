"""EAGLE-1 draft heads over a Llama-family target (Li et al., 2024), in the published layout.

A head is one Llama decoder layer fed, at position i, ``fc([embed(x_{i+1}); f_i])``: the
embedding of the token after position i beside the target's last hidden state there
(after its final norm), projected back to the hidden size by ``fc`` (a bias by default). The
layer has no input norm and the head no final norm: its output is its guess of the target's
hidden state at i + 1, which the target's LM head turns into a draft token. Checkpoints hold
``fc.*`` and ``layers.0.*`` (names with or without ``model.``); the embeddings and the LM head
are the target's (``kiln.worker.eagle`` attaches them), as in the paper.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class EagleDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose first instance has no input norm (the head's input is ``fc``'s output)."""

    def __init__(self, cfg, layer_idx, *args, **kwargs) -> None:
        super().__init__(cfg, layer_idx, *args, **kwargs)
        if layer_idx == 0:
            del self.input_layernorm
            self.decoder_layout = None  # not the pre-norm layout that fused decode layers assume

    def pre_norm(self, x, residual):
        if residual is None:
            return x, x
        return super().pre_norm(x, residual)


class EagleLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer = EagleDecoderLayer
    pooling_only = True  # no LM head of its own: the target's
    supports_quantization = False
    optional_weights = ("embed_tokens.weight",)  # the target's replace them

    def __init__(self, cfg, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        del self.norm
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=bool(getattr(cfg, "bias", True)))
        self.features: torch.Tensor | None = None  # (tokens, hidden): the target's, set before each pass

    def attach(self, target: nn.Module) -> None:
        """Use ``target``'s embeddings and LM head (the head's own are dropped)."""
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head
        self.logit_softcap = getattr(target, "logit_softcap", None)

    def forward(self, input_ids, positions, ctx) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)
        x = self.fc(torch.cat([embedded, self.features.to(embedded.dtype)], dim=-1))
        residual = None
        for layer, rope in zip(self.layers, self.rope_names):
            x, residual = layer(positions, x, residual, getattr(self, rope), ctx)
        return x + residual
