"""Integer codes packed into int32 words, in the orders quantized checkpoints use."""

from __future__ import annotations

import torch

# AutoAWQ's GEMM layout packs output columns 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned ``bits``-bit codes packed 32/bits to an int32 along ``dim``: field ``i`` (from
    the low bits) of each word holds position ``order[i]`` of its run (default: position i)."""
    per_word = 32 // bits
    codes = codes.movedim(dim, -1).to(torch.int64)
    if codes.shape[-1] % per_word:
        raise ValueError(f"cannot pack {codes.shape[-1]} values {per_word} to an int32")
    runs = codes.reshape(*codes.shape[:-1], -1, per_word)
    if order is not None:
        runs = runs[..., list(order)]
    words = (runs << torch.arange(0, 32, bits, dtype=torch.int64)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed
    return words.movedim(-1, dim).contiguous()


def unpack(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of ``pack``: int16 codes, 32/bits times as long along ``dim``."""
    per_word = 32 // bits
    words = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    fields = (words[..., None] >> torch.arange(0, 32, bits, dtype=torch.int64)) & ((1 << bits) - 1)
    if order is not None:
        fields = fields[..., [order.index(p) for p in range(per_word)]]
    return fields.reshape(*words.shape[:-1], -1).to(torch.int16).movedim(-1, dim).contiguous()
