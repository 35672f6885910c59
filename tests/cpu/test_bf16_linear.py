"""bf16 linear layers on the CPU: ``Bf16Linear`` (``csrc/bf16_linear.c`` at decode sizes),
``Bf16TiledLinear`` (fp32 FMAs on bf16 tiles) and ``Bf16PairLinear`` (bf16 products on pair tiles)
against fp32 products rounded once, and which layout ``bf16_linear`` picks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln_cpu import native, packed_linear
from kiln_cpu.packed_linear import (
    KERNEL_MAX_ELEMENTS,
    KERNEL_MAX_ROWS,
    PAD_ROWS_FROM,
    Bf16Linear,
    Bf16PairLinear,
    Bf16TiledLinear,
    PackedLinear,
    bf16_linear,
    on_padded_rows,
    padded_rows,
)

needs_kernel = pytest.mark.skipif(
    not packed_linear.kernel_works(),
    reason="the bf16 linear kernel runs only with AMX, AVX512-BF16, or without oneDNN's bf16",
)


def _linear(k: int, n: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias).bfloat16()
    with torch.no_grad():
        linear.weight.normal_(0, k**-0.5)
        if bias:
            linear.bias.normal_(0, 1)
    return linear


def _exact(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """The fp32 product (plus bias) of the bf16 values, rounded once to bf16."""
    bias = None if linear.bias is None else linear.bias.float()
    return nn.functional.linear(x.float(), linear.weight.float(), bias).bfloat16()


def _assert_rounded_once(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within an ulp of the exact rounding, and mostly on it (the order of the sum differs)."""
    ulp = expected.float().abs().clamp_min(2**-100) * 2**-7
    assert ((got.float() - expected.float()).abs() <= ulp).all()
    assert (got == expected).float().mean() >= 0.98


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, 16])
@pytest.mark.parametrize(("k", "n", "bias"), [(64, 8, False), (96, 40, True), (576, 1024, False), (512, 24, True)])
def test_kernel_rows_are_the_fp32_products_rounded_once(monkeypatch, rows, k, n, bias):
    """Each output the fp32 sum rounded once (an ulp apart at most, and rarely: the order of
    the sum differs), bias added before the rounding; every row count of the kernel's blocks,
    and widths that end in a partial block of weight rows."""
    lib, calls = native.load_kernels(), []
    kernel = lib.linear_bf16
    monkeypatch.setattr(lib, "linear_bf16", lambda *a: calls.append(a[2]) or kernel(*a))
    linear = _linear(k, n, bias)
    x = torch.randn(rows, k).bfloat16()
    got, expected = Bf16Linear(linear)(x), _exact(x, linear)
    assert calls == [rows] and got.shape == (rows, n) and got.dtype == torch.bfloat16
    _assert_rounded_once(got, expected)


@pytest.mark.skipif(
    native.load_kernels() is None or not native.load_kernels().linear_bf16_amx(), reason="no AMX tiles for the kernel"
)
def test_on_amx_tiles_a_rows_outputs_do_not_depend_on_the_rows_beside_it():
    """On AMX the kernel multiplies every row count on the tiles (out^T = w x^T): each row's
    outputs, bit for bit, those it gets alone; K of several tile steps, a partial block of features."""
    linear = _linear(576, 72, True)
    layer = Bf16Linear(linear)
    x = torch.randn(KERNEL_MAX_ROWS, 576).bfloat16()
    for rows in (2, 5, KERNEL_MAX_ROWS):
        assert torch.equal(layer(x[:rows]), torch.cat([layer(x[i : i + 1]) for i in range(rows)]))


@pytest.mark.skipif(native.load_kernels() is None, reason="needs the CPU plugin's C kernels")
@pytest.mark.parametrize("rows", [1, 7, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_layer_is_the_fp32_products_rounded_once(rows, bias):
    """``Bf16TiledLinear``: bf16 in and out, the weight's bf16 values multiplied in fp32 (one pass,
    two, and four over each tile: the passes that ask for the next tile), bias before the
    rounding, leading dimensions kept."""
    linear = _linear(96, 64, bias)
    layer = Bf16TiledLinear(linear)
    x = torch.randn(rows, 96).bfloat16()
    got = layer(x)
    assert got.shape == (rows, 64) and got.dtype == torch.bfloat16
    _assert_rounded_once(got, _exact(x, linear))
    assert torch.equal(layer(x[None])[0], got)


@pytest.mark.skipif(native.load_kernels() is None, reason="needs the CPU plugin's C kernels")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize(("k", "n", "bias"), [(96, 64, True), (32, 80, False), (512, 48, True)])
def test_pair_layer_is_the_fp32_products_rounded_once(rows, k, n, bias):
    """``Bf16PairLinear``: bf16 in and out, each output the fp32 sum of the bf16 products rounded
    once (bias before the rounding), for every pass the kernel makes (a tile at a time in even
    passes of up to 16 rows up to 32 rows, two tiles at a time in passes of up to 8 past that) and
    widths that end in a tile left over from the pairs (5 and 3 tiles); the weight is found back
    from its tiles exactly, and leading dimensions are kept. vdpbf16ps where the build has it, the
    same sums in fp32 FMAs where not."""
    linear = _linear(k, n, bias)
    layer = Bf16PairLinear(linear)
    assert torch.equal(layer.dense_weight(), linear.weight)
    x = torch.randn(rows, k).bfloat16()
    got = layer(x)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    _assert_rounded_once(got, _exact(x, linear))
    assert torch.equal(layer(x[None])[0], got)
    with pytest.raises(RuntimeError):  # F.linear's refusal of mismatched dtypes, as nn.Linear's
        layer(x.float())


@needs_kernel
@pytest.mark.parametrize("fma_outruns", [False, True])
def test_more_rows_or_other_inputs_go_to_torch(monkeypatch, fma_outruns):
    """Past ``KERNEL_MAX_ROWS`` rows, ``widened_linear`` where FMAs outrun bf16 products, else
    ``F.linear`` on the same weight (past ``PAD_ROWS_FROM`` rows on padded rows); strided or fp32
    inputs too."""
    lib, calls = native.load_kernels(), []
    monkeypatch.setattr(lib, "linear_bf16", lambda *a: calls.append(a[2]))
    monkeypatch.setattr(native, "fma_outruns_bf16_dots", lambda: fma_outruns)
    widened, kernel = [], packed_linear.widened_linear
    monkeypatch.setattr(packed_linear, "widened_linear", lambda *a: widened.append(a[0].shape) or kernel(*a))
    linear = _linear(64, 48, True)
    layer = Bf16Linear(linear)
    prefill = torch.randn(KERNEL_MAX_ROWS + 1, 64).bfloat16()
    if fma_outruns:
        _assert_rounded_once(layer(prefill), _exact(prefill, linear))
    else:
        assert torch.equal(layer(prefill), linear(prefill))
    strided = torch.randn(4, 128).bfloat16()[:, ::2]
    assert torch.equal(layer(strided), linear(strided))
    with pytest.raises(RuntimeError):  # F.linear's refusal of mismatched dtypes
        layer(torch.randn(3, 64))
    assert calls == [] and widened == ([prefill.shape] if fma_outruns else [])
    padded = []
    pad = packed_linear.on_padded_rows
    monkeypatch.setattr(packed_linear, "on_padded_rows", lambda fn, x: padded.append(len(x)) or pad(fn, x))
    longer = torch.randn(PAD_ROWS_FROM + 5, 64).bfloat16()  # oneDNN's rows padded where it multiplies
    if fma_outruns:
        _assert_rounded_once(layer(longer), _exact(longer, linear))
    else:
        torch.testing.assert_close(layer(longer), linear(longer), rtol=2**-7, atol=1e-2)
    assert padded == ([] if fma_outruns else [len(longer)])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1 << 20, 96 * 5, 96 * 7, 95])
def test_widened_linear_is_the_fp32_products_rounded_once(monkeypatch, bias, chunk):
    """``widened_linear``: bf16 in and out, each output the fp32 sum of the bf16 values rounded
    once (bias before the rounding), the same whether the weight widens whole or a few rows at a
    time (5 and 7 of its 40 rows: a last slice shorter than the others; under one row: a row at a
    time), leading dimensions kept."""
    monkeypatch.setattr(packed_linear, "WIDEN_MAX_ELEMENTS", chunk)
    linear = _linear(96, 40, bias)
    x = torch.randn(2, 37, 96).bfloat16()
    bias_f32 = None if linear.bias is None else linear.bias.float()
    got = packed_linear.widened_linear(x, linear.weight, bias_f32)
    assert got.shape == (2, 37, 40) and got.dtype == torch.bfloat16
    _assert_rounded_once(got, _exact(x, linear))
    monkeypatch.setattr(packed_linear, "WIDEN_MAX_ELEMENTS", 1 << 20)
    assert torch.equal(got, packed_linear.widened_linear(x, linear.weight, bias_f32))


@needs_kernel
def test_decode_shaped_inputs_keep_their_leading_dims():
    linear = _linear(64, 32, False)
    x = torch.randn(1, 3, 64).bfloat16()
    assert torch.equal(Bf16Linear(linear)(x), Bf16Linear(linear)(x[0])[None])


@needs_kernel
def test_small_weights_take_the_kernel_and_large_ones_tiles_or_onednn():
    multiple = native.load_kernels().linear_bf16_multiple()
    assert type(bf16_linear(_linear(multiple * 2, 40, True))) is Bf16Linear
    # K the kernel cannot step through, and N no tiles: oneDNN's, or torch's own without oneDNN's bf16 (AVX2)
    unfit = _linear(multiple + 2, 40, True)
    assert type(bf16_linear(unfit)) is (PackedLinear if packed_linear.prepacking_works() else nn.Linear)
    big = nn.Linear(512, KERNEL_MAX_ELEMENTS // 512 + 16, bias=False, dtype=torch.bfloat16)
    # an LM head: the kernel on AMX tiles; bf16 products on pair tiles where they outrun FMAs, fp32 FMAs on bf16
    # tiles where those outrun bf16 products, else oneDNN
    assert type(bf16_linear(big)) is _big_layout()


def _big_layout() -> type:
    """The layout ``bf16_linear`` gives a weight past ``KERNEL_MAX_ELEMENTS`` (where the kernel runs)."""
    if native.has_amx_bf16() and packed_linear.kernel_works():
        return Bf16Linear
    if native.bf16_dots_outrun_fma():
        return Bf16PairLinear
    return Bf16TiledLinear if native.fma_outruns_bf16_dots() else PackedLinear


@pytest.mark.skipif(native.load_kernels() is None, reason="needs the CPU plugin's C kernels")
@pytest.mark.parametrize("fma_outruns", [False, True])
def test_without_onednn_bf16_weights_take_tiles_where_fmas_outrun_bf16_products(monkeypatch, fma_outruns):
    """Where oneDNN has no bf16 GEMM to prepack for (AVX2), every bf16 weight that tiles goes to
    ``Bf16TiledLinear`` where FMAs outrun bf16 products; otherwise, and for weights that do not
    tile, the layer stays as it is (torch's own bf16 matmul)."""
    monkeypatch.setattr(packed_linear, "prepacking_works", lambda: False)
    monkeypatch.setattr(packed_linear, "kernel_works", lambda: False)
    monkeypatch.setattr(native, "fma_outruns_bf16_dots", lambda: fma_outruns)
    small, untiled = _linear(64, 48, True), _linear(64, 40, False)
    assert type(bf16_linear(small)) is (Bf16TiledLinear if fma_outruns else nn.Linear)
    assert bf16_linear(untiled) is untiled


@pytest.mark.skipif(native.load_kernels() is None, reason="needs the CPU plugin's C kernels")
@pytest.mark.parametrize("prepacking", [False, True])
def test_the_kernel_runs_where_onednn_has_no_bf16_or_the_build_has_vdpbf16ps(monkeypatch, prepacking):
    """Without AMX, ``kernel_works`` holds where oneDNN has no bf16 GEMM (AVX2: the kernel's split
    bf16 words beat the tiles) and, beside oneDNN's, where the build multiplies with vdpbf16ps."""
    monkeypatch.setattr(packed_linear, "prepacking_works", lambda: prepacking)
    monkeypatch.setattr(native, "has_amx_bf16", lambda: False)
    native_dots = bool(native.load_kernels().linear_bf16_native())
    assert packed_linear.kernel_works.__wrapped__() is (native_dots or not prepacking)
    monkeypatch.setattr(native, "has_amx_bf16", lambda: True)  # then it runs on AMX tiles where the build has them
    assert packed_linear.kernel_works.__wrapped__() is bool(native.load_kernels().linear_bf16_amx())


def test_bf16_model_linears_take_the_layout_bf16_linear_picks(tiny_model_dir):
    from kiln import LLM

    model = LLM(tiny_model_dir("llama"), dtype="bfloat16", max_model_len=64).engine.executor.runner.model
    kinds = (Bf16Linear, Bf16TiledLinear, Bf16PairLinear, PackedLinear, nn.Linear)
    layers = [m for m in model.modules() if type(m) in kinds]
    if not packed_linear.prepacking_works() and not packed_linear.kernel_works():  # no C kernels: torch's own
        assert {type(m) for m in layers} == {nn.Linear}
        return
    kernel = {type(m) is Bf16Linear for m in layers if m.in_features * m.out_features <= KERNEL_MAX_ELEMENTS}
    assert kernel == {packed_linear.kernel_works()}  # the projections
    head = _big_layout()
    assert {type(m) for m in layers if m.in_features * m.out_features > KERNEL_MAX_ELEMENTS} == {head}


def test_bf16_dot_speed_is_timed_where_the_build_has_vdpbf16ps():
    """``bf16_dot_speed`` (which ``--dtype auto`` reads on AVX512-BF16 CPUs without AMX): the
    ratio of vdpbf16ps's to FMAs' multiply-adds a second, 2 or 0.5 on the CPUs measured, and 0
    where the library has no vdpbf16ps to time."""
    lib = native.load_kernels()
    speed = lib.bf16_dot_speed()
    if lib.linear_bf16_native():
        assert 0.1 < speed < 10
        assert native.bf16_dots_outrun_fma() == (speed > 1.0)
    else:
        assert speed == 0.0 and not native.bf16_dots_outrun_fma()


def test_padded_rows_add_at_most_an_eighth_and_few_counts():
    """Up to ``PAD_ROWS_FROM`` rows as they are; past it, each count rounds up by under an eighth
    to one of eight counts per power of two, so oneDNN compiles a few dozen GEMMs up to 8k rows,
    not thousands."""
    assert [padded_rows(n) for n in range(PAD_ROWS_FROM + 1)] == list(range(PAD_ROWS_FROM + 1))
    counts = {padded_rows(n) for n in range(PAD_ROWS_FROM + 1, 8193)}
    assert all(n <= padded_rows(n) < n * 9 / 8 for n in range(PAD_ROWS_FROM + 1, 8193))
    assert len(counts) <= 8 * 7 and padded_rows(500) == 512 and padded_rows(2049) == 2304


@pytest.mark.skipif(not packed_linear.prepacking_works(), reason="needs oneDNN's bf16 GEMM")
@pytest.mark.parametrize("shape", [(100,), (2, 50), (64,), (3, 1)])
def test_packed_layer_pads_prefill_rows_and_returns_its_own(monkeypatch, shape):
    """Past ``PAD_ROWS_FROM`` rows oneDNN multiplies zero-padded rows (one kernel for many counts);
    the layer returns the rows it was given, with their leading dims, as ``F.linear`` computes them."""
    linear = _linear(96, 40, True)
    layer = PackedLinear(linear)
    seen = []
    multiply = layer._linear
    monkeypatch.setattr(layer, "_linear", lambda x: seen.append(tuple(x.shape)) or multiply(x))
    x = torch.randn(*shape, 96).bfloat16()
    got = layer(x)
    assert got.shape == (*shape, 40)
    torch.testing.assert_close(got, nn.functional.linear(x, linear.weight, linear.bias), rtol=2**-7, atol=1e-2)
    rows = x.numel() // 96
    assert seen == [(padded_rows(rows), 96) if rows > PAD_ROWS_FROM else tuple(x.shape)]


def test_padding_drops_the_padding_rows():
    x = torch.arange(70 * 3, dtype=torch.float32).reshape(70, 3)
    padded = []
    got = on_padded_rows(lambda r: padded.append(r.clone()) or r.sum(-1, keepdim=True), x)
    assert padded[0].shape == (72, 3) and not padded[0][70:].any()
    assert torch.equal(got, x.sum(-1, keepdim=True))
