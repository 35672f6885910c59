"""fp32 linears on the CPU: the small-batch kernel gives F.linear's result, and wrapping
keeps the model's parameters (tied embeddings stay one tensor)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln_cpu import native
from kiln_cpu.platform import replace_linears
from kiln_cpu.small_batch_linear import SmallBatchLinear

needs_kernels = pytest.mark.skipif(native.load_kernels() is None, reason="no C compiler for the CPU kernels")


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 127, 128, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    wrapped = SmallBatchLinear(linear)
    assert wrapped.kernel is not None
    x = torch.randn(rows, 96)
    got = wrapped(x)
    assert got.is_contiguous() and got.shape == (rows, 200)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_strided_rows_and_shapes_the_kernel_skips():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(5, 80)[:, 8:72]  # rows 80 apart, as a slice of a wider activation
    torch.testing.assert_close(SmallBatchLinear(linear)(x), F.linear(x, linear.weight, linear.bias))
    odd = nn.Linear(60, 30)  # in_features % 8 and out_features % 4 not met: F.linear
    wrapped = SmallBatchLinear(odd)
    assert wrapped.kernel is None
    y = torch.randn(3, 60)
    torch.testing.assert_close(wrapped(y), F.linear(y, odd.weight, odd.bias))


def test_wrapping_keeps_tied_weights_and_skips_other_dtypes():
    embed = nn.Embedding(52, 16)
    model = nn.ModuleDict({"head": nn.Linear(16, 52, bias=False), "narrow": nn.Linear(16, 16).bfloat16()})
    model["head"].weight = embed.weight
    assert replace_linears(model, {torch.float32: SmallBatchLinear}) == 1
    assert isinstance(model["head"], SmallBatchLinear) and model["head"].weight is embed.weight
    assert type(model["narrow"]) is nn.Linear
