"""``add_lora`` on CUDA: one shrink and one expand Triton launch per projection, whatever the
mix of adapters in the step (``kiln_cuda.lora_kernels``). No weights are merged and no batch
is split per adapter; the base model's tokens are not touched."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kiln.interfaces.lora import LoRAMapping
from kiln_cuda.lora_kernels import lora_expand_kernel, lora_shrink_kernel


@dataclass(slots=True)
class SlotGroups:
    """A step's adapted tokens, grouped by slot, as the kernels read them."""

    token_ids: torch.Tensor  # (num_tokens,) int64: the tokens of each group in turn
    groups: torch.Tensor  # (num_groups, 3) int32: slot, first index into token_ids, count
    num_tokens: int
    most: int  # the largest count

    @classmethod
    def of(cls, mapping: LoRAMapping) -> SlotGroups:
        rows, first = [], 0
        for slot, index in mapping.slot_tokens.items():
            rows.append((slot, first, index.numel()))
            first += index.numel()
        groups = torch.tensor(rows, dtype=torch.int32).reshape(-1, 3).to(mapping.token_slots.device)
        return cls(mapping.by_slot, groups, first, max((n for *_, n in rows), default=0))


_bounds: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def slot_groups(mapping: LoRAMapping) -> SlotGroups:
    """The step's groups, built (one host-to-device copy) at its first projection only."""
    groups = mapping.derived.get("cuda")
    if groups is None:
        groups = mapping.derived["cuda"] = SlotGroups.of(mapping)
    return groups


def slice_bounds(slices: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The output column where each slice starts, then the end: (len(slices) + 1,) int32."""
    bounds = _bounds.get((slices, device))
    if bounds is None:
        edges = [0]
        for size in slices:
            edges.append(edges[-1] + size)
        bounds = _bounds.setdefault((slices, device), torch.tensor(edges, dtype=torch.int32, device=device))
    return bounds


def split_k(programs: int, inputs: int, block_k: int) -> int:
    """How many parts the shrink splits the input features into: enough for about 128 programs
    (a GPU's multiprocessors) when few tokens leave few tiles, at least 4 blocks of K per part,
    at most 16 parts (the expand sums them)."""
    return max(1, min(16, inputs // (4 * block_k), 128 // programs))


def _block(n: int, least: int, most: int) -> int:
    return max(least, min(most, triton.next_power_of_2(n)))


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_bias: torch.Tensor | None,
    mapping: LoRAMapping,
    slices: tuple[int, ...],
) -> torch.Tensor:
    """``kiln.interfaces.lora.add_lora``, adding into ``y`` in place (returned)."""
    groups = slot_groups(mapping)
    if groups.num_tokens == 0:
        return y
    y = y if y.stride(-1) == 1 else y.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    rank, rows, inputs = lora_b.shape[-1], lora_a.shape[1], x.shape[1]
    num_groups = groups.groups.shape[0]
    block_m, block_n, block_k = _block(groups.most, 16, 64), _block(rows, 16, 128), _block(inputs, 16, 64)
    m_tiles, n_tiles = triton.cdiv(groups.most, block_m), triton.cdiv(rows, block_n)
    splits = split_k(num_groups * m_tiles * n_tiles, inputs, block_k)
    k_per_split = triton.cdiv(triton.cdiv(inputs, splits), block_k) * block_k
    h = torch.empty((splits, groups.num_tokens, rows), dtype=torch.float32, device=x.device)
    lora_shrink_kernel[(num_groups, m_tiles, n_tiles * splits)](
        x, lora_a, h, groups.token_ids, groups.groups, x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(1),
        h.stride(0), inputs, rows, k_per_split, n_tiles, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    block_n = _block(max(slices), 16, 128)
    tiles = triton.cdiv(max(slices), block_n)
    bias = lora_bias.contiguous() if lora_bias is not None else lora_b  # any pointer when there is no bias
    lora_expand_kernel[(num_groups, m_tiles, len(slices) * tiles)](
        h, lora_b, bias, y, groups.token_ids, groups.groups, slice_bounds(slices, y.device), h.stride(1), h.stride(0),
        y.stride(0), lora_b.stride(0), lora_b.stride(1), bias.stride(0), rank, tiles, splits,
        HAS_BIAS=lora_bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_block(rank, 16, 64),
    )  # fmt: skip
    return y
