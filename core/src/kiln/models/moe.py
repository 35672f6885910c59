"""Mixtures of experts: Mixtral, Qwen2-MoE and Qwen3-MoE, the Llama network with some (or all)
MLPs replaced by routed experts.

``FusedMoE`` holds a layer's router (``gate``, replicated) and its experts' weights stacked for
the platform's ``moe_route`` and ``fused_experts`` ops (``kiln.interfaces.model``): a platform
fills them with its kernels, the model never loops over experts itself. Under tensor parallelism
each rank holds every expert's slice of the intermediate size; with ``--enable-expert-parallel``
it holds ``num_experts / ranks`` whole experts instead, and routes its tokens' other experts to
nothing. Either way the ranks' partial sums meet in one all-reduce, as a dense MLP's do.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn

from kiln.distributed import TensorParallel
from kiln.interfaces.model import PRE_NORM_MOE_LAYER
from kiln.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from kiln.quantization.checkpoint import QuantizedParts, is_quantized, widen_parts
from kiln.quantization.config import QuantConfig

GATE_UP = ("gate_proj", "up_proj")  # the halves of w13 (and of a dense MLP's merged gate_up_proj)


class FusedMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        ops: SimpleNamespace,
        tp: TensorParallel,
        shared_expert: nn.Module | None = None,
        quant: QuantConfig | None = None,
        prefix: str = "mlp",
    ) -> None:
        super().__init__()
        if tp.expert_parallel:
            self.num_local = tp.shard(num_experts, "number of experts (--enable-expert-parallel)")
            inter = intermediate_size
        else:
            self.num_local = num_experts
            inter = tp.shard(intermediate_size, "experts' intermediate size")
        self.first = tp.rank * self.num_local if tp.expert_parallel else 0
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        # Quantized experts are held for the platform, this rank's slice of each under tensor
        # parallelism (act-order's groups do not split by input: those are widened as they come),
        # and take no memory in the model's dtype until a platform declines them (a GPU's
        # allocator would else reserve the widened experts).
        self._hold = quant is not None and (tp.size == 1 or tp.expert_parallel or not quant.desc_act)
        device = "meta" if self._hold else None
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * inter, hidden_size, device=device))
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, inter, device=device))
        if shared_expert is not None:  # Qwen2-MoE: an MLP every token takes, scaled by a sigmoid gate
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.ops, self.tp = ops, tp
        # The (expert, projection) pairs still to load, per stacked weight.
        self._pending = {
            "w13": {(e, p) for e in range(self.num_local) for p in GATE_UP},
            "w2": set(range(self.num_local)),
        }
        group = quant.scheme.group_size if quant is not None else None
        for name, inputs in (("hidden size", hidden_size), ("experts' intermediate size on a rank", inter)):
            if group and inputs % group:
                raise ValueError(f"{prefix}: the {name}, {inputs}, is not a multiple of the group size {group}")
        # Quantized experts' canonical tensors, per (expert, projection), until each is whole;
        # whole, they are held for the linear method (``take_quantized``), else widened as they
        # arrive.
        self._parts = None if quant is None else QuantizedParts(quant)
        self.quantized: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self.prefix = prefix  # this block's name (Kiln's: mlp, down_proj...), for messages

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights (tokens, top_k); families with another rule
        (DeepSeek's grouped top-k) override it."""
        return self.ops.moe_route(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.num_local < self.num_experts:  # expert parallelism: -1 for another rank's experts
            local = ids - self.first
            ids = torch.where((local >= 0) & (local < self.num_local), local, -1)
        out = self.tp.all_reduce(self.ops.fused_experts(x, self.w13, self.w2, weights, ids))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def load_expert(self, expert: int, proj: str, leaf: str, tensor: torch.Tensor) -> list[str]:
        """Copy one expert's checkpoint projection (``gate_proj``, ``up_proj`` or ``down_proj``)
        into this rank's stacked weights; returns the parameters it completed. A quantized
        projection's canonical tensors (``kiln.quantization.checkpoint``) are held once all have
        arrived (``take_quantized`` hands them on), or, where this rank holds a slice of every
        expert, widened to the model's dtype."""
        quantized = is_quantized(leaf, tensor)
        if quantized and (self._parts is None or leaf not in self._parts.leaves):
            what = "biased experts" if leaf == "bias" else f"quantized experts without a quantization_config ({leaf})"
            raise ValueError(f"expert {expert} {proj}.{leaf}: {what} are not supported")
        local = expert - self.first
        if not 0 <= local < self.num_local:
            if self.tp.expert_parallel and 0 <= expert < self.num_experts:
                return []  # another rank's expert
            raise ValueError(f"checkpoint has expert {expert}; the model has {self.num_experts}")
        name = "w2" if proj == "down_proj" else "w13"
        if quantized:
            parts = self._parts.add(f"{self.prefix}.experts.{expert}.{proj}", leaf, tensor, widened=not self._hold)
            if parts is None:
                return []
            if self._hold:
                self.quantized[local, proj] = self._slice_parts(proj, parts)
            else:
                self._store(local, proj, parts)
        else:
            self._store(local, proj, tensor)
        pending = self._pending[name]
        pending.discard(local if name == "w2" else (local, proj))
        return [name] if not pending else []

    def _slice_parts(self, proj: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of one expert projection's canonical tensors, as ``_store`` slices
        its widened weight: gate and up by output rows, down by inputs (with their groups; one
        scale per row stays whole). FusedMoE checked that a rank's inputs are whole groups."""
        if self.tp.expert_parallel or self.tp.size == 1:
            return parts
        if proj != "down_proj":
            return {leaf: self.tp.slice(t, 0).clone() for leaf, t in parts.items()}
        return {
            leaf: t if leaf != "weight" and t.shape[1] == 1 else self.tp.slice(t, 1).clone()
            for leaf, t in parts.items()
        }

    def _store(self, local: int, proj: str, weight: torch.Tensor, sliced: bool = False) -> None:
        """One expert's projection, as the checkpoint has it (or already this rank's slice of it),
        into this rank's stacked weights."""
        self._materialize()
        slice_of = (lambda t, dim: t) if self.tp.expert_parallel or sliced else self.tp.slice
        if proj == "down_proj":
            self.w2.data[local].copy_(slice_of(weight, 1))
        else:
            inter, half = self.w2.shape[-1], GATE_UP.index(proj)
            self.w13.data[local, half * inter : (half + 1) * inter].copy_(slice_of(weight, 0))

    def take_quantized(self, method) -> None:
        """Hand the quantized experts held to ``method`` (``LinearMethod.process_experts``), or,
        where it does not take them, widen them into the stacked weights."""
        if not self.quantized:
            self._materialize()  # none held (random weights): the stacked ones are used
            return
        whole = len(self.quantized) == 3 * self.num_local  # else some projections came unquantized
        if not (whole and method.process_experts(self, self.quantized)):
            for (local, proj), parts in self.quantized.items():
                self._store(local, proj, widen_parts(parts), sliced=True)
        self.quantized = {}

    def _materialize(self) -> None:
        """Give the stacked weights memory on the layer's device, where they have none yet."""
        for name in ("w13", "w2"):
            weight = self._parameters.get(name)
            if weight is not None and weight.is_meta:
                device = self.gate.weight.device
                setattr(self, name, nn.Parameter(torch.empty_like(weight, device=device)))

    def check_loaded(self) -> None:
        """Raise, naming the expert, when the checkpoint lacks one of this rank's experts'
        projections (or a quantized projection one of its tensors)."""
        if self._parts is not None:
            self._parts.check_complete()
        missing = [*self._pending["w13"], *((e, "down_proj") for e in self._pending["w2"])]
        if missing:
            names = [f"{self.prefix}.experts.{self.first + e}.{p}" for e, p in sorted(missing)]
            raise ValueError(f"checkpoint is missing experts' weights: {names[:8]}")


class MoEDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose MLP is a ``FusedMoE`` where the config makes the layer sparse."""

    def __init__(self, cfg, layer_idx, ops, backend, tp, quant=None, sliding_window=None) -> None:
        super().__init__(cfg, layer_idx, ops, backend, tp, quant, sliding_window)
        mlp, own = self.mlp, type(self).forward is LlamaDecoderLayer.forward
        own = own and type(self.self_attn).forward is LlamaAttention.forward
        routed = type(mlp) is FusedMoE and mlp.num_local == mlp.num_experts
        shared = getattr(mlp, "shared_expert", None)
        plain_shared = shared is None or (type(shared) is LlamaMLP and shared.act == "silu")
        if own and routed and plain_shared and tp.size == 1:
            self.decoder_layout = PRE_NORM_MOE_LAYER

    def make_mlp(self, cfg, layer_idx: int, ops, tp: TensorParallel, quant: QuantConfig | None) -> nn.Module:
        sparse = layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
        sparse = sparse and (layer_idx + 1) % (getattr(cfg, "decoder_sparse_step", None) or 1) == 0
        if not sparse:
            return super().make_mlp(cfg, layer_idx, ops, tp, quant)
        shared = None
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            prefix = f"model.layers.{layer_idx}.mlp.shared_expert"
            shared = LlamaMLP(cfg, ops, tp, prefix, quant, intermediate_size=cfg.shared_expert_intermediate_size)
        experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        # Mixtral always renormalises its top-k weights; the Qwen MoEs say whether in their config.
        renormalize = getattr(cfg, "norm_topk_prob", True)
        prefix = f"model.layers.{layer_idx}.mlp"
        return FusedMoE(
            cfg.hidden_size, experts, cfg.num_experts_per_tok, inter, renormalize, ops, tp, shared, quant, prefix
        )


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    # Adapters on the attention projections; ones on experts, routers, shared experts or dense
    # layers are refused (not mapped yet).
    lora_modules = {k: v for k, v in LlamaForCausalLM.lora_modules.items() if k.startswith("self_attn.")}
    decoder_layer = MoEDecoderLayer
    # Experts are not quantized at load (--quantization on a float checkpoint); a quantized
    # checkpoint's (fp8 included) are widened where the platform does not take them.
    widens_quantized_experts = True


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    pass


# Mixtral's checkpoint names -> the Qwen MoE names the loader reads.
MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


class MixtralForCausalLM(Qwen2MoeForCausalLM):
    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for old, new in MIXTRAL_NAMES.items():
                name = name.replace(old, new)
            yield name, tensor
