"""GGUF models' weights kept in their 4/8-bit blocks, with exactly the fp32 values.

A GGUF file stores most weights as small integers with a float scale (and for
Q4_1 a minimum) per 32 values; the loader widens them to fp32, 4 bytes per weight
instead of 0.6-1.1. ``find_gguf_form`` recovers the blocks from the fp32 values
and keeps them only when widening them back gives every value bit for bit, so a
model computes exactly what it did in fp32 while its fp32 copy is freed. No name
mapping or file format is involved: a weight that did not come from such blocks
(a random or bf16 one) fails the check on its first rows and stays as it is.

Decode-sized batches widen each 4-row tile in L1 inside the small-batch kernel;
larger ones widen the whole weight into a temporary tensor for ``F.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln_cpu import native
from kiln_cpu.small_batch_linear import MAX_ROWS

BLOCK = 32
_CHUNK_ROWS = 1024  # rows recovered and checked at a time: bounds the temporary copies


@dataclass(slots=True, eq=False)
class GgufWeight:
    """A (rows, cols) weight as blocks: ``fmt`` 4 (value = nibble * scale + min, GGUF's Q4_1)
    or 8 (value = int8 * scale, Q8_0). ``scale``/``min`` are (rows, cols / 32) fp32; ``q`` is
    (rows, cols / 2) uint8 nibbles (byte j of a block: values j and j + 16) or (rows, cols) int8."""

    fmt: int
    scale: torch.Tensor
    min: torch.Tensor | None
    q: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0], self.scale.shape[1] * BLOCK

    def kernel_args(self) -> tuple:
        min_ptr = None if self.min is None else self.min.data_ptr()
        return self.fmt, self.scale.data_ptr(), min_ptr, self.q.data_ptr()

    def unpack(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 rows ``rows`` (int64 ids), or the whole weight."""
        n = self.shape[0] if rows is None else rows.numel()
        out = torch.empty(n, self.shape[1])
        ids = None if rows is None else rows.to(torch.int64).contiguous()
        native.load_kernels().unpack_rows(
            out.data_ptr(), None if ids is None else ids.data_ptr(), n, *self.kernel_args(), self.shape[1]
        )
        return out


def _blocks_q4(w: torch.Tensor) -> GgufWeight:
    blocks = w.view(w.shape[0], -1, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    # GGUF stores the scale as fp16: (max - min) / 15 rounds back to it.
    scale = ((high - low) / 15).half().float()
    q = torch.where(scale[..., None] > 0, (blocks - low[..., None]) / scale[..., None], 0.0)
    q = q.round().clamp(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return GgufWeight(4, scale, low, nibbles.reshape(w.shape[0], -1))


def _blocks_q8(w: torch.Tensor) -> GgufWeight:
    blocks = w.view(w.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(-1) / 127
    q = torch.where(scale[..., None] > 0, blocks / scale[..., None], 0.0)
    return GgufWeight(8, scale, None, q.round().clamp(-127, 127).to(torch.int8).reshape(w.shape))


def _concat(parts: list[GgufWeight]) -> GgufWeight:
    first = parts[0]
    low = None if first.min is None else torch.cat([p.min for p in parts])
    return GgufWeight(first.fmt, torch.cat([p.scale for p in parts]), low, torch.cat([p.q for p in parts]))


def find_gguf_form(weight: torch.Tensor) -> GgufWeight | None:
    """The blocks ``weight`` (fp32, 2-D) was widened from, or None if it holds other values."""
    if native.load_kernels() is None or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if weight.shape[1] % BLOCK or not weight.is_contiguous():
        return None
    weight = weight.detach()
    for recover in (_blocks_q4, _blocks_q8):
        parts = []
        for start in range(0, weight.shape[0], _CHUNK_ROWS):
            chunk = weight[start : start + _CHUNK_ROWS]
            part = recover(chunk)
            if not torch.equal(part.unpack(), chunk):
                break
            parts.append(part)
        else:
            return _concat(parts)
    return None


class GgufLinear(nn.Module):
    """``nn.Linear`` over a ``GgufWeight`` (fp32 in, fp32 out)."""

    def __init__(self, weight: GgufWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self.kernel = native.load_kernels().small_linear_packed if self.out_features % 4 == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None or x.dim() != 2 or x.shape[0] >= MAX_ROWS or x.stride(1) != 1:
            return F.linear(x, self.weight.unpack(), self.bias)
        out = torch.empty(x.shape[0], self.out_features)
        bias = None if self.bias is None else self.bias.data_ptr()
        failed = self.kernel(
            out.data_ptr(), x.data_ptr(), x.shape[0], x.stride(0), *self.weight.kernel_args(), bias,
            self.in_features, self.out_features,
        )  # fmt: skip
        if failed:
            raise MemoryError("small_linear_packed: no memory for its tile buffers")
        return out


class GgufEmbedding(nn.Module):
    """``nn.Embedding`` over a ``GgufWeight``: looks up and widens only the rows asked for."""

    def __init__(self, weight: GgufWeight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.unpack(ids.reshape(-1)).view(*ids.shape, self.weight.shape[1])


def use_gguf_weights(model: nn.Module) -> int:
    """Swap every fp32 ``nn.Linear``/``nn.Embedding`` whose weight has a GGUF form for its
    GGUF module (a tied weight is recovered once and shared); returns how many were swapped."""
    forms: dict[int, GgufWeight | None] = {}
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) not in (nn.Linear, nn.Embedding) or child.weight.dtype != torch.float32:
                continue
            key = id(child.weight)
            if key not in forms:
                forms[key] = find_gguf_form(child.weight)
            form = forms[key]
            if form is None:
                continue
            if type(child) is nn.Embedding:
                setattr(parent, name, GgufEmbedding(form))
            else:
                bias = None if child.bias is None else child.bias.detach()
                setattr(parent, name, GgufLinear(form, bias))
            swapped += 1
    return swapped
