"""What a model sees: the forward context, and the ops a platform may replace.

A model class (registered with ``register_models``) is built as
``Class(hf_config, ops, backend, max_positions=..., tp=...)`` in the target dtype
and device, and provides:

* ``forward(input_ids, positions, ctx: StepContext) -> hidden states`` over one
  flattened token stream per step (``kiln.interfaces.attention.BatchLayout``);
* ``compute_logits(hidden) -> (rows, vocab)`` float32 logits;
* ``load_weights(iterable of (name, tensor))`` for Hugging Face checkpoint names;
* ``layers``: one entry per attention layer (one KV cache each);
* optionally ``supports_graphs = False``: its decode steps never run in a platform's graphs;
* optionally ``decode_stack`` (``None`` until a platform sets it): a callable
  ``(positions, x, rope_cache, ctx) -> (x, residual) | None`` that runs every decoder layer of a
  step in one call, the layers' own forwards in order (the residual stream before the final
  norm), or returns ``None`` for a step the layers must run one by one. ``LlamaForCausalLM``
  calls it when all its layers share one rope table and no layer's input is also returned
  (EAGLE-3's).

Encoder models (``kiln.models.bert``) differ: class attribute ``is_encoder = True``; ``forward``
returns the last layer's hidden states (num_tokens, hidden), attending bidirectionally within
each sequence through ``AttentionBackend.forward_encoder`` (``ctx.layout``), so the engine
must compute each prompt whole in one step; ``layers`` is empty (no KV cache); no
``compute_logits``. Sequence-classification models (cross-encoders) add ``num_labels`` and
``classify(cls_hidden (num_seqs, hidden)) -> (num_seqs, num_labels)`` float32, their head
applied to each sequence's first-token (CLS) hidden state.

A decoder layer whose ``decoder_layout`` is ``PRE_NORM_LAYER`` promises a platform that may
run it another way (e.g. a fused kernel for decode steps) exactly this forward
``(positions, x, residual, rope_cache, ctx) -> (x, residual)``, one rank, no biases but the
linear layers' own::

    x, residual = (rms_norm(x), x) if residual is None else fused_add_rms_norm(x, residual)
    q, k, v = split(self_attn.qkv_proj(x))
    if self_attn.qk_norm:                                  # Qwen3's: each head normed over head_dim
        q, k = rms_norm(q, self_attn.q_norm), rms_norm(k, self_attn.k_norm)
    rotary_embedding(positions, q, k, rope_cache)
    o = self_attn.backend.forward(q, k, v, ctx.kv_caches[self_attn.layer_idx], ...,
                                  scale=self_attn.scale, sliding_window=self_attn.sliding_window)
    x, residual = fused_add_rms_norm(self_attn.o_proj(o), residual)   # post_attention_layernorm
    return mlp.down_proj(silu_and_mul(mlp.gate_up_proj(x))), residual

with the norms ``input_layernorm`` / ``post_attention_layernorm`` (``weight``, ``eps``) and
``self_attn.num_heads``, ``num_kv_heads``, ``head_dim`` per rank. ``PRE_NORM_MOE_LAYER``
promises the same forward with routed experts for the MLP (``kiln.models.moe.FusedMoE``, all
of them on this rank), plus, where the MLP has one, Qwen2-MoE's shared expert (a
``LlamaMLP`` with SiLU) scaled by its sigmoid gate::

    weights, ids = moe_route(mlp.gate(x), mlp.top_k, mlp.renormalize)
    out = fused_experts(x, mlp.w13, mlp.w2, weights, ids)
    if shared := getattr(mlp, "shared_expert", None):
        out = out + sigmoid(mlp.shared_expert_gate(x)) * shared.down_proj(silu_and_mul(shared.gate_up_proj(x)))
    return out, residual

``ops`` is resolved once when the model is built (``resolve_ops``): each name
maps to the platform's override from ``Platform.custom_ops()`` or to the torch
reference here. ``kiln.models.llama`` is the worked example. One op is not the model's:
``argmax``, which the sampler takes from the same table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kiln.interfaces.lora import LoRAMapping, add_lora

if TYPE_CHECKING:
    from kiln.interfaces.attention import BatchLayout


PRE_NORM_LAYER = "pre-norm"  # a ``decoder_layout``: see the module docstring
PRE_NORM_MOE_LAYER = "pre-norm-moe"


@dataclass(slots=True)
class StepContext:
    """What every layer needs for one forward pass: the attention backend's metadata for
    this step and one KV-cache tensor per layer."""

    attn_metadata: object
    kv_caches: list[torch.Tensor]
    layout: BatchLayout | None = None  # the step's batch (None inside decode graphs)
    token_type_ids: torch.Tensor | None = None  # (num_tokens,) int64 BERT segment ids; None: all 0
    lora: LoRAMapping | None = None  # the step's adapter per token (``kiln.interfaces.lora``); None: base only


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` then normalise it; returns (normed, new residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary on (tokens, heads, head_dim) q and k.

    ``cos_sin_cache`` is (max_positions, head_dim): cos in the first half, sin in the second.
    """
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the exact (erf) GELU: ``gelu(gate) * up``."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma's ``gelu_pytorch_tanh``)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (int64), as ``torch.argmax``: the first of equal
    ones, or a row's first NaN where it has one. Greedy sampling's pick (``kiln.worker.sampler``),
    paid every step over the whole vocabulary."""
    return logits.argmax(-1)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' routing: softmax over the (tokens, experts) router logits in fp32,
    the ``top_k`` experts of each token, their weights renormalised to sum to 1 if asked.
    Returns (weights (tokens, top_k) fp32, expert ids (tokens, top_k) int64), highest first."""
    weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The experts' SwiGLU MLPs on their tokens, summed by routing weight: for each token t and
    each of its slots j with ``ids[t, j] = e >= 0``, ``weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ x[t])``.
    ``w13`` is (experts, 2 * intermediate, hidden), gate rows then up rows; ``w2`` is
    (experts, hidden, intermediate). An id of -1 is an expert another rank holds (expert
    parallelism): it adds nothing here."""
    return route_to_experts(x, weights, ids, lambda e, rows: F.linear(silu_and_mul(F.linear(rows, w13[e])), w2[e]))


def route_to_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, expert: Callable[[int, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``fused_experts`` with each expert's MLP given as ``expert(e, rows of x) -> rows``: one
    call per expert the step's tokens chose, in ascending order as transformers adds them (a
    platform passes its own matmuls). The (token, slot) pairs are sorted by expert once."""
    out = torch.zeros_like(x)
    flat, top_k = ids.reshape(-1), ids.shape[-1]
    order = torch.argsort(flat, stable=True)  # within an expert, its tokens in ascending order
    counts = torch.bincount(flat + 1, minlength=1).tolist()  # bucket 0: another rank's experts (-1)
    start = counts[0]
    for e, count in enumerate(counts[1:]):
        if count:
            pairs = order[start : start + count]
            token = pairs // top_k
            h = expert(e, x[token]) * weights.reshape(-1)[pairs, None]
            out.index_add_(0, token, h.to(x.dtype))
            start += count
    return out


REFERENCE_OPS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
    "gelu_and_mul": gelu_and_mul,
    "gelu_tanh_and_mul": gelu_tanh_and_mul,
    "add_lora": add_lora,
    "moe_route": moe_route,
    "fused_experts": fused_experts,
    "argmax": argmax,
}


def resolve_ops(overrides: dict[str, Callable]) -> SimpleNamespace:
    unknown = set(overrides) - set(REFERENCE_OPS)
    if unknown:
        raise ValueError(f"platform overrides unknown ops: {sorted(unknown)}")
    return SimpleNamespace(**{**REFERENCE_OPS, **overrides})
