"""bf16 linear layers in the layouts their matmuls prefer (``Platform.process_weights``).

``F.linear`` on a plain bf16 weight reorders it on every call; at decode batch sizes
that costs as much as the multiply (measured on this project's machines: a 576x576
projection for 16 tokens, 106 us plain vs 74 us prepacked, identical results), so
``PackedLinear`` keeps the weight prepacked once for oneDNN. The packed layout keeps the
same number of elements, so memory does not grow.

Where the CPU has AVX512-BF16 but no AMX, ``Bf16Linear`` runs decode-sized calls in the
plugin's own kernel (``csrc/bf16_linear.c``) on the plain weight instead: oneDNN's call
costs ~50 us more than its products once a step's streamed weights have pushed its state
out of the caches (16 rows of 512x1024: 57 us against 108 prepacked), and the weight is
read as stored. It is used for weights up to ``KERNEL_MAX_ELEMENTS``: past that oneDNN's
blocked GEMM makes up for its overhead at 16 rows (an LM head, 512x49152: 1.4 against
1.9 ms), and with SmolLM2-135M in bf16 at 16 sequences the kernel on its 576x3072
gate_up too was 2 % slower a step, neutral without it; at one sequence it is 5-10 % faster.
With AMX the kernel multiplies on the tiles (``tdpbf16ps``), the weight as stored, for weights
of any size: it streams them at about the memory's rate for 1-16 rows, where oneDNN's per-call
costs came first (SmolLM2-135M unquantized in bf16 at one sequence on a 2-core AMX Xeon:
20.3-25.0 ms a token against 28.7-34.6 with every layer prepacked, and 25.0-37.1 with the kernel
on weights of up to ``KERNEL_MAX_ELEMENTS`` only). Prefills still go to oneDNN (at 512 rows
it was 1.3-1.6x as fast as the kernel).

Where vdpbf16ps multiplies fewer values a cycle than fp32 FMAs (a Xeon whose AMX the VM
hides: half as many), weights past that size (an LM head, a large projection) are kept in
bf16 tiles instead and multiplied in fp32 by the tile kernel (``Bf16TiledLinear``): the same
products from the same bytes, at the FMA rate. Where oneDNN has no bf16 GEMM (AVX2, without bf16
instructions, where torch's own bf16 matmul is far slower), small weights take ``Bf16Linear``
(its kernel splits each bf16 word into two fp32 values) and larger ones that tile the tiles.
Where FMAs outrun bf16 products, prefill-sized products of plain bf16 weights (``Bf16Linear``'s
past ``KERNEL_MAX_ROWS`` rows, a mixture of experts' beyond decode sizes) run as fp32 GEMMs on
widened copies (``widened_linear``): on a 2-core Xeon without AMX, 512 rows of a 512x2048
projection took 3.6 ms against oneDNN's 6.4 in bf16.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
from torch import nn

from kiln_cpu import native
from kiln_cpu.tiled_weights import TILE, TiledLinear, TiledWeight, pack_tiles

logger = logging.getLogger("kiln.cpu")

# The batch size oneDNN tunes the packed layout for; 256 was as fast as any
# other hint for 1-16 tokens and within 10% of plain F.linear at 2048.
BATCH_HINT = 256
KERNEL_MAX_ROWS = 16  # a decode step's rows; more (prefills) go to oneDNN
# oneDNN compiles a kernel for each row count it multiplies: on a 2-core AMX Xeon a new count of
# ~500 rows through a 2048x512 bf16 weight took 6-7 ms, the product itself 0.6. A server's
# prefill and mixed steps, and a prefill's experts, bring new counts all the time, so bf16 GEMMs
# past PAD_ROWS_FROM rows run on their rows padded with zeros (``padded_rows``).
PAD_ROWS_FROM = 64
KERNEL_MAX_ELEMENTS = 1 << 20  # 2 MB of bf16 weight
WIDEN_MAX_ELEMENTS = 1 << 20  # of a weight widened at once by widened_linear: 4 MB of fp32


@cache
def prepacking_works() -> bool:
    """oneDNN with bf16 support is present, and a packed matmul matches ``F.linear``."""
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        w = torch.randn(24, 16).bfloat16()
        x = torch.randn(3, 16).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return torch.equal(got, nn.functional.linear(x, w))
    except (RuntimeError, AttributeError) as exc:
        logger.info("oneDNN prepacking unavailable: %s", exc)
        return False


@cache
def kernel_works() -> bool:
    """The C kernel outruns the other layouts at decode sizes: with AMX, where it multiplies on
    the tiles (the default model's 30 layers of bf16 projections on a 2-core AMX Xeon, 1-16 rows:
    12.3-14.0 ms a pass against oneDNN's prepacked 28-29); without, where it is built with vdpbf16ps
    products or oneDNN has no bf16 GEMM (AVX2). There its fp32 products of bf16 words split in two
    beat the tiles: under AVX2 on a 2-core Xeon, one row of 512x1024 took 20 against 44 us, 16
    rows 124 against 141; from memory 51-59 against 91-208 and 157-162 against 178-189."""
    lib = native.load_kernels()
    if lib is None:
        return False
    if native.has_amx_bf16():
        return bool(lib.linear_bf16_amx())
    return bool(lib.linear_bf16_native()) or not prepacking_works()


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of bf16 ``x`` and ``weight`` (N, K) through fp32 GEMMs on their widened values,
    each output (plus ``bias``, fp32) summed in fp32 and rounded to bf16 once: oneDNN's bf16 GEMM's
    products, at the FMA rate. The weight widens up to ``WIDEN_MAX_ELEMENTS`` values at a time
    (whole rows), so that a large one never has a whole fp32 copy."""
    rows = weight.shape[0] if weight.shape[1] == 0 else max(1, WIDEN_MAX_ELEMENTS // weight.shape[1])
    xf = x.float()
    if rows >= weight.shape[0]:
        return nn.functional.linear(xf, weight.float(), bias).to(x.dtype)
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    for n in range(0, weight.shape[0], rows):
        part = None if bias is None else bias[n : n + rows]
        out[..., n : n + rows] = nn.functional.linear(xf, weight[n : n + rows].float(), part)
    return out


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to the next of eight steps per power of two past ``PAD_ROWS_FROM``:
    at most an eighth more rows, and a few dozen counts for oneDNN to compile up to 8k rows."""
    if rows <= PAD_ROWS_FROM:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def on_padded_rows(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (a linear layer, an MLP), run on ``x``'s rows padded with
    zero rows to ``padded_rows``; the padding's outputs are dropped."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = padded_rows(rows)
    if padded == rows:
        return fn(x)
    buffer = x.new_zeros(padded, x.shape[-1])
    buffer[:rows] = x.reshape(rows, x.shape[-1])
    out = fn(buffer)
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight, BATCH_HINT))
            self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return on_padded_rows(self._linear, x)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Bf16Linear(nn.Module):
    """A bf16 linear layer on its plain weight: ``csrc/bf16_linear.c`` for up to
    ``KERNEL_MAX_ROWS`` contiguous bf16 rows (each output summed in fp32 and rounded once,
    bias included, as oneDNN does); more bf16 rows through ``widened_linear`` where FMAs outrun
    bf16 products, else ``F.linear`` (on padded rows past ``PAD_ROWS_FROM``). That reorders the
    weight every call (there is no packed copy: it would double these layers' memory), which
    costs 3-10 % on these small layers at prefill sizes (2048 rows of 512x1024: 2.18 against
    2.12 ms packed; of 1536x576: 3.9 against 3.6 ms)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.register_buffer("weight", linear.weight.detach().contiguous())
            self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
            self.register_buffer("bias_f32", None if linear.bias is None else self.bias.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if rows > KERNEL_MAX_ROWS and x.dtype == torch.bfloat16:
            if native.fma_outruns_bf16_dots():
                return widened_linear(x, self.weight, self.bias_f32)
            return on_padded_rows(self._onednn, x)
        if not 0 < rows <= KERNEL_MAX_ROWS or x.dtype != torch.bfloat16 or not x.is_contiguous():
            return nn.functional.linear(x, self.weight, self.bias)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        bias = None if self.bias_f32 is None else self.bias_f32.data_ptr()
        lib = native.load_kernels()
        if lib.linear_bf16(out.data_ptr(), x.data_ptr(), rows, self.in_features, self.weight.data_ptr(), bias,
                           self.out_features):  # fmt: skip
            raise MemoryError("linear_bf16: no memory for its last block")
        return out

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class Bf16PairLinear(nn.Module):
    """A bf16 linear layer on its weight in pair tiles (``csrc/bf16_linear.c``'s
    ``linear_bf16_pairs``: 16 features' values at two inputs to a 64-byte line), multiplied with
    ``vdpbf16ps``, each output (bias included) summed in fp32 and rounded to bf16 once: for weights
    too large for ``Bf16Linear`` where bf16 products outrun FMAs (AMD Zen 4 and 5): 16 rows of a
    49152x512 LM head from memory took 1.3 ms against oneDNN's prepacked 1.9 on a 2-core Zen 5
    EPYC (1 row 1.2 against 1.4; at 64 rows, where the products set the pace, 5.4 against 4.4).
    Any number of bf16 rows (an LM head's are one per sequence sampled); other dtypes go to
    ``F.linear`` on the weight found back from the tiles, which refuses them as ``nn.Linear``
    would."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        n, k = self.out_features, self.in_features
        with torch.no_grad():
            pairs = linear.weight.detach().reshape(n // TILE, TILE, k // 2, 2).transpose(1, 2).contiguous()
            self.register_buffer("pairs", pairs)
            self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
            self.register_buffer("bias_f32", None if linear.bias is None else self.bias.float(), persistent=False)

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        """Whether the weight makes whole tiles (16 features) of whole pairs of inputs."""
        return linear.out_features % TILE == 0 and linear.in_features % 2 == 0

    def dense_weight(self) -> torch.Tensor:
        """The (N, K) weight, found back from the tiles."""
        return self.pairs.transpose(1, 2).reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if rows == 0 or x.dtype != torch.bfloat16:
            return nn.functional.linear(x, self.dense_weight(), self.bias)
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], self.out_features)
        bias = None if self.bias_f32 is None else self.bias_f32.data_ptr()
        native.load_kernels().linear_bf16_pairs(
            out.data_ptr(), x.data_ptr(), rows, self.in_features, self.pairs.data_ptr(), bias, self.out_features
        )
        return out


class Bf16TiledLinear(TiledLinear):
    """A bf16 linear layer on its weight in bf16 tiles (``TiledWeight`` fmt 16): bf16 rows
    widened to fp32, multiplied by ``csrc/tiled_linear.c`` with fp32 FMAs, each output (bias
    included) summed in fp32 and rounded to bf16 once, as oneDNN does. 16 rows through a
    49152x512 LM head on a 2-core Xeon without AMX: 3.9 ms against oneDNN's 5.1."""

    def __init__(self, linear: nn.Linear) -> None:
        bias = None if linear.bias is None else linear.bias.detach().float()
        super().__init__(TiledWeight(16, None, None, pack_tiles(linear.weight.detach())), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).to(x.dtype)


def bf16_linear(linear: nn.Linear) -> nn.Module:
    """The layout for a bf16 ``nn.Linear``: ``Bf16Linear`` where its kernel runs and the weight
    is small enough (with AMX, of any size); ``Bf16TiledLinear`` where FMAs outrun bf16 products
    and the weight is past that size, or oneDNN has no bf16 GEMM to prepack for (AVX2, where
    torch's own bf16 matmul took 6x as long as the tiles at 512 rows and 3.5x at 16, level at
    one); ``Bf16PairLinear`` for a weight past that size where bf16 products outrun FMAs; else
    ``PackedLinear``, or the layer as it is without oneDNN's bf16."""
    small = linear.weight.numel() <= KERNEL_MAX_ELEMENTS or native.has_amx_bf16()  # AMX: any size
    if small and kernel_works() and linear.in_features % native.load_kernels().linear_bf16_multiple() == 0:
        return Bf16Linear(linear)
    tiles = linear.out_features % TILE == 0 and native.fma_outruns_bf16_dots()
    if tiles and (not small or not prepacking_works()):
        return Bf16TiledLinear(linear)
    if not small and Bf16PairLinear.fits(linear) and native.bf16_dots_outrun_fma():
        return Bf16PairLinear(linear)
    return PackedLinear(linear) if prepacking_works() else linear
