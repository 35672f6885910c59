"""LoRA in a mixed batch: which adapter each token uses, and the op a platform may replace.

With ``--enable-lora`` every linear projection a LoRA adapter can target (``kiln.lora``)
holds, beside its base layer, the weights of ``--max-loras`` adapter *slots*:

- ``lora_a``: (max_loras, num_slices * max_rank, in_features)
- ``lora_b``: (max_loras, out_features, max_rank), the adapter's scaling folded in
- ``lora_bias``: (max_loras, out_features) or None

A merged projection (q/k/v, gate/up) has one slice per projection it merges: slice ``i``
reads rows ``i * max_rank ...`` of ``lora_a`` and writes its own output columns. Ranks
below ``max_rank`` are zero-padded, so every slot has the same shape.

Each step that runs an adapter sets a ``LoRAMapping`` on ``StepContext.lora``; the layers
then call ``ops.add_lora`` (a ``Platform.custom_ops()`` name) after their base matmul.
``add_lora`` here is the reference every platform's version must match. A platform layer
that runs the model's linear layers another way (a fused decode kernel) must, when
``ctx.lora`` is set, either run the model's own forward or add the same update itself: each
adapted projection module holds ``lora_a``, ``lora_b``, ``lora_bias`` and ``slices`` (the
tuple of output sizes) as attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LoRAMapping:
    """One step's adapter choice per token (on the model's device).

    ``token_slots`` (num_tokens,) int64: the slot each token uses, -1 for the base model.
    ``slot_tokens``: each slot in use, with the indices (int64) of its tokens.
    ``segments``: the same as runs ``(start, end, slot)`` of consecutive tokens, since a
    request's tokens are contiguous (for segmented, SGMV-style kernels).
    ``by_slot``: every adapted token's index, slot 0's first, then slot 1's... (grouped kernels).
    ``derived``: for a platform's own per-step data built from the mapping (it is the same
    object for every projection of a step, so build it at the first and find it after).
    """

    token_slots: torch.Tensor
    slot_tokens: dict[int, torch.Tensor]
    segments: list[tuple[int, int, int]]
    by_slot: torch.Tensor
    derived: dict = field(default_factory=dict)

    @classmethod
    def of(cls, slots: list[int], query_lens: list[int], device: torch.device) -> LoRAMapping | None:
        """The mapping for requests using ``slots`` (-1: none) with ``query_lens`` tokens each,
        or None when no request uses an adapter."""
        if all(s < 0 for s in slots):
            return None
        segments, start = [], 0
        for slot, n in zip(slots, query_lens):
            if slot >= 0 and n:
                if segments and segments[-1][1] == start and segments[-1][2] == slot:
                    segments[-1] = (segments[-1][0], start + n, slot)
                else:
                    segments.append((start, start + n, slot))
            start += n
        token_slots = torch.full((start,), -1, dtype=torch.int64)
        for first, end, slot in segments:
            token_slots[first:end] = slot
        slot_tokens = {
            slot: torch.nonzero(token_slots == slot).flatten().to(device) for slot in sorted({s for *_, s in segments})
        }
        return cls(token_slots.to(device), slot_tokens, segments, torch.cat(list(slot_tokens.values())))


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_bias: torch.Tensor | None,
    mapping: LoRAMapping,
    slices: tuple[int, ...],
) -> torch.Tensor:
    """``y`` (tokens, out) plus each token's adapter applied to ``x`` (tokens, in): for slice
    ``i`` (``slices`` are the output sizes, in order), ``(x @ A_i.T) @ B_i.T (+ bias)``, where
    ``A_i = lora_a[slot, i*R:(i+1)*R]`` and ``B_i`` is ``lora_b[slot]``'s rows of that slice.
    Returns ``y`` (updated in place, or a new tensor: callers use the result)."""
    rank = lora_b.shape[-1]
    for slot, index in mapping.slot_tokens.items():
        h = x.index_select(0, index).to(lora_a.dtype) @ lora_a[slot].T  # (k, slices * rank)
        parts, offset = [], 0
        for i, size in enumerate(slices):
            parts.append(h[:, i * rank : (i + 1) * rank] @ lora_b[slot, offset : offset + size].T)
            offset += size
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if lora_bias is not None:
            delta = delta + lora_bias[slot]
        y = y.index_add(0, index, delta.to(y.dtype))
    return y
