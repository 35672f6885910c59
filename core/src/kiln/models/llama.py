"""The Llama family: Llama, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM2.

The model sees one flattened token stream per step (see ``BatchLayout``); q/k/v
and gate/up projections are merged into single matmuls. Under tensor parallelism
(``kiln.distributed``) each rank holds its heads and its slice of the MLP.
Mistral's and Qwen's sliding windows (``kiln.models.sliding_window``) reach the
attention backend per layer. The other dense families (``kiln.models.phi3``, ``glm``,
``gemma``) are this network with the knobs below turned: their checkpoint layout
(``checkpoint_tensors``), a rotary that turns part of each head or adjacent pairs
(``interleaved_rotary``, ``kiln.models.rope``), another gated activation, q/k norms, and
norms around both sublayers (``SandwichDecoderLayer``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import SimpleNamespace

import torch
from torch import nn

from kiln.distributed import TensorParallel
from kiln.interfaces.attention import AttentionBackend
from kiln.interfaces.model import PRE_NORM_LAYER, StepContext
from kiln.models.rope import FULL_ATTENTION, cos_sin_cache, rotary_dim, rotary_permutation
from kiln.models.sliding_window import check_backend, layer_types, sliding_windows
from kiln.quantization.config import QuantConfig
from kiln.quantization.layers import load_linear_tensor, make_linear, row_parallel_dim, values_for


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: SimpleNamespace) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg,
        layer_idx: int,
        ops: SimpleNamespace,
        backend: AttentionBackend,
        tp: TensorParallel,
        quant: QuantConfig | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.num_heads = tp.shard(cfg.num_attention_heads, "attention heads")
        self.num_kv_heads = tp.shard(cfg.num_key_value_heads, "key/value heads")
        self.head_dim = head_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = (
            bool(getattr(cfg, "attention_bias", False) or getattr(cfg, "qkv_bias", False)) or cfg.model_type == "qwen2"
        )
        prefix = f"model.layers.{layer_idx}.self_attn"
        qkv = [f"{prefix}.{p}_proj" for p in "qkv"]
        self.qkv_proj = make_linear(quant, qkv, cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = make_linear(quant, [f"{prefix}.o_proj"], self.q_size, cfg.hidden_size)
        self.qk_norm = cfg.model_type in QK_NORM_TYPES
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
        # Gemma 2/3 scale queries by another length than the head's.
        self.scale = (getattr(cfg, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        # Only windowed (soft-capped) layers pass a window (a cap): backends written before those existed
        # (``forward(..., *, layer_idx, scale)``) keep serving full-attention models.
        cap = getattr(cfg, "attn_logit_softcapping", None)
        extra = {} if sliding_window is None else {"sliding_window": sliding_window}
        extra |= {"logit_softcap": float(cap)} if cap else {}
        self.attn_kwargs = {"layer_idx": layer_idx, "scale": self.scale, **extra}
        self.ops = ops
        self.backend = backend
        self.tp = tp

    def forward(self, positions, x, rope_cache, ctx: StepContext):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotary_embedding(positions, q, k, rope_cache)
        o = self.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata, **self.attn_kwargs)
        return self.tp.all_reduce(self.o_proj(o.reshape(-1, self.q_size)))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        cfg,
        ops: SimpleNamespace,
        tp: TensorParallel,
        prefix: str,
        quant: QuantConfig | None = None,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        self.act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "silu"
        if self.act not in GATED_ACTIVATIONS:
            raise ValueError(f"hidden_act {self.act!r} is not supported ({', '.join(GATED_ACTIVATIONS)} are)")
        intermediate = tp.shard(intermediate_size or cfg.intermediate_size, "intermediate size")
        gate_up = [f"{prefix}.gate_proj", f"{prefix}.up_proj"]
        self.gate_up_proj = make_linear(quant, gate_up, cfg.hidden_size, 2 * intermediate)
        self.down_proj = make_linear(quant, [f"{prefix}.down_proj"], intermediate, cfg.hidden_size)
        self.act_and_mul = getattr(ops, GATED_ACTIVATIONS[self.act])
        self.tp = tp

    def forward(self, x):
        return self.tp.all_reduce(self.down_proj(self.act_and_mul(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg,
        layer_idx,
        ops,
        backend,
        tp: TensorParallel,
        quant: QuantConfig | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = self.make_attention(cfg, layer_idx, ops, backend, tp, quant, sliding_window)
        self.mlp = self.make_mlp(cfg, layer_idx, ops, tp, quant)
        # all-reduces and subclasses' own forwards are not part of the layout's promise
        own = type(self).forward is LlamaDecoderLayer.forward and type(self.self_attn).forward is LlamaAttention.forward
        own = own and type(self.mlp).forward is LlamaMLP.forward and self.mlp.act == "silu"
        self.decoder_layout = PRE_NORM_LAYER if own and tp.size == 1 else None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.ops = ops

    def make_attention(self, cfg, layer_idx, ops, backend, tp, quant, sliding_window) -> nn.Module:
        """The layer's attention (DeepSeek's latent attention: ``kiln.models.deepseek``)."""
        return LlamaAttention(cfg, layer_idx, ops, backend, tp, quant, sliding_window)

    def make_mlp(self, cfg, layer_idx: int, ops, tp: TensorParallel, quant: QuantConfig | None) -> nn.Module:
        """The layer's MLP (mixtures of experts give some layers theirs: ``kiln.models.moe``)."""
        return LlamaMLP(cfg, ops, tp, f"model.layers.{layer_idx}.mlp", quant)

    def pre_norm(self, x, residual):
        """``input_layernorm`` of the layer's input, with the residual stream added first (after
        the first layer); returns (normed, residual)."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.ops.fused_add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)

    def forward(self, positions, x, residual, rope_cache, ctx):
        x, residual = self.pre_norm(x, residual)
        x = self.self_attn(positions, x, rope_cache, ctx)
        norm = self.post_attention_layernorm
        x, residual = self.ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp(x), residual


class SandwichDecoderLayer(LlamaDecoderLayer):
    """A norm after each sublayer too (Gemma 2/3, GLM-4): ``x + norm(attn(norm(x)))``, then the
    same around the MLP. ``norm_names`` gives the checkpoint's names of (the norm after
    attention, the norm before the MLP, the norm after the MLP)."""

    norm_names: tuple[str, str, str]

    def __init__(self, cfg, layer_idx, ops, backend, tp, quant=None, sliding_window=None) -> None:
        super().__init__(cfg, layer_idx, ops, backend, tp, quant, sliding_window)
        del self.post_attention_layernorm
        for name in self.norm_names:
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops))

    def forward(self, positions, x, residual, rope_cache, ctx):
        x, residual = self.pre_norm(x, residual)
        attn_out, mlp_in, mlp_out = (getattr(self, name) for name in self.norm_names)
        x = attn_out(self.self_attn(positions, x, rope_cache, ctx))
        x, residual = self.ops.fused_add_rms_norm(x, residual, mlp_in.weight, mlp_in.eps)
        return mlp_out(self.mlp(x)), residual


class LlamaForCausalLM(nn.Module):
    # LoRA targets (kiln.lora): a decoder layer's projection -> the PEFT projections it merges
    lora_modules = {
        "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "self_attn.o_proj": ("o_proj",),
        "mlp.gate_up_proj": ("gate_proj", "up_proj"),
        "mlp.down_proj": ("down_proj",),
    }
    # The knobs other families turn (see the module docstring).
    decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer
    interleaved_rotary = False  # rotation pairs are adjacent dimensions (GLM), not halves
    scaled_embeddings = False  # embeddings times sqrt(hidden_size) (Gemma)
    supports_quantization = True
    pooling_only = False  # saved without its LM head (``LlamaModel``): serves pooling tasks only
    optional_weights: tuple[str, ...] = ()  # parameters a checkpoint may leave out (set by the caller)
    decode_stack = None  # a platform's run of every layer at once (``kiln.interfaces.model``)
    # A checkpoint projection -> (the merged matmul it joins, the projections that matmul stacks).
    merged_projections = {
        "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
        "up_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    }

    def __init__(
        self,
        cfg,
        ops: SimpleNamespace,
        backend: AttentionBackend,
        max_positions: int,
        tp: TensorParallel = TensorParallel(),
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        if quant_config is not None and not self.supports_quantization:
            raise ValueError(f"quantized {type(self).__name__} checkpoints are not supported yet")
        self.config = cfg
        self.tp = tp
        windows = sliding_windows(cfg, max_positions)
        check_backend(windows, backend)
        cap = getattr(cfg, "attn_logit_softcapping", None)
        if cap and not backend.supports_logit_softcap:
            raise ValueError(
                f"model: {cfg.model_type} soft-caps its attention scores at {cap}, which attention backend "
                f"{backend.name!r} cannot apply; choose one that can (--attention-backend torch_ref)"
            )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size**0.5 if self.scaled_embeddings else None
        self.layers = nn.ModuleList(
            self.decoder_layer(cfg, i, ops, backend, tp, quant_config, windows[i]) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.pooling_only else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor; a platform may repack a copy
        self.logit_softcap = getattr(cfg, "final_logit_softcapping", None)
        head_dim = head_dim_of(cfg)
        rotating = rotary_dim(cfg, head_dim)
        self.rotary_order = rotary_permutation(head_dim, rotating, self.interleaved_rotary)
        # One table per kind of layer whose rope differs (Gemma 3's sliding layers); else one.
        self.rope_names = []
        for kind in layer_types(cfg):
            name = "rope_cache" if kind == FULL_ATTENTION or not _own_rope(cfg, kind) else f"{kind}_rope_cache"
            if not hasattr(self, name):
                self.register_buffer(
                    name, cos_sin_cache(head_dim, max_positions, cfg, rotating, kind), persistent=False
                )
            self.rope_names.append(name)
        # the one table every layer reads, or None (a decode_stack runs only with one)
        self.shared_rope = self.rope_names[0] if len(set(self.rope_names)) == 1 else None
        if not hasattr(self, "rope_cache"):
            self.register_buffer("rope_cache", cos_sin_cache(head_dim, max_positions, cfg, rotating), persistent=False)
        self.ops = ops
        # Layers whose inputs the forward returns too, after its output (an EAGLE-3 head reads them).
        self.aux_layers: tuple[int, ...] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        inputs = {}
        stacked = None
        if self.decode_stack is not None and not self.aux_layers and self.shared_rope is not None:
            stacked = self.decode_stack(positions, x, getattr(self, self.shared_rope), ctx)
        if stacked is not None:
            x, residual = stacked
        else:
            for i, (layer, rope) in enumerate(zip(self.layers, self.rope_names)):
                if i in self.aux_layers:  # copies: layers update the residual stream in place
                    inputs[i] = x.clone() if residual is None else x + residual
                x, residual = layer(positions, x, residual, getattr(self, rope), ctx)
        x, _ = self.ops.fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        if self.aux_layers:
            return torch.cat([x, *(inputs[i] for i in self.aux_layers)], dim=-1)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.logit_softcap:  # Gemma 2: tanh squashes the logits into (-cap, cap)
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits.float()

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """A family's checkpoint tensors in the Llama layout that ``load_weights`` reads
        (separate q/k/v and gate/up projections, norms that multiply by their weight)."""
        return weights

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        layer_loaded: Callable[[nn.Module], None] | None = None,
    ) -> None:
        """Load Hugging Face-named tensors, merging q/k/v and gate/up into one matmul each
        and keeping this tensor-parallel rank's slice of the split projections. A quantized
        layer's tensors come in canonical form (``kiln.quantization.checkpoint``).
        ``layer_loaded(layer)``, if given, runs on each decoder layer once the checkpoint has
        filled all its parameters (``Platform.process_layer_weights``); the layer's parameters
        are then let go, so a layer it repacks frees its originals before later layers load."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        merges = self.merged_projections
        no_head = self.tie_word_embeddings or self.lm_head is None  # a checkpoint's LM head is not loaded
        unfilled: dict[int, set[str]] = {}  # per decoder layer, the parameters still to load
        if layer_loaded is not None:
            for key in set(params) - set(self.optional_weights):
                parts = key.split(".")
                if parts[0] == "layers":
                    unfilled.setdefault(int(parts[1]), set()).add(key)

        def take(name: str, tensor: torch.Tensor) -> set[str]:
            """Load one checkpoint tensor; returns the parameters it completed."""
            if ".experts." in name:  # layers.N.mlp.experts.E.{gate,up,down}_proj.weight
                block, _, rest = name.partition(".experts.")
                expert, proj, leaf = rest.split(".")
                return {f"{block}.{p}" for p in self.get_submodule(block).load_expert(int(expert), proj, leaf, tensor)}
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in ("q_proj", "k_proj", "q_norm", "k_norm"):
                tensor = self._rotary_rows(name, tensor)
            if len(parts) >= 2 and parts[-2] in ("o_proj", "down_proj"):
                dim = row_parallel_dim(parts[-1], tensor)
                if dim is not None:
                    tensor = self.tp.slice(tensor, dim)  # row-parallel: input columns split
            if len(parts) >= 2 and parts[-2] in merges:
                tensor = self.tp.slice(tensor, 0)  # column-parallel: output rows split
                target, order = merges[parts[-2]]
                # Each part as the merged parameter takes it: a 16-bit part of an fp8 layer, say,
                # comes with the scale the other parts' weights bring.
                merged = ".".join(parts[:-2] + [target, parts[-1]])
                done = set()
                for key, value in values_for(params, merged, tensor, name).items():
                    group = pending.setdefault(key, {})
                    group[parts[-2]] = value
                    if len(group) == len(order):
                        del pending[key]
                        whole = merge_shards([group[p] for p in order], key.rpartition(".")[2])
                        done.update(load_linear_tensor(params, key, whole))
                return done
            return set(load_linear_tensor(params, name, tensor))

        for name, tensor in self.checkpoint_tensors(weights):
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and no_head):
                continue
            done = take(name, tensor)
            loaded.update(done)
            for index in {int(key.split(".")[1]) for key in done if key.startswith("layers.")}:
                left = unfilled.get(index)
                if left is not None:
                    left -= done
                    if not left:
                        del unfilled[index]
                        layer_loaded(self.layers[index])
                        for key in [k for k in params if k.startswith(f"layers.{index}.")]:
                            del params[key]  # no reference left to the originals a repack replaced
        for module in self.modules():
            if hasattr(module, "check_loaded"):  # a mixture of experts' layer (kiln.models.moe.FusedMoE)
                module.check_loaded()
        missing = set(params) - loaded - set(self.optional_weights)
        if pending or missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing | set(pending))[:8]}")

    def adapter_rows(self, block: str, module: str, leaf: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A PEFT adapter's lora_B ``leaf`` (weight or bias) for ``block.module`` as the rows of
        each projection it updates, mapped as a checkpoint weight of that name is: a fused
        projection split (Phi-3, GLM-4), query/key rows in ``rotary_order``."""
        rows = []
        for name, part in self.checkpoint_tensors([(f"model.layers.0.{block}.{module}.{leaf}", tensor)]):
            proj = name.split(".")[-2]
            rows.append((proj, self._rotary_rows(name, part) if proj in ("q_proj", "k_proj") else part))
        return rows

    def _rotary_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Each head's query/key dimensions in ``rotary_order`` (``kiln.models.rope``): the rows of a
        weight, a bias, or a quantized layer's scales and zero points."""
        if self.rotary_order is None or name.endswith(".g_idx"):  # g_idx: one per input, not per row
            return tensor
        order = torch.tensor(self.rotary_order)
        heads = tensor.reshape(-1, len(order), *tensor.shape[1:])
        return heads[:, order].reshape(tensor.shape)


def _own_rope(cfg, kind: str) -> bool:
    """Whether layers of ``kind`` have rope parameters of their own (Gemma 3)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return isinstance(params.get(kind), dict)


def merge_shards(shards: list[torch.Tensor], leaf: str) -> torch.Tensor:
    """Merged projections stack their outputs; they share one input, so one ``g_idx``."""
    if leaf != "g_idx":
        return torch.cat(shards, dim=0)
    if any(not torch.equal(shards[0], s) for s in shards[1:]):
        raise ValueError("the merged projections' g_idx differ; Kiln needs one input order per merged matmul")
    return shards[0]


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")  # families with an RMS norm over each query and key head
# hidden_act -> the op of kiln.interfaces.model that applies it to the gate, times the up projection
GATED_ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul", "gelu_new": "gelu_tanh_and_mul",
                     "gelu": "gelu_and_mul"}  # fmt: skip


class LlamaModel(LlamaForCausalLM):
    """A Llama-family decoder saved without its LM head (``LlamaModel``, ``MistralModel``,
    ``Qwen2Model``, ``Qwen3Model``), as sentence-transformers saves decoder embedding models
    (e5-mistral style): tensors named without the ``model.`` prefix, served for pooling only."""

    pooling_only = True
