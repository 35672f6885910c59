"""Decode steps through one C call per decoder layer (``csrc/decode_layer.c``).

At decode batch sizes the Python between a layer's kernels (module calls, views, tensor
allocations, ctypes argument conversion for seven kernels) took about half of a batch-1
decode step of the default model (6.1 ms a step before, 3.1 after). ``use_fused_decode``
wraps each Llama-style decoder layer whose parts are all the CPU plugin's (tiled linear
layers, C attention, C fused ops) and whose ``decoder_layout`` promises the pre-norm forward
(``kiln.interfaces.model``): a step made only of decodes runs the layer in C, with the same
kernels in the same order, so the outputs are bit for bit those of the Python forward; any
other step runs the Python forward. Under LoRA (``ctx.lora``) the C layer adds each
projection's adapter update with the kernel the Python forward's ``add_lora`` calls
(``csrc/lora.c``). ``FusedMoEDecodeLayer`` does the same for bf16 layers of the pre-norm
experts layout (Mixtral's, Qwen3-MoE's, and Qwen2-MoE's with its shared expert) made of
``Bf16Linear`` projections and router, the C route and experts and a bf16 cache, at up to
``KERNEL_MAX_ROWS`` rows: small models only, since ``Bf16Linear`` takes weights of up to
1M values (a released Mixtral's are larger, and oneDNN runs them). Where every layer is a
``FusedDecodeLayer``, the model's ``decode_stack`` (``FusedDecodeStack``) runs them all in one C
call. ``KILN_CPU_FUSED_DECODE=0`` turns all of it off.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from kiln.interfaces.model import PRE_NORM_LAYER, PRE_NORM_MOE_LAYER
from kiln.interfaces.quantization import QuantLinear
from kiln_cpu import fused_ops, native
from kiln_cpu.attention import CpuAttentionBackend, CpuMetadata
from kiln_cpu.fused_ops import LORA_KERNELS, prepared_lora_b
from kiln_cpu.packed_linear import KERNEL_MAX_ROWS, Bf16Linear
from kiln_cpu.tiled_weights import TiledLinear

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [("fmt", _i64), ("int8", _i64), ("scale", _ptr), ("min", _ptr), ("q", _ptr), ("bias", _ptr),
                ("inp", _i64), ("out", _i64), ("lora_a", _ptr), ("lora_b", _ptr), ("lora_bias", _ptr),
                ("lora_rank", _i64), ("lora_slices", _i64), ("lora_sizes", _ptr), ("lora_bf16", _i64),
                ("lora_ranks", _ptr), ("perm", _ptr)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("input_norm", _ptr), ("post_norm", _ptr), ("eps", ctypes.c_double), ("scale", ctypes.c_double),
                ("k_cache", _ptr), ("v_cache", _ptr), ("cache_bf16", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("window", _i64), ("q_norm", _ptr), ("k_norm", _ptr)]  # fmt: skip


class _Bf16Linear(ctypes.Structure):
    _fields_ = [("w", _ptr), ("bias", _ptr), ("inp", _i64), ("out", _i64)]


class _MoELayer(ctypes.Structure):
    _fields_ = [("qkv", _Bf16Linear), ("o", _Bf16Linear), ("gate", _Bf16Linear), ("input_norm", _ptr),
                ("post_norm", _ptr), ("w13", _ptr), ("w2", _ptr), ("eps", ctypes.c_double),
                ("scale", ctypes.c_double), ("k_cache", _ptr), ("v_cache", _ptr), ("heads", _i64),
                ("kv_heads", _i64), ("head_dim", _i64), ("window", _i64), ("experts", _i64), ("top_k", _i64),
                ("renormalize", _i64), ("inter", _i64), ("q_norm", _ptr), ("k_norm", _ptr),
                ("shared_gate_up", _Bf16Linear), ("shared_down", _Bf16Linear), ("shared_gate", _Bf16Linear),
                ("shared_inter", _i64)]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("rows", _i64), ("block_size", _i64), ("table_stride", _i64), ("positions", _ptr), ("slots", _ptr),
                ("block_table", _ptr), ("seq_lens", _ptr), ("cos_sin", _ptr), ("lora_slots", _ptr)]  # fmt: skip


def _tiled(m: nn.Module) -> TiledLinear | None:
    """The ``TiledLinear`` a projection runs: itself, or a quantized layer's (``quant_methods``)."""
    return m if type(m) is TiledLinear else getattr(m, "tiled", None) if isinstance(m, QuantLinear) else None


def _bf16_linear(m: Bf16Linear) -> _Bf16Linear:
    bias = None if m.bias_f32 is None else m.bias_f32.data_ptr()
    return _Bf16Linear(m.weight.data_ptr(), bias, m.in_features, m.out_features)


def _linear(m: nn.Module) -> _Linear:
    t = _tiled(m)
    fmt, scale, low, q = t.weight.kernel_args
    bias = None if t.bias is None else t.bias.data_ptr()
    perm = None if t.perm is None else t.perm.data_ptr()
    return _Linear(fmt, int(t.int8_activations), scale, low, q, bias, t.in_features, t.out_features, perm=perm)


def _norms(layer: nn.Module) -> list[nn.Module]:
    """The layer's RMS norms: input and post-attention, then the query and key heads' where the
    layer has them (``self_attn.qk_norm``, Qwen3's)."""
    attn = layer.self_attn
    heads = [attn.q_norm, attn.k_norm] if getattr(attn, "qk_norm", False) else []
    return [layer.input_layernorm, layer.post_attention_layernorm, *heads]


def _norms_fit(layer: nn.Module, dtype: torch.dtype) -> bool:
    """The norms' weights are contiguous ``dtype`` and their eps one (the C layers take one)."""
    norms = _norms(layer)
    return all(n.weight.dtype == dtype and n.weight.is_contiguous() and n.eps == norms[0].eps for n in norms)


def _head_norms(layer: nn.Module) -> tuple[int | None, int | None]:
    """The C layer's q_norm and k_norm: the per-head norms' weights, or NULL."""
    heads = _norms(layer)[2:]
    return (heads[0].weight.data_ptr(), heads[1].weight.data_ptr()) if heads else (None, None)


def _fusable(layer: nn.Module) -> bool:
    """A layer of ``kiln.interfaces.model``'s pre-norm layout, made only of this plugin's parts."""
    if getattr(layer, "decoder_layout", None) != PRE_NORM_LAYER:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return (
        all(_tiled(m) is not None for m in linears)
        and _norms_fit(layer, torch.float32)
        and isinstance(attn.backend, CpuAttentionBackend)
        and attn.backend.native is not None
        and attn.backend.cache_dtype in native.KV_WRITERS  # the C layer writes the step's K/V
    )


def _fusable_moe(layer: nn.Module) -> bool:
    """A bf16 layer of ``kiln.interfaces.model``'s pre-norm experts layout, made only of this
    plugin's parts: its C kernels' linear layers (a shared expert's too), ops, experts and
    attention on a bf16 cache."""
    if getattr(layer, "decoder_layout", None) != PRE_NORM_MOE_LAYER:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    ops = mlp.ops
    shared = getattr(mlp, "shared_expert", None)
    shared_parts = () if shared is None else (shared.gate_up_proj, shared.down_proj, mlp.shared_expert_gate)
    return (
        all(type(m) is Bf16Linear for m in (attn.qkv_proj, attn.o_proj, mlp.gate, *shared_parts))
        and (shared is None or shared.act_and_mul is fused_ops.silu_and_mul)
        and 0 < mlp.top_k <= mlp.num_experts == mlp.gate.out_features == mlp.w13.shape[0]
        and _norms_fit(layer, torch.bfloat16)
        and fused_ops.bf16_experts_fit(mlp.w13, mlp.w2)
        and (ops.moe_route, ops.fused_experts) == (fused_ops.moe_route, fused_ops.fused_experts)
        and isinstance(attn.backend, CpuAttentionBackend) and attn.backend.native is not None
        and attn.backend.cache_dtype == torch.bfloat16
    )  # fmt: skip


class _LayerWrapper(nn.Module):
    """A decoder layer's stand-in, transparent: code that reads the layer's parts
    (``self_attn``, ``mlp``...) finds them. ``self.c`` holds the C layer's arguments."""

    def _point_at_cache(self, ctx) -> None:
        """The C layer's K and V planes: this layer's cache of the step. Their addresses come from
        the cache's own: indexing it (kv[0], kv[1]) made two views a layer, ~3 % of a one-sequence
        decode step of the default model."""
        kv = ctx.kv_caches[self.layer_idx]
        self.c.k_cache = kv.data_ptr()
        self.c.v_cache = self.c.k_cache + kv.stride(0) * kv.element_size()

    def _run_in_c(self, kernel: str, step: _Step, x: torch.Tensor, residual, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's decode step through the C function ``kernel``, in place in ``x``."""
        self._point_at_cache(ctx)
        first = residual is None
        if first:
            residual = torch.empty_like(x)
        if getattr(native.load_kernels(), kernel)(ctypes.byref(self.c), ctypes.byref(step), x.data_ptr(),
                                                  residual.data_ptr(), int(first)):  # fmt: skip
            raise RuntimeError(f"{kernel} failed: out of memory, or a shape its kernels refuse")
        return x, residual

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("layer")  # absent while copying or unpickling
            if inner is None:
                raise
            return getattr(inner, name)


class FusedDecodeLayer(_LayerWrapper):
    """A pre-norm decoder layer whose decode-only steps run in one C call."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = attn.layer_idx
        self.lora_ready: bool | None = None  # known on the first step with LoRA adapters
        self.c = _Layer(
            _linear(attn.qkv_proj), _linear(attn.o_proj), _linear(mlp.gate_up_proj), _linear(mlp.down_proj),
            layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
            layer.input_layernorm.eps, attn.scale, None, None,
            int(attn.backend.cache_dtype == torch.bfloat16), attn.num_heads, attn.num_kv_heads, attn.head_dim,
            attn.sliding_window or 0, *_head_norms(layer),
        )  # fmt: skip

    def _lora_ready(self) -> bool:
        """Point the C layer at the LoRA slots beside its projections (``kiln.interfaces.lora``), B
        transposed as the kernel reads it (again after a slot changed); False when they are not
        all fp32 or all bf16, contiguous (the Python forward runs them then)."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        pairs = ((self.c.qkv, attn.qkv_proj), (self.c.o, attn.o_proj), (self.c.gate_up, mlp.gate_up_proj),
                 (self.c.down, mlp.down_proj))  # fmt: skip
        if self.lora_ready is None:
            tensors = [t for _, m in pairs for t in (m.lora_a, m.lora_b, m.lora_bias) if t is not None]
            dtype = tensors[0].dtype
            self.lora_ready = dtype in LORA_KERNELS and all(t.dtype == dtype and t.is_contiguous() for t in tensors)
            if self.lora_ready:
                self.lora_sizes = []
                for c, m in pairs:
                    sizes = torch.tensor(m.slices, dtype=torch.int64)
                    self.lora_sizes.append(sizes)  # owns the pointer below
                    c.lora_a = m.lora_a.data_ptr()
                    c.lora_bias = None if m.lora_bias is None else m.lora_bias.data_ptr()
                    c.lora_rank, c.lora_slices, c.lora_sizes = m.lora_b.shape[-1], len(m.slices), sizes.data_ptr()
                    c.lora_bf16 = int(dtype == torch.bfloat16)
        if self.lora_ready:
            for c, m in pairs:
                transposed, ranks = prepared_lora_b(m.lora_b)
                c.lora_b, c.lora_ranks = transposed.data_ptr(), ranks.data_ptr()
        return self.lora_ready

    def forward(self, positions, x, residual, rope_cache, ctx):
        step = _step_of(ctx, positions, rope_cache, x) if x.dtype == torch.float32 else None
        if step is None or (ctx.lora is not None and not self._lora_ready()):
            return self.layer(positions, x, residual, rope_cache, ctx)
        return self._run_in_c("decode_layer", step, x, residual, ctx)


class FusedMoEDecodeLayer(_LayerWrapper):
    """A bf16 pre-norm layer with routed experts whose decode-only steps (up to
    ``KERNEL_MAX_ROWS`` rows, without LoRA) run in one C call."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = attn.layer_idx
        self.c = _MoELayer(
            _bf16_linear(attn.qkv_proj), _bf16_linear(attn.o_proj), _bf16_linear(mlp.gate),
            layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
            mlp.w13.data_ptr(), mlp.w2.data_ptr(), layer.input_layernorm.eps, attn.scale, None, None,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.sliding_window or 0, mlp.num_experts, mlp.top_k,
            int(mlp.renormalize), mlp.w2.shape[2], *_head_norms(layer),
        )  # fmt: skip
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None:  # Qwen2-MoE's
            self.c.shared_gate_up = _bf16_linear(shared.gate_up_proj)
            self.c.shared_down = _bf16_linear(shared.down_proj)
            self.c.shared_gate = _bf16_linear(mlp.shared_expert_gate)
            self.c.shared_inter = shared.down_proj.in_features

    def forward(self, positions, x, residual, rope_cache, ctx):
        # rows the Python forward runs through the same kernels (Bf16Linear's, the experts')
        rows_ok = x.shape[0] <= min(KERNEL_MAX_ROWS, fused_ops.bf16_experts_max_tokens())
        fits = x.dtype == torch.bfloat16 and rows_ok and ctx.lora is None
        step = _step_of(ctx, positions, rope_cache, x) if fits else None
        if step is None:
            return self.layer(positions, x, residual, rope_cache, ctx)
        return self._run_in_c("decode_moe_layer_bf16", step, x, residual, ctx)


class FusedDecodeStack:
    """A model's ``decode_stack`` (``kiln.interfaces.model``) when every decoder layer is a
    ``FusedDecodeLayer``: a decode-only step without LoRA runs them all in one C call
    (``decode_layers``), the same C layers in the same order, so the outputs are those of the
    layer-by-layer loop bit for bit. The loop's Python between layers (a module call, the step's
    checks, a ctypes call) took ~9 us a layer: ~0.3 ms of a 7-9 ms one-sequence decode step of
    the default model (30 layers) on a 2-core AMX Xeon."""

    def __init__(self, layers: list[FusedDecodeLayer]) -> None:
        self.layers = layers
        self.structs = (ctypes.c_void_p * len(layers))(*(ctypes.addressof(layer.c) for layer in layers))

    def __call__(self, positions, x, rope_cache, ctx) -> tuple[torch.Tensor, torch.Tensor] | None:
        if x.dtype != torch.float32 or ctx.lora is not None:
            return None
        step = _step_of(ctx, positions, rope_cache, x)
        if step is None:
            return None
        for layer in self.layers:
            layer._point_at_cache(ctx)
        residual = torch.empty_like(x)
        if native.load_kernels().decode_layers(self.structs, len(self.layers), ctypes.byref(step), x.data_ptr(),
                                               residual.data_ptr()):  # fmt: skip
            raise RuntimeError("decode_layers failed: out of memory, or a shape its kernels refuse")
        return x, residual


def _step_of(ctx, positions: torch.Tensor, rope_cache: torch.Tensor, x: torch.Tensor) -> _Step | None:
    """The step's shared arguments (built by its first layer), or None for a step the C
    layers do not run: one with prefills, or inputs in another layout (the layers check
    their dtype)."""
    meta = ctx.attn_metadata
    if not isinstance(meta, CpuMetadata) or meta.prefills or meta.decode_blocks is None:
        return None
    if meta.c_step is None:
        layout = meta.layout
        ok = rope_cache.dtype == torch.float32 and x.is_contiguous() and rope_cache.is_contiguous()
        if not ok or layout.num_reqs != x.shape[0] or layout.block_table.dtype != torch.int32:
            return None
        positions = positions.to(torch.int64).contiguous()
        slots = layout.slot_mapping.to(torch.int64).contiguous()
        step = _Step(
            x.shape[0], layout.block_size, layout.block_table.stride(0), positions.data_ptr(), slots.data_ptr(),
            layout.block_table.data_ptr(), layout.seq_lens.data_ptr(), rope_cache.data_ptr(),
        )  # fmt: skip
        if ctx.lora is not None:  # the LoRA layers' slots are read by _lora_ready
            step.lora_slots = ctx.lora.token_slots.data_ptr()
        step.tensors = (positions, slots)  # the pointers' owners live as long as the step
        meta.c_step = step
    return meta.c_step


def use_fused_decode(model: nn.Module) -> int:
    """Wrap every decoder layer ``FusedDecodeLayer`` or ``FusedMoEDecodeLayer`` can run, and give
    a model whose layers are all ``FusedDecodeLayer`` (and one rope table) a ``FusedDecodeStack``;
    returns how many layers."""
    layers = getattr(model, "layers", None)
    if os.environ.get("KILN_CPU_FUSED_DECODE", "1") == "0" or layers is None or native.load_kernels() is None:
        return 0
    count = 0
    for i, layer in enumerate(layers):
        if _fusable(layer):
            layers[i] = FusedDecodeLayer(layer)
            count += 1
        elif _fusable_moe(layer):
            layers[i] = FusedMoEDecodeLayer(layer)
            count += 1
    # the stack takes one rope table (the model's shared_rope), and runs every layer
    one_rope = getattr(model, "shared_rope", None) is not None and len(model.rope_names) == len(layers)
    if hasattr(model, "decode_stack") and one_rope and count and all(type(m) is FusedDecodeLayer for m in layers):
        model.decode_stack = FusedDecodeStack(list(layers))
    return count
