"""fp32 matmuls on weights laid out in tiles of 16 output features, for ``csrc/tiled_linear.c``.

The kernel (an outer-product micro-kernel: 16 features x 6 rows of activations per
pass) ran 1.5-3x as fast as MKL's sgemm at 16-64 rows on this project's AVX2 machine
and the default model's shapes, where sgemm streams weights slowly (16 rows through
the 576x49152 LM head: 13 ms instead of 42), and as fast from 512 rows on (100-157
vs 100-135 GFLOPS). Plain fp32 weights are copied into the tiled layout once.

GGUF models' weights stay in their 4/8-bit blocks, with exactly the fp32 values.
The loader widens a GGUF file's blocks to fp32, 4 bytes per weight instead of
0.6-1.1; ``find_gguf_form`` takes the blocks ``gguf_blocks`` recovers from the fp32
values and keeps them only when the kernels' own widening gives every value back bit
for bit, so a model computes exactly what it did in fp32 while its fp32 copy is
freed. A weight that did not come from such blocks (a random one) is tiled as fp32.
The kernel widens blocks a tile at a time in L1. Likewise a weight whose every value bf16 holds
(a bf16 checkpoint served in fp32, or the 16-bit parts of a quantized one) is kept in
bf16 tiles: the same products from half the bytes.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln_cpu import form_cache, native
from kiln_cpu.gguf_blocks import BLOCK, CHUNK_ROWS, Blocks, recover_blocks
from kiln_cpu.module_swap import child_slots

TILE = 16  # output features the kernel computes together
F16_SCALES = 0x100  # kernel_args' fmt flag: scale and min arrays in fp16 (csrc/vec.h)


@dataclass(slots=True, eq=False)
class TiledWeight:
    """An (N, K) weight in tiles of 16 output features. ``fmt`` 32: ``q`` (N/16, K, 16) fp32,
    a tile's values for one input position together; ``fmt`` 16: the same in bf16. ``fmt`` 4: value = nibble * scale + min
    (GGUF's Q4_1, Q4_K), ``q`` (N/16, K/32, 4, 16, 4) uint8; ``fmt`` 8: value = int8 * scale (Q8_0),
    + min if there is one (Q5_1, Q5_K), ``q`` (N/16, K/32, 8, 16, 4) int8; ``fmt`` 6: fmt 8 with a
    scale per 16 inputs (Q3_K, Q6_K), and a min per 32 if there is one (rows of mixed types).
    A tile's block of 32 inputs lies as (group of 4 inputs, feature, input): the layout of
    integer dot products (``csrc/int8_linear.c``); a 4-bit byte holds input 4g + i low and
    16 + 4g + i high. ``scale`` and ``min``: (N/16, K/32, 16) fp32, per 32 inputs per feature
    (fmt 6's scale: (N/16, K/16, 16)), or fp16 where fp16 holds them exactly (``narrow_scales``)."""

    fmt: int
    scale: torch.Tensor | None
    min: torch.Tensor | None
    q: torch.Tensor
    shape: tuple[int, int] = field(init=False)  # (N, K)
    kernel_args: tuple = field(init=False)  # fmt and pointers, as the C kernels take them: built once

    def __post_init__(self) -> None:
        self.shape = self.q.shape[0] * TILE, self.q.shape[1] * (1 if self.fmt in (16, 32) else BLOCK)
        fmt = self.fmt | (F16_SCALES if self.scale is not None and self.scale.dtype == torch.float16 else 0)
        self.kernel_args = (fmt, *(None if t is None else t.data_ptr() for t in (self.scale, self.min, self.q)))

    def unpack(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 rows ``rows`` (ids), or the whole weight."""
        lib, (n, k) = native.load_kernels(), self.shape
        if rows is None:
            out = torch.empty(n, k)
            if lib.tiled_unpack(out.data_ptr(), *self.kernel_args, k, n):
                raise MemoryError("tiled_unpack: no memory for its tile buffers")
            return out
        ids = rows.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), k)
        lib.tiled_gather_rows(out.data_ptr(), ids.data_ptr(), ids.numel(), *self.kernel_args, k)
        return out


def pack_tiles(per_row: torch.Tensor) -> torch.Tensor:
    """(N, X) per-row values -> (N/16, X, 16): a tile's 16 features side by side."""
    return per_row.view(-1, TILE, per_row.shape[1]).transpose(1, 2).contiguous()


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> ``TiledWeight`` fmt 4's packed bytes."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n // TILE, TILE, k // BLOCK, 2, 4, 4)  # tile, feature, block, half, group, input
    low, high = (c[:, :, :, h].permute(0, 2, 3, 1, 4) for h in (0, 1))
    return (low | (high << 4)).contiguous()


def pack_q8(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 codes -> ``TiledWeight`` fmt 8's bytes."""
    n, k = codes.shape
    return codes.to(torch.int8).view(n // TILE, TILE, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).contiguous()


def _tiles(blocks: Blocks) -> TiledWeight:
    codes = pack_q4(blocks.codes) if blocks.fmt == 4 else pack_q8(blocks.codes)
    return TiledWeight(
        blocks.fmt, pack_tiles(blocks.scale), None if blocks.min is None else pack_tiles(blocks.min), codes
    )


def _tileable(weight: torch.Tensor) -> bool:
    return (
        native.load_kernels() is not None
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and (weight.shape[0] % TILE == 0 and weight.is_contiguous())
    )


def _widens_to(form: TiledWeight, weight: torch.Tensor) -> bool:
    """Whether the kernels' own widening of ``form`` gives every value of ``weight`` back."""
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        tiles = slice(start // TILE, (start + CHUNK_ROWS) // TILE)
        low = None if form.min is None else form.min[tiles]
        if not torch.equal(
            TiledWeight(form.fmt, form.scale[tiles], low, form.q[tiles]).unpack(), weight[start : start + CHUNK_ROWS]
        ):
            return False
    return True


def _laid_out_for(fmt: int, scale, low, q, shape: tuple[int, int]) -> bool:
    """Whether tensors read back from disk have the layout of an (N, K) ``fmt`` form (the kernels
    trust the shapes: a mismatch would read past the end). The packers' shapes are spelled out:
    running them on meta tensors imports torch._dynamo, ~2 s of a server's start."""
    tiles, blocks = shape[0] // TILE, shape[1] // BLOCK
    codes = {4: torch.uint8, 6: torch.int8, 8: torch.int8}
    return (
        fmt in codes
        and (q.dtype, tuple(q.shape)) == (codes[fmt], (tiles, blocks, 4 if fmt == 4 else 8, TILE, 4))
        and scale is not None
        and scale.dtype in (torch.float32, torch.float16)  # fp16: narrowed (min too: one flag reads both)
        and tuple(scale.shape) == (tiles, blocks * (2 if fmt == 6 else 1), TILE)
        and (low is None or (low.dtype, tuple(low.shape)) == (scale.dtype, (tiles, blocks, TILE)))
    )


def narrow_scales(form: TiledWeight) -> TiledWeight:
    """``form`` with its scales and mins in fp16 where fp16 holds every one exactly, as GGUF's own
    (Q4_0/Q4_1/Q8_0/Q5_x keep them in fp16; K-quants' are products, which it often does not): the
    same values, and a Q4_1 block reads 320 bytes instead of 384. A decode step of the default
    model reads ~13 MB less."""
    if form.scale.dtype == torch.float16:  # kept narrowed (a kept form's min shares its scale's dtype)
        return form
    parts = [t for t in (form.scale, form.min) if t is not None]
    if not all(torch.equal(t.half().float(), t) for t in parts):
        return form
    return TiledWeight(form.fmt, form.scale.half(), None if form.min is None else form.min.half(), form.q)


def find_gguf_form(weight: torch.Tensor) -> TiledWeight | None:
    """The blocks ``weight`` (fp32, 2-D) was widened from (``gguf_blocks``) in tiles, or None if
    it holds other values: Q4_1 and Q8_0 as they are, Q4_0 and Q4_K as 4-bit codes with a min,
    Q5_0 as 8-bit codes, Q5_1 and Q5_K as 8-bit codes with a min, Q3_K and Q6_K as 8-bit codes
    with a scale per 16 values, rows of several types as 8-bit codes with a min. A large
    weight's form is kept on disk (``form_cache``) and taken from there when it fits; its scales and
    mins go to fp16 where that holds them exactly (``narrow_scales``)."""
    if not _tileable(weight) or weight.shape[1] % BLOCK:
        return None
    weight = weight.detach()
    name = form_cache.fingerprint(weight)
    kept = None if name is None else form_cache.load(name)
    if kept is not None and _laid_out_for(*kept, tuple(weight.shape)):
        form = narrow_scales(TiledWeight(*kept))
        if _widens_to(form, weight):
            return form
    blocks = recover_blocks(weight, TILE)
    if blocks is None:
        return None
    form = narrow_scales(_tiles(blocks))  # kept so too: a cached start never holds the fp32 arrays
    if not _widens_to(form, weight):
        return None
    if name is not None:
        form_cache.store(name, form.fmt, form.scale, form.min, form.q)
    return form


def _bf16_form(weight: torch.Tensor) -> TiledWeight | None:
    """``weight`` as bf16 tiles if bf16 holds every value exactly (a bf16 checkpoint served in
    fp32), else None."""
    weight = weight.detach()
    for start in range(0, weight.shape[0], CHUNK_ROWS):  # checked in chunks: bounds the temporary copies
        chunk = weight[start : start + CHUNK_ROWS]
        if not torch.equal(chunk.to(torch.bfloat16).float(), chunk):
            return None
    return TiledWeight(16, None, None, pack_tiles(weight.to(torch.bfloat16)))


def tiled_form(weight: torch.Tensor) -> TiledWeight | None:
    """``weight`` (fp32, 2-D) as GGUF blocks if it came from them, as bf16 tiles if bf16 holds
    it exactly (the same products, half the bytes to read), else as fp32 tiles; None when its
    shape or the missing kernels rule all out."""
    if not _tileable(weight):
        return None
    # KILN_CPU_GGUF_BLOCKS=0 keeps every weight in fp32 tiles: a true fp32 baseline.
    if os.environ.get("KILN_CPU_GGUF_BLOCKS", "1") != "0":
        narrow = find_gguf_form(weight) or _bf16_form(weight)
        if narrow is not None:
            return narrow
    return TiledWeight(32, None, None, pack_tiles(weight.detach()))


INT8_PER_BLOCK, INT8_PER_ROW = 1, 2  # int8 activations: a scale per 32 inputs (llama.cpp's), or per row


def tiled_matmul(
    weight: TiledWeight, x: torch.Tensor, bias: torch.Tensor | None, int8_activations: int = 0
) -> torch.Tensor:
    """``x @ W.T + bias`` for fp32 rows ``x`` (..., in) through the C kernel. With
    ``int8_activations`` (``INT8_PER_BLOCK`` or ``INT8_PER_ROW``) and a block-format W, ``x`` is
    quantized to int8 per 32 inputs or per row and multiplied in integers
    (``csrc/int8_linear.c``), else W is widened to fp32."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features)
    lib = native.load_kernels()
    args = (
        out.data_ptr(), rows.data_ptr(), rows.shape[0], rows.stride(0), *weight.kernel_args,
        None if bias is None else bias.data_ptr(), in_features, out_features,
    )  # fmt: skip
    # int8_linear leaves fp32 tiles to tiled_linear
    failed = lib.int8_linear(*args, int8_activations == INT8_PER_ROW) if int8_activations else lib.tiled_linear(*args)
    if failed:
        raise MemoryError("tiled matmul: no memory for its buffers")
    return out.view(*x.shape[:-1], out_features)


class TiledLinear(nn.Module):
    """``nn.Linear`` over a ``TiledWeight`` (fp32 in, fp32 out); ``int8_activations``: see
    ``tiled_matmul``; ``perm``: the order the weight reads its inputs in (GPTQ's act-order), or None."""

    def __init__(
        self, weight: TiledWeight, bias: torch.Tensor | None, int8_activations: int = 0,
        perm: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.weight, self.bias, self.int8_activations, self.perm = weight, bias, int8_activations, perm
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_matmul(
            self.weight, x if self.perm is None else x[..., self.perm], self.bias, self.int8_activations
        )


class TiledEmbedding(nn.Module):
    """``nn.Embedding`` over a ``TiledWeight``: looks up and widens only the rows asked for."""

    def __init__(self, weight: TiledWeight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.unpack(ids.reshape(-1)).view(*ids.shape, self.weight.shape[1])


def use_tiled_weights(model: nn.Module, int8_activations: bool = False) -> tuple[int, int]:
    """Swap every fp32 ``nn.Linear``/``nn.Embedding`` whose weight can be tiled for its tiled
    module (a tied weight is converted once and shared); returns how many were swapped and
    how many of them hold GGUF blocks. ``int8_activations``: linear layers over GGUF blocks
    multiply in integers (see ``tiled_matmul``). Each original weight is freed as soon as no
    module holds it."""
    # NOTE: keyed by id() with a weak reference to check it is still that tensor: holding the
    # tensors themselves would keep every fp32 original alive until the end.
    forms: dict[int, tuple[weakref.ref, TiledWeight | None]] = {}
    swapped = gguf = 0
    for parent, name in child_slots(model, (nn.Linear, nn.Embedding)):
        child = getattr(parent, name)
        seen = forms.get(id(child.weight))
        if seen is None or seen[0]() is not child.weight:
            seen = forms[id(child.weight)] = (weakref.ref(child.weight), tiled_form(child.weight))
        form = seen[1]
        if form is None:
            continue
        if type(child) is nn.Embedding:
            setattr(parent, name, TiledEmbedding(form))
        else:
            bias = None if child.bias is None else child.bias.detach()
            setattr(parent, name, TiledLinear(form, bias, INT8_PER_BLOCK if int8_activations else 0))
        swapped += 1
        gguf += form.fmt in (4, 6, 8)
    return swapped, gguf
