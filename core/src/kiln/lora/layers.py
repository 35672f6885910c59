"""LoRA slots beside a model's linear layers (the tensors: ``kiln.interfaces.lora``).

``add_lora_layers`` wraps each projection a model lists in ``lora_modules`` (attribute
path within a decoder layer -> the PEFT projections it merges) in a ``LoRALinear``.
It runs after the platform has processed the weights, so the base layer stays whatever
the platform made of it (packed, tiled, quantized) and LoRA is added to its output.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.distributed import TensorParallel
from kiln.interfaces.lora import LoRAMapping
from kiln.lora.adapter import BaseModelShape, LoRAAdapter

ROW_PARALLEL = ("o_proj", "down_proj")  # input-split under tensor parallelism; the rest split their outputs


class LoRAState:
    """What every ``LoRALinear`` of a model reads: the current step's mapping."""

    mapping: LoRAMapping | None = None


class LoRALinear(nn.Module):
    """``base_layer(x)`` plus, per token, the LoRA update of the slot it uses."""

    def __init__(
        self, base_layer: nn.Module, layer_idx: int, projections: tuple[str, ...], shape: BaseModelShape,
        tp: TensorParallel, max_loras: int, max_rank: int, bias: bool, dtype: torch.dtype, state: LoRAState, add_lora,
    ) -> None:  # fmt: skip
        super().__init__()
        self.base_layer = base_layer
        self.layer_idx, self.projections, self.tp = layer_idx, projections, tp
        self.row_parallel = projections[0] in ROW_PARALLEL
        inputs = shape.dims[projections[0]][0]
        self.in_features = inputs // tp.size if self.row_parallel else inputs
        full_outputs = [shape.dims[p][1] for p in projections]
        self.slices = tuple(n if self.row_parallel else n // tp.size for n in full_outputs)
        self.max_rank = max_rank
        out = sum(self.slices)
        self.lora_a = torch.zeros(max_loras, len(projections) * max_rank, self.in_features, dtype=dtype)
        self.lora_b = torch.zeros(max_loras, out, max_rank, dtype=dtype)
        self.lora_bias = torch.zeros(max_loras, out, dtype=dtype) if bias else None
        self.filled: set[int] = set()  # slots holding an update for this projection
        self.state, self.add_lora = state, add_lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        mapping = self.state.mapping
        if mapping is None or self.filled.isdisjoint(mapping.slot_tokens):
            return y
        rows = self.add_lora(y.reshape(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), self.lora_a, self.lora_b,
                             self.lora_bias, mapping, self.slices)  # fmt: skip
        return rows.view(y.shape)

    @torch.no_grad()
    def set_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Fill ``slot`` with this projection's part of ``adapter`` (zeros where it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if self.lora_bias is not None:
            self.lora_bias[slot].zero_()
        self.filled.discard(slot)
        offset = 0
        for i, (name, size) in enumerate(zip(self.projections, self.slices)):
            update = adapter.modules.get((self.layer_idx, name))
            if update is not None:
                a, b, bias = update.a, update.b, update.bias
                if self.row_parallel:
                    a = self.tp.slice(a, 1)
                    bias = bias if self.tp.rank == 0 else None  # added once, before the all-reduce
                else:
                    b = self.tp.slice(b, 0)
                    bias = None if bias is None else self.tp.slice(bias, 0)
                rank = a.shape[0]
                self.lora_a[slot, i * self.max_rank : i * self.max_rank + rank] = a
                self.lora_b[slot, offset : offset + size, :rank] = b
                if bias is not None:
                    self.lora_bias[slot, offset : offset + size] = bias
                self.filled.add(slot)
            offset += size

    def extra_repr(self) -> str:
        return f"projections={self.projections}, slots={self.lora_a.shape[0]}, max_rank={self.max_rank}"


def add_lora_layers(
    model: nn.Module, shape: BaseModelShape, tp: TensorParallel, config, dtype: torch.dtype
) -> tuple[LoRAState, list[LoRALinear]]:
    """Wrap the model's LoRA-capable projections; returns their shared state and the layers."""
    targets = getattr(model, "lora_modules", None)
    if not targets:
        raise ValueError(f"--enable-lora: {type(model).__name__} does not support LoRA adapters")
    state, wrapped = LoRAState(), []
    device = next(model.parameters()).device
    for layer_idx, layer in enumerate(model.layers):
        for path, projections in targets.items():
            *parents, leaf = path.split(".")
            owner = layer
            for part in parents:
                owner = getattr(owner, part)
            with torch.device(device):
                module = LoRALinear(
                    getattr(owner, leaf), layer_idx, projections, shape, tp, config.max_loras, config.max_lora_rank,
                    config.enable_lora_bias, dtype, state, model.ops.add_lora,
                )  # fmt: skip
            setattr(owner, leaf, module)
            wrapped.append(module)
    return state, wrapped
