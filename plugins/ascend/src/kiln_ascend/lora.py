"""``add_lora`` on Ascend through ``torch_npu.npu_grouped_matmul``: the step's adapted tokens,
listed slot by slot, are the m axis of one grouped matmul whose groups are the adapter slots::

    xs = x[token_ids]                                   (n, in)   tokens sorted by slot
    h  = gmm(xs, lora_a^T, group_list)                  (n, slices * R): every slice at once
    y[token_ids, slice i] += gmm(h_i, B_i^T, group_list) (+ lora_bias[slot, slice i])

``group_list`` holds each slot's cumulative token count over all ``max_loras`` slots (unused
slots: empty groups), so the weights pass as single (slots, K, N) tensors, the form the op
takes in fp32 too: ``lora_a`` (and a one-slice ``lora_b``) transposed as stored, which the op
reads without a copy. No weights are merged and no batch is split per adapter; the base
model's tokens are not touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.interfaces.lora import LoRAMapping


@dataclass(slots=True)
class SlotGroups:
    """A step's adapted tokens grouped by slot, in the form the grouped matmul takes."""

    token_ids: torch.Tensor  # (n,) int64: the tokens of slot 0, then slot 1...
    group_list: torch.Tensor  # (num_slots,) int64: cumulative ends of each slot's tokens
    num_tokens: int

    @classmethod
    def of(cls, mapping: LoRAMapping, num_slots: int) -> SlotGroups:
        ends, total = [], 0
        for slot in range(num_slots):
            index = mapping.slot_tokens.get(slot)
            total += 0 if index is None else index.numel()
            ends.append(total)
        device = mapping.token_slots.device
        return cls(mapping.by_slot, torch.tensor(ends, dtype=torch.int64, device=device), total)


def slot_groups(mapping: LoRAMapping, num_slots: int) -> SlotGroups:
    """The step's groups, built (one host-to-device copy) at its first projection only."""
    groups = mapping.derived.get(("npu", num_slots))
    if groups is None:
        groups = mapping.derived[("npu", num_slots)] = SlotGroups.of(mapping, num_slots)
    return groups


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (m, k), in groups by ``group_list``, times their group's ``weight`` (groups, k, n)."""
    import torch_npu

    return torch_npu.npu_grouped_matmul(
        [x], [weight], group_list=group_list, split_item=3, group_type=0, group_list_type=0
    )[0]


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
    groups = slot_groups(mapping, lora_a.shape[0])
    if groups.num_tokens == 0:
        return y
    rank = lora_b.shape[-1]
    xs = x.index_select(0, groups.token_ids).to(lora_a.dtype)
    h = grouped_matmul(xs, lora_a.contiguous().transpose(1, 2), groups.group_list)
    if len(slices) == 1:
        delta = grouped_matmul(h, lora_b.contiguous().transpose(1, 2), groups.group_list)
    else:
        # NOTE(lora): one slice of lora_b is not the transpose of a whole tensor (its slot stride
        # spans every slice), the only strided weight the op reads in place: each slice is copied,
        # (slots, size, R), i.e. slots * R / in_features of the base weight the projection reads.
        parts, offset = [], 0
        for i, size in enumerate(slices):
            b = lora_b[:, offset : offset + size].contiguous().transpose(1, 2)
            parts.append(grouped_matmul(h[:, i * rank : (i + 1) * rank].contiguous(), b, groups.group_list))
            offset += size
        delta = torch.cat(parts, dim=1)
    if lora_bias is not None:
        delta = delta + lora_bias.index_select(0, mapping.token_slots.index_select(0, groups.token_ids))
    return y.index_add_(0, groups.token_ids, delta.to(y.dtype))
