"""Mistral's own checkpoint layout: ``params.json`` and ``consolidated*.safetensors``, as Mistral's
model cards serve them (``--tokenizer-mode mistral --config-format mistral --load-format mistral``).

``params.json`` becomes the Hugging Face config transformers' conversion script would write
(a ``MistralConfig``, or a ``MixtralConfig`` with a ``moe`` section); the consolidated
weights get Hugging Face's names, and their q/k projections Hugging Face's rotary layout: Mistral
keeps each head's rotated pairs interleaved (as Meta's Llama did), transformers rotates its
halves, so the rows of ``wq`` and ``wk`` are reordered per head as the conversion reorders them.
An fp8 release (``quantization: {qformat_weight: fp8_e4m3}``) becomes an fp8 ``quantization_config``
(``kiln.quantization.fp8``), its ``qscale_weight`` the weights' ``weight_scale`` (reordered with
``wq``'s and ``wk``'s rows where it has one per row) and its activation and KV-cache ``qscale_act``
the scales an fp8 checkpoint carries and Kiln drops.
A text model's vision encoder (Pixtral-style multimodal releases) is left out: Kiln serves text.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator

import torch

from kiln.models.gguf_cache import expert_weight_name

logger = logging.getLogger("kiln.loader")

PARAMS = "params.json"
# params.json keys read here; any other changes the model in ways Kiln does not follow.
KNOWN = frozenset({
    "dim", "n_layers", "head_dim", "hidden_dim", "n_heads", "n_kv_heads", "norm_eps", "vocab_size", "rope_theta",
    "sliding_window", "tied_embeddings", "max_position_embeddings", "max_seq_len", "moe", "vision_encoder",
    "model_type", "lora", "yarn", "quantization",
})  # fmt: skip
YARN = frozenset({"factor", "original_max_position_embeddings", "beta", "alpha", "apply_scale"})
VISION = ("vision_encoder.", "vision_language_adapter.", "patch_merger.", "pre_mm_projector_norm.")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.gate.weight": "mlp.gate.weight",
}
_EXPERT = re.compile(r"feed_forward\.experts\.(\d+)\.w([123])\.weight")
# fp8 releases' scales: a weight's, and its input's (unused by Kiln, as an fp8 checkpoint's input_scale)
_SCALES = {"qscale_weight": "weight_scale", "qscale_act": "input_scale"}
# the attention's fp8 KV-cache quantizers -> the scale names an fp8 checkpoint's loader drops
_KV_QUANTIZERS = {f"attention.{p}_fake_quantizer.qscale_act": f"self_attn.{p}_scale" for p in ("q", "k", "v", "kv")}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}  # fmt: skip


def is_mistral_layout(path: str, config_format: str) -> bool:
    """Whether folder ``path``'s config is read from ``params.json``: ``--config-format mistral``,
    or ``auto`` for a folder with ``params.json`` and no ``config.json``."""
    if config_format == "mistral":
        return True
    has = lambda name: os.path.exists(os.path.join(path, name))  # noqa: E731
    return config_format == "auto" and has(PARAMS) and not has("config.json")


def read_params(path: str) -> dict:
    """Folder ``path``'s ``params.json``; ``ValueError`` where it is missing or holds keys Kiln
    does not read."""
    try:
        with open(os.path.join(path, PARAMS)) as f:
            params = json.load(f)
    except OSError:
        raise ValueError(f"model: {path!r} has no {PARAMS} (Mistral's layout, --config-format mistral)") from None
    if unknown := sorted(set(params) - KNOWN):
        raise ValueError(
            f"model: {path}/{PARAMS} has {unknown}, which Kiln does not read; if the repo also has a Hugging Face "
            "config.json and weights, serve those (--config-format hf --load-format auto)"
        )
    return params


def hf_config(path: str):
    """The Hugging Face config of the model in ``path``'s ``params.json``."""
    from transformers import MinistralConfig, MistralConfig, MixtralConfig

    p = read_params(path)
    if p.get("vision_encoder"):
        logger.info("%s: a multimodal release; Kiln serves its text model, without the vision encoder", path)
    heads = p["n_heads"]
    config = dict(
        hidden_size=p["dim"], num_hidden_layers=p["n_layers"], intermediate_size=p["hidden_dim"],
        num_attention_heads=heads, num_key_value_heads=p.get("n_kv_heads", heads),
        head_dim=p.get("head_dim", p["dim"] // heads), rms_norm_eps=p["norm_eps"], vocab_size=p["vocab_size"],
        rope_parameters=_rope(path, p), sliding_window=p.get("sliding_window"),
        tie_word_embeddings=p.get("tied_embeddings", False),
        # params.json rarely says: vLLM's reading of it assumes 128k, as Mistral's recent models have
        max_position_embeddings=p.get("max_position_embeddings") or p.get("max_seq_len") or 128_000,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if isinstance(p.get("sliding_window"), list):  # a window per layer (Ministral's interleaved pattern)
        if p.get("moe"):
            raise ValueError(f"model: {path}/{PARAMS} gives a mixture of experts a sliding window per layer")
        out = MinistralConfig(**{**config, **_layer_windows(path, p)})
        out.architectures = ["MinistralForCausalLM"]
    elif moe := p.get("moe"):
        out = MixtralConfig(
            **config, num_local_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"]
        )
        out.architectures = ["MixtralForCausalLM"]
    else:
        out = MistralConfig(**config)
        out.architectures = ["MistralForCausalLM"]
    if p.get("quantization"):
        out.quantization_config = _quantization(path, p["quantization"])
    return out


def _quantization(path: str, q: dict) -> dict:
    """The ``quantization_config`` of params.json's ``quantization`` section, as vLLM reads it: fp8
    weights with a scale per tensor (or row), activations scaled statically (``qscheme_act``
    ``TENSOR``, the default) or per token (``NO_SCALES``)."""
    act = q.get("qscheme_act")
    if set(q) - {"qformat_weight", "qscheme_act"} or q.get("qformat_weight") != "fp8_e4m3" or act not in (
        "TENSOR", "NO_SCALES", None
    ):  # fmt: skip
        raise ValueError(
            f"model: {path}/{PARAMS}'s quantization {q} is not one Kiln reads (qformat_weight fp8_e4m3, "
            "qscheme_act TENSOR or NO_SCALES)"
        )
    return {"quant_method": "fp8", "activation_scheme": "dynamic" if act == "NO_SCALES" else "static"}


def _rope(path: str, p: dict) -> dict:
    """transformers' ``rope_parameters`` for params.json's ``rope_theta`` and ``yarn`` section
    (renamed as vLLM reads them: ``beta`` is transformers' ``beta_fast``, ``alpha`` its
    ``beta_slow``; ``apply_scale: false`` leaves the attention unscaled)."""
    rope = {"rope_type": "default", "rope_theta": p.get("rope_theta", 10000.0)}
    yarn = p.get("yarn")
    if not yarn:
        return rope
    if unknown := sorted(set(yarn) - YARN):
        raise ValueError(f"model: {path}/{PARAMS}'s yarn has {unknown}, which Kiln does not read")
    if missing := [k for k in ("factor", "original_max_position_embeddings") if k not in yarn]:
        raise ValueError(f"model: {path}/{PARAMS}'s yarn lacks {missing}")
    rope.update(rope_type="yarn", factor=float(yarn["factor"]))
    rope["original_max_position_embeddings"] = int(yarn["original_max_position_embeddings"])
    if "beta" in yarn:
        rope["beta_fast"] = float(yarn["beta"])
    if "alpha" in yarn:
        rope["beta_slow"] = float(yarn["alpha"])
    if not yarn.get("apply_scale", True):
        rope["attention_factor"] = 1.0
    return rope


def _layer_windows(path: str, p: dict) -> dict:
    """params.json's window per layer (None: full attention), a pattern repeated over the layers,
    as transformers' Ministral config gives it: one window size and each layer's kind."""
    pattern, layers = p["sliding_window"], p["n_layers"]
    sizes = sorted({w for w in pattern if w is not None})
    if not pattern or layers % len(pattern) or len(sizes) > 1:
        raise ValueError(
            f"model: {path}/{PARAMS}'s sliding_window {pattern} is not one window size in a pattern that repeats "
            f"over its {layers} layers, which is all Kiln reads"
        )
    kinds = ["full_attention" if w is None else "sliding_attention" for w in pattern]
    return dict(sliding_window=sizes[0] if sizes else None, layer_types=kinds * (layers // len(pattern)))


def rotary_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A q/k projection's rows (of its weight, or of its scales where it has one per row) from
    Mistral's rotary layout (each head's pairs interleaved) to Hugging Face's (each head's two
    halves), as transformers' conversion reorders them."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def hf_weights(path: str, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (a consolidated file's, Mistral's names) under Hugging Face's names and layout;
    the vision encoder's are dropped, a name Kiln does not know passes as it is."""
    p = read_params(path)
    heads = {"attention.wq.weight": p["n_heads"], "attention.wk.weight": p.get("n_kv_heads", p["n_heads"])}
    for name, tensor in weights:
        if name.startswith(VISION):
            continue
        base, _, leaf = name.rpartition(".")
        scale = None if base.endswith("_fake_quantizer") else _SCALES.get(leaf)
        if scale is None:
            yield _hf_weight(name, tensor, heads)
            continue
        # named as the weight, and its scales per row (not its input's) reordered as its rows
        name, tensor = _hf_weight(f"{base}.weight", tensor, heads if scale == "weight_scale" else {})
        yield f"{name.removesuffix('.weight')}.{scale}", tensor


def _hf_weight(name: str, tensor: torch.Tensor, heads: dict[str, int]) -> tuple[str, torch.Tensor]:
    """One consolidated tensor under its Hugging Face name, q/k rows in Hugging Face's order."""
    layer = _LAYER.fullmatch(name)
    if layer is None:
        return _TOP.get(name, name), tensor
    index, rest = layer.groups()
    if expert := _EXPERT.fullmatch(rest):
        return expert_weight_name(index, expert[1], {"1": "gate", "2": "down", "3": "up"}[expert[2]]), tensor
    if rest in heads and tensor.numel() > 1:  # (a scale per tensor has no rows to reorder)
        tensor = rotary_halves(tensor, heads[rest])
    return f"model.layers.{index}.{_PER_LAYER.get(rest) or _KV_QUANTIZERS.get(rest, rest)}", tensor
