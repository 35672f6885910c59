"""Tensor parallelism: which shard of the model this process holds, and the one collective
the model needs (an all-reduce after each row-parallel matmul).

Heads and the MLP's intermediate size are split across ``size`` ranks (Megatron-style):
q/k/v and gate/up are column-parallel (each rank computes its heads / its slice), o_proj
and down_proj row-parallel (each rank's partial sums are added by ``all_reduce``).
Embeddings, norms and the LM head are replicated. A mixture of experts splits each expert's
intermediate size the same way, or, with ``expert_parallel`` (``--enable-expert-parallel``),
gives each rank whole experts (``kiln.models.moe``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # experts split whole across the ranks, not each one sliced

    def shard(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (heads, channels); they must divide evenly."""
        if total % self.size:
            raise ValueError(f"--tensor-parallel-size: {self.size} does not divide the model's {what} ({total})")
        return total // self.size

    def slice(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of ``tensor`` along ``dim``."""
        if self.size == 1:
            return tensor
        part = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * part, part)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x
