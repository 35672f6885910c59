"""``--model-impl transformers``: a decoder that transformers runs but Kiln has not written,
served through Kiln's scheduler, paged KV cache and attention backend, as vLLM's Transformers
backend does.

The transformers model is built with an attention implementation registered here
(``ATTENTION``): its layers compute their own projections, norms and rope, and at attention hand
(1, heads, tokens, dim) queries, keys and values to ``kiln_attention``, which runs the platform's
attention backend on Kiln's flattened token stream (one "batch" row holding every sequence of the
step) and cache. The step's context reaches it through the forward's keyword arguments, which
transformers passes down to attention; the model is asked for no masks (Kiln's backend applies
causality per sequence) and no cache of its own. Slower than Kiln's own classes (no fused ops, no
decode graphs), one rank only, a quantized checkpoint widened at load (the builder's
``widen_quantized``); ropes that change with the batch's longest sequence
(``dynamic``, ``longrope``) are refused, as they would make one request's output depend on another's."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kiln.distributed import TensorParallel
from kiln.interfaces.attention import AttentionBackend
from kiln.interfaces.model import StepContext
from kiln.models.rope import rope_kind, rope_settings
from kiln.quantization.config import QuantConfig

ATTENTION = "kiln_paged"


# Attention arguments some models pass that Kiln's backends cannot apply (GPT-OSS's sinks).
UNSUPPORTED = ("s_aux",)


def kiln_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature over Kiln's paged cache: returns
    ((1, tokens, heads, dim) output, no weights)."""
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"--model-impl transformers: the model's attention takes {name!r}, which Kiln cannot apply"
            )
    ctx: StepContext = kwargs["kiln_ctx"]
    backend: AttentionBackend = kwargs["kiln_backend"]
    layer = module.layer_idx
    extra = {}
    if kwargs.get("sliding_window"):
        extra["sliding_window"] = kwargs["sliding_window"]
    if kwargs.get("softcap"):
        extra["logit_softcap"] = kwargs["softcap"]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), ctx.kv_caches[layer], ctx.attn_metadata,
                          layer_idx=layer, scale=scale, **extra)  # fmt: skip
    return out.unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, kiln_attention)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)  # causality is the backend's


class TransformersForCausalLM(nn.Module):
    """Kiln's model interface (``kiln.interfaces.model``) around a transformers causal LM."""

    lora_modules = {}
    supports_graphs = False  # transformers' layers: eager steps only

    def __init__(
        self,
        cfg,
        ops,
        backend: AttentionBackend,
        max_positions: int,
        tp: TensorParallel = TensorParallel(),
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        if tp.size > 1:
            raise ValueError("--model-impl transformers runs on one rank: drop --tensor-parallel-size")
        if quant_config is not None:
            raise ValueError("--model-impl transformers has no quantized layers (the builder widens quantized weights)")
        for what, value in (("sliding_window", getattr(cfg, "sliding_window", None)),
                            ("logit_softcap", getattr(cfg, "attn_logit_softcapping", None))):  # fmt: skip
            supported = getattr(backend, f"supports_{what}")
            if value and not supported:
                raise ValueError(f"model: its {what} needs an attention backend that applies it (torch_ref does)")
        kind = rope_kind(rope_settings(cfg)[1])
        if kind in ("dynamic", "longrope"):
            raise ValueError(
                f"--model-impl transformers: a {kind} rope depends on the batch; Kiln's own classes serve it"
            )
        _register()
        self.config = cfg
        self.backend = backend
        self.model = AutoModelForCausalLM.from_config(
            cfg, attn_implementation=ATTENTION, dtype=torch.get_default_dtype()
        )
        self.layers = [None] * cfg.num_hidden_layers  # one KV cache per decoder layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        out = self.model.base_model(
            input_ids=input_ids[None], position_ids=positions[None], use_cache=False, kiln_ctx=ctx,
            kiln_backend=self.backend,
        )  # fmt: skip
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output embeddings, then what the families' ``*ForCausalLM.forward`` applies to them:
        Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma 2's soft cap."""
        logits = self.model.get_output_embeddings()(hidden)
        cfg = self.config
        if getattr(cfg, "logit_scale", None):
            logits = logits * cfg.logit_scale
        if getattr(cfg, "logits_scaling", None):
            logits = logits / cfg.logits_scaling
        if getattr(cfg, "final_logit_softcapping", None):
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's tensors by their transformers names (with the base model's prefix
        where a checkpoint leaves it out); tied weights may be absent."""
        names, prefix = set(self.model.state_dict()), self.model.base_model_prefix
        state = {n if n in names or f"{prefix}.{n}" not in names else f"{prefix}.{n}": t for n, t in weights}
        result = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "all_tied_weights_keys", None) or {})
        missing = [k for k in result.missing_keys if k not in tied and not k.endswith("rotary_emb.inv_freq")]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        self.model.tie_weights()
