"""DeepSeek-V2 (V2-Lite) and DeepSeek-V3: multi-head latent attention (MLA) and a mixture of
experts with shared experts and grouped routing, on the Llama network's skeleton.

MLA compresses each token's keys and values into one latent ``c`` (``kv_lora_rank`` wide) plus a
shared rotary key ``k_pe``. Kiln caches exactly that, as a single key/value head of
``kv_lora_rank + qk_rope_head_dim`` dimensions, and attends in the latent space (the "absorbed"
form): head h's score ``q_nope . (W_UK[h] c) + q_pe . k_pe`` is ``(W_UK[h]^T q_nope) . c + q_pe .
k_pe``, so the query becomes ``[W_UK[h]^T q_nope, q_pe]`` against the key ``[c, k_pe]``, and the
value, ``W_UV[h] c``, is ``W_UV[h]`` applied after attention to the attended latents (the value
rows read are the key rows; their rotary tail is dropped). Every platform's attention backend
runs it as multi-query attention over the paged cache. ``W_UK`` / ``W_UV`` are ``kv_b_proj``'s
halves, kept per head.

DeepSeek rotates adjacent pairs of ``q_pe`` / ``k_pe``; their rows are reordered at load for the
platforms' rotary op, as for GLM (``kiln.models.rope``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kiln.distributed import TensorParallel
from kiln.interfaces.model import StepContext
from kiln.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, RMSNorm
from kiln.models.moe import GATE_UP, FusedMoE
from kiln.models.rope import mscale, rope_kind, rope_settings, rotary_permutation
from kiln.quantization.checkpoint import QuantizedParts, is_quantized
from kiln.quantization.config import QuantConfig
from kiln.quantization.layers import make_linear


def latent_dims(cfg, tp: TensorParallel) -> tuple[int, int, int]:
    """(query heads of this rank, key/value heads, head size) of MLA's attention: one latent head."""
    return tp.shard(cfg.num_attention_heads, "attention heads"), 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim


def _softmax_scale(cfg) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2``."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    _, rope = rope_settings(cfg)
    m = rope.get("mscale_all_dim") if rope_kind(rope) != "default" else 0
    return scale * mscale(rope.get("factor", 1), m) ** 2 if m else scale


class LatentAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, ops, backend, tp: TensorParallel, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.layer_idx, self.ops, self.backend, self.tp = layer_idx, ops, backend, tp
        self.qk_norm = False  # (the Llama layer's layout check asks)
        heads, _, _ = latent_dims(cfg, tp)
        self.num_heads = heads
        self.nope, self.rope, self.v_dim, self.latent = (
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        )  # fmt: skip
        if getattr(cfg, "attention_bias", False):
            raise ValueError("DeepSeek with attention biases (config 'attention_bias': true) is not supported")
        q_out, prefix = heads * (self.nope + self.rope), f"model.layers.{layer_idx}.self_attn"
        if cfg.q_lora_rank:
            self.q_a_proj = make_linear(quant, [f"{prefix}.q_a_proj"], cfg.hidden_size, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, ops)
            self.q_b_proj = make_linear(quant, [f"{prefix}.q_b_proj"], cfg.q_lora_rank, q_out)
        else:
            self.q_proj = make_linear(quant, [f"{prefix}.q_proj"], cfg.hidden_size, q_out)
        self.kv_a_proj_with_mqa = make_linear(
            quant, [f"{prefix}.kv_a_proj_with_mqa"], cfg.hidden_size, self.latent + self.rope
        )
        self.kv_a_layernorm = RMSNorm(self.latent, cfg.rms_norm_eps, ops)
        # kv_b_proj's key and value halves, in the model's dtype (widened if quantized)
        self.w_uk = nn.Parameter(torch.empty(heads, self.nope, self.latent))
        self.w_uv = nn.Parameter(torch.empty(heads, self.v_dim, self.latent))
        self.o_proj = make_linear(quant, [f"{prefix}.o_proj"], heads * self.v_dim, cfg.hidden_size)
        self.scale = _softmax_scale(cfg)

    def forward(self, positions, x, rope_cache, ctx: StepContext):
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.ops.rotary_embedding(positions, q_pe.contiguous(), k_pe.reshape(-1, 1, self.rope), rope_cache)
        query = torch.cat((torch.einsum("thn,hnc->thc", q_nope, self.w_uk), q_pe), dim=-1)
        key = torch.cat((latent[:, None], k_pe), dim=-1)
        out = self.backend.forward(
            query,
            key,
            key,
            ctx.kv_caches[self.layer_idx],
            ctx.attn_metadata,
            layer_idx=self.layer_idx,
            scale=self.scale,
        )
        out = torch.einsum("thc,hvc->thv", out[..., : self.latent], self.w_uv)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.num_heads * self.v_dim)))


class DeepseekMoE(FusedMoE):
    """Routed experts plus always-on shared experts; V2 routes by softmax (optionally in groups),
    V3 by sigmoid with a per-expert correction and groups ranked by their two best scores."""

    def __init__(self, cfg, ops, tp: TensorParallel, prefix: str, quant: QuantConfig | None = None) -> None:
        experts, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        super().__init__(cfg.hidden_size, experts, cfg.num_experts_per_tok, inter, False, ops, tp, quant=quant,
                         prefix=prefix)  # fmt: skip
        self.v3 = cfg.model_type == "deepseek_v3"
        self.groups, self.top_groups = getattr(cfg, "n_group", None) or 1, getattr(cfg, "topk_group", None) or 1
        self.grouped = self.v3 or getattr(cfg, "topk_method", "greedy") == "group_limited_greedy"
        self.normalize = self.v3 and bool(getattr(cfg, "norm_topk_prob", False))
        self.scaling = cfg.routed_scaling_factor
        if self.v3:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32))
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = LlamaMLP(cfg, ops, tp, f"{prefix}.shared_experts", quant, intermediate_size=shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).float()
        scores = scores.sigmoid() if self.v3 else scores.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias if self.v3 else scores
        if self.grouped:
            grouped = choice.view(-1, self.groups, self.num_experts // self.groups)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if self.v3 else grouped.max(dim=-1).values
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.top_groups, dim=-1)[1], 1)
            keep = keep.bool().repeat_interleave(self.num_experts // self.groups, dim=1)
            choice = choice.masked_fill(~keep, float("-inf") if self.v3 else 0.0)
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    def make_attention(self, cfg, layer_idx, ops, backend, tp, quant, sliding_window) -> nn.Module:
        return LatentAttention(cfg, layer_idx, ops, backend, tp, quant)

    def make_mlp(self, cfg, layer_idx, ops, tp, quant) -> nn.Module:
        if layer_idx < (getattr(cfg, "first_k_dense_replace", 0) or 0):
            return super().make_mlp(cfg, layer_idx, ops, tp, quant)
        return DeepseekMoE(cfg, ops, tp, f"model.layers.{layer_idx}.mlp", quant)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    lora_modules = {}
    decoder_layer = DeepseekDecoderLayer
    widens_quantized_experts = True  # as Qwen2MoeForCausalLM's
    merged_projections = {p: ("gate_up_proj", GATE_UP) for p in GATE_UP}  # q_proj stands alone here

    def __init__(self, cfg, ops, backend, max_positions: int, tp: TensorParallel = TensorParallel(),
                 quant_config: QuantConfig | None = None) -> None:  # fmt: skip
        super().__init__(cfg, ops, backend, max_positions, tp, quant_config)
        # A quantized kv_b_proj's canonical tensors until each layer's are whole: it is widened,
        # since attention multiplies by its halves directly.
        self._kv_b = None if quant_config is None else QuantizedParts(quant_config)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Rotary rows reordered; the query projection and ``kv_b_proj``'s per-head halves cut to
        this rank's heads (the base loader splits only Llama's projections). A quantized layer's
        tensors with a row per output feature are reordered and cut alike."""
        cfg, tp = self.config, self.tp
        nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        interleaved = cfg.model_type == "deepseek_v2" or getattr(cfg, "rope_interleave", True)
        order = rotary_permutation(rope, rope, interleaved) if interleaved else None
        order = torch.tensor(order) if order is not None else None
        for name, tensor in weights:
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= cfg.num_hidden_layers:
                continue  # V3's multi-token-prediction layer: a speculative head, not part of the model
            module, _, leaf = name.rpartition(".")
            rows = leaf in ("weight", "weight_scale", "weight_zero")  # one row per output feature
            if rows and module.endswith(("self_attn.q_proj", "self_attn.q_b_proj")):
                heads = tensor.view(cfg.num_attention_heads, nope + rope, -1)
                if order is not None:
                    heads = torch.cat((heads[:, :nope], heads[:, nope:][:, order]), dim=1)
                yield name, tp.slice(heads, 0).reshape(-1, tensor.shape[-1])
            elif rows and module.endswith("self_attn.kv_a_proj_with_mqa") and order is not None:
                yield name, torch.cat((tensor[: cfg.kv_lora_rank], tensor[cfg.kv_lora_rank :][order]))
            elif module.endswith("self_attn.kv_b_proj") and (leaf == "weight" or self._kv_b is not None):
                if is_quantized(leaf, tensor):
                    if self._kv_b is None or leaf not in self._kv_b.leaves:
                        raise ValueError(f"{name}: a quantized kv_b_proj without a quantization_config")
                    tensor = self._kv_b.add(module, leaf, tensor)
                    if tensor is None:
                        continue
                heads = tp.slice(tensor.view(cfg.num_attention_heads, nope + cfg.v_head_dim, -1), 0)
                attention = module.removesuffix("kv_b_proj")
                yield f"{attention}w_uk", heads[:, :nope]
                yield f"{attention}w_uv", heads[:, nope:]
            else:
                yield name.replace("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"), tensor
        if self._kv_b is not None:
            self._kv_b.check_complete()


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
