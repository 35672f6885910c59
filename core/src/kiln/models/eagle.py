"""EAGLE-1 and EAGLE-3 draft heads over a Llama-family target (Li et al., 2024, 2025), in the
published layouts.

A head is one Llama decoder layer fed, at position i, ``fc([embed(x_{i+1}); f_i])``: the
embedding of the token after position i beside the target's last hidden state there
(after its final norm), projected back to the hidden size by ``fc`` (a bias by default). The
layer has no input norm and the head no final norm: its output is its guess of the target's
hidden state at i + 1, which the target's LM head turns into a draft token. Checkpoints hold
``fc.*`` and ``layers.0.*`` (names with or without ``model.``); the embeddings and the LM head
are the target's (``kiln.worker.eagle`` attaches them), as in the paper.

An EAGLE-3 head reads, instead, the inputs of three of the target's layers (``aux_layer_ids``),
concatenated and projected by ``fc`` (no bias) once per position (``combine``). Its one layer
normalizes the embedding (``input_layernorm``) and that feature (``hidden_norm``) apart and
attends over both side by side (q/k/v take twice the hidden size); the feature, unnormalized,
is the residual. The head's output before its final ``norm`` is the feature its next row reads;
after the norm, its own LM head scores a smaller draft vocabulary, whose ids map to the
target's by the offsets ``d2t`` (target id = draft id + d2t[draft id]). Checkpoints hold
``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t`` and ``t2d``, and
the embeddings only sometimes (the target's are used when they are absent).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from kiln.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, RMSNorm


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

    def release_shared(self) -> None:
        """Free the embeddings built for loading: the target lends its own (``attach``)."""
        self.embed_tokens = None

    def attach(self, target: nn.Module) -> None:
        """Use ``target``'s embeddings and LM head (the head's own are dropped)."""
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head
        self.logit_softcap = getattr(target, "logit_softcap", None)

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the head's rows read them (EAGLE-1: unchanged)."""
        return features

    def forward(self, input_ids, positions, ctx) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)
        x = self.fc(torch.cat([embedded, self.features.to(embedded.dtype)], dim=-1))
        residual = None
        for layer, rope in zip(self.layers, self.rope_names):
            x, residual = layer(positions, x, residual, getattr(self, rope), ctx)
        return x + residual


def read_eagle_config(path: str):
    """The head's config of a folder in vLLM 0.6's EAGLE layout (``kiln convert-eagle`` writes
    it): the inner ``model`` config with the top level's settings over it, as vLLM reads it, and
    ``eagle_fc_bias`` as whether ``fc`` has a bias. None for any other folder."""
    file = Path(path) / "config.json"
    raw = json.loads(file.read_text()) if file.is_file() else {}
    if raw.get("model_type") != "eagle":
        return None
    from transformers import AutoConfig

    inner = dict(raw.get("model") or {})
    outer = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "model")}
    truncated = outer.pop("truncated_vocab_size", None)
    if truncated is not None and truncated != inner.get("vocab_size"):
        raise ValueError(
            f"--speculative-config: {path} truncates the head's vocabulary to {truncated} tokens, "
            "which Kiln does not run (its drafts use the target's whole LM head)"
        )
    if "eagle_fc_bias" in outer:
        inner["bias"] = bool(outer.pop("eagle_fc_bias"))
    inner.update({k: v for k, v in outer.items() if k in inner})
    return AutoConfig.for_model(**inner)


def aux_layer_ids(head_cfg, target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE-3 head reads, in layer order (the order of the
    concatenation ``fc`` reads, as the authors' code and vLLM gather them): the head config's
    ``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``), else the authors'
    choice, layers 2, L // 2 and L - 3 of L."""
    nested = getattr(head_cfg, "eagle_config", None) or {}
    ids = getattr(head_cfg, "eagle_aux_hidden_state_layer_ids", None) or nested.get("eagle_aux_hidden_state_layer_ids")
    ids = list(ids) if ids else [2, target_layers // 2, target_layers - 3]
    if len(set(ids)) != 3 or not all(0 <= i < target_layers for i in ids):
        raise ValueError(
            f"--speculative-config: the EAGLE-3 head reads target layers {ids}; it needs three different ones "
            f"of the target's {target_layers} layers (set eagle_aux_hidden_state_layer_ids in its config.json)"
        )
    return tuple(sorted(ids))


class Eagle3Attention(LlamaAttention):
    """Queries, keys and values from [normed embedding; normed feature]: twice the hidden size."""

    def __init__(self, cfg, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        bias = self.qkv_proj.bias is not None
        self.qkv_proj = nn.Linear(2 * cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)


class Eagle3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg, layer_idx, ops, *args, **kwargs) -> None:
        super().__init__(cfg, layer_idx, ops, *args, **kwargs)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def make_attention(self, cfg, layer_idx, ops, backend, tp, quant, sliding_window) -> nn.Module:
        return Eagle3Attention(cfg, layer_idx, ops, backend, tp, quant, sliding_window)

    def forward(self, positions, embeds, features, rope_cache, ctx):
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features.clone()  # the add below is in place
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(positions, x, rope_cache, ctx)
        norm = self.post_attention_layernorm
        x, residual = self.ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp(x), residual


class Eagle3LlamaForCausalLM(LlamaForCausalLM):
    decoder_layer = Eagle3DecoderLayer
    supports_quantization = False
    optional_weights = ("embed_tokens.weight",)  # absent: the target's

    def __init__(self, cfg, *args, **kwargs) -> None:
        if cfg.num_hidden_layers != 1:
            raise ValueError(f"EAGLE-3 heads have one decoder layer (this one has {cfg.num_hidden_layers})")
        super().__init__(cfg, *args, **kwargs)
        target_hidden = getattr(cfg, "target_hidden_size", None) or cfg.hidden_size
        self.fc = nn.Linear(3 * target_hidden, cfg.hidden_size, bias=False)
        draft_vocab = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        self.tie_word_embeddings = False
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab, bias=False)
        self.register_buffer("draft_to_target", torch.arange(draft_vocab), persistent=False)
        self.has_embeddings = False  # whether the checkpoint brought its own
        self.has_vocab_map = False  # whether it brought d2t
        self.features: torch.Tensor | None = None  # (tokens, hidden): combined target's or own, set before each pass

    def checkpoint_tensors(self, weights):
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "d2t":
                offsets = tensor.to(self.draft_to_target.device, torch.int64)
                self.draft_to_target.copy_(torch.arange(len(offsets), device=offsets.device) + offsets)
                self.has_vocab_map = True
            elif name != "t2d":  # the inverse map, a mask over the target's vocabulary: not needed
                self.has_embeddings |= name == "embed_tokens.weight"
                yield name, tensor

    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        if len(self.draft_to_target) != self.config.vocab_size and not self.has_vocab_map:
            raise ValueError(
                f"the EAGLE-3 head drafts over {len(self.draft_to_target)} of {self.config.vocab_size} tokens "
                "but its checkpoint has no d2t to say which"
            )

    def release_shared(self) -> None:
        """Free the embeddings built for loading when the target lends its own (``attach``)."""
        if not self.has_embeddings:
            self.embed_tokens = None

    def attach(self, target: nn.Module) -> None:
        """Use ``target``'s embeddings when the checkpoint has none."""
        if self.has_embeddings:
            return
        if target.config.hidden_size != self.config.hidden_size:
            raise ValueError(
                f"--speculative-config: the EAGLE-3 head (hidden size {self.config.hidden_size}) has no embeddings "
                f"and the target's are {target.config.hidden_size} wide"
            )
        self.embed_tokens = target.embed_tokens

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's three layer inputs, (tokens, 3 * its hidden size), as the head's feature."""
        return self.fc(features)

    def forward(self, input_ids, positions, ctx) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        rope = getattr(self, self.rope_names[0])
        x, residual = self.layers[0](positions, embeds, self.features.to(embeds.dtype), rope, ctx)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores over the target's vocabulary (tokens outside the draft vocabulary: -inf)."""
        logits = self.lm_head(self.norm(hidden)).float()
        full = logits.new_full((len(logits), self.config.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full
