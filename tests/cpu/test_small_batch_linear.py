"""fp32 linears on the CPU: the transposed product for decode-sized batches gives F.linear's
result, and wrapping keeps the model's parameters (tied embeddings stay one tensor)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln_cpu.platform import replace_linears
from kiln_cpu.small_batch_linear import SmallBatchLinear


@pytest.mark.parametrize("rows", [1, 7, 64, 127, 128, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    got = SmallBatchLinear(linear)(x)
    assert got.is_contiguous() and got.shape == (rows, 200)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_wrapping_keeps_tied_weights_and_skips_other_dtypes():
    embed = nn.Embedding(50, 16)
    model = nn.ModuleDict({"head": nn.Linear(16, 50, bias=False), "narrow": nn.Linear(16, 16).bfloat16()})
    model["head"].weight = embed.weight
    assert replace_linears(model, {torch.float32: SmallBatchLinear}) == 1
    assert isinstance(model["head"], SmallBatchLinear) and model["head"].weight is embed.weight
    assert type(model["narrow"]) is nn.Linear
