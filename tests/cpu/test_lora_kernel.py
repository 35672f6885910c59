"""The CPU plugin's LoRA kernel (csrc/lora.c) against the reference op."""

from __future__ import annotations

import pytest
import torch

from kiln.interfaces.lora import LoRAMapping
from kiln.interfaces.lora import add_lora as reference
from kiln_cpu import native
from kiln_cpu.fused_ops import add_lora

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="no C compiler")


@pytest.mark.parametrize(
    ("slices", "rank", "inputs", "bias"),
    [((96, 32, 32), 16, 64, True), ((40,), 8, 37, False), ((128, 128), 64, 256, False), ((12, 6, 6), 3, 20, True)],
)
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [5, 17, 1]])  # decodes; a prefill mix
def test_kernel_matches_the_reference(slices, rank, inputs, bias, query_lens):
    torch.manual_seed(0)
    slots = [2, -1, 0, 2][: len(query_lens)]
    a = torch.randn(3, len(slices) * rank, inputs)
    a[:, rank // 2 :] = 0  # ranks below the maximum are zero-padded
    b = torch.randn(3, sum(slices), rank)
    lora_bias = torch.randn(3, sum(slices)) if bias else None
    x = torch.randn(sum(query_lens), inputs)
    y = torch.randn(sum(query_lens), sum(slices))
    mapping = LoRAMapping.of(slots, query_lens, torch.device("cpu"))
    want = reference(y.clone(), x, a, b, lora_bias, mapping, slices)
    got = add_lora(y.clone(), x, a, b, lora_bias, mapping, slices)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    base_rows = mapping.token_slots < 0
    assert torch.equal(got[base_rows], y[base_rows])  # the base model's tokens untouched


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_slots_match_the_reference_in_fp32(bias):
    """bf16 adapter weights, fp32 activations: products and sums in fp32 on the widened weights."""
    torch.manual_seed(1)
    slices, rank = (40, 24, 24), 8
    a = torch.randn(2, 3 * rank, 48).bfloat16()
    b = torch.randn(2, sum(slices), rank).bfloat16()
    lora_bias = torch.randn(2, sum(slices)).bfloat16() if bias else None
    x, y = torch.randn(9, 48), torch.randn(9, sum(slices))
    mapping = LoRAMapping.of([1, 0, -1, 1], [4, 2, 2, 1], torch.device("cpu"))
    wide = reference(
        y.clone(), x, a.float(), b.float(), None if lora_bias is None else lora_bias.float(), mapping, slices
    )
    torch.testing.assert_close(add_lora(y.clone(), x, a, b, lora_bias, mapping, slices), wide, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_ranks_below_the_maximum_are_skipped_exactly(dtype, bias):
    """Slots of rank 3, 0 (the adapter leaves this projection alone) and 16 of 16: the kernel
    skips the zero padding, so only the real rows and columns count."""
    torch.manual_seed(2)
    slices, max_rank = (48, 16, 16), 16
    a = torch.randn(3, len(slices) * max_rank, 40)
    b = torch.randn(3, sum(slices), max_rank)
    for slot, rank in enumerate([3, 0, 16]):
        for i in range(len(slices)):
            a[slot, i * max_rank + rank : (i + 1) * max_rank] = 0
        b[slot, :, rank:] = 0
    a, b = a.to(dtype), b.to(dtype)
    lora_bias = torch.randn(3, sum(slices)).to(dtype) if bias else None
    x, y = torch.randn(10, 40), torch.randn(10, sum(slices))
    mapping = LoRAMapping.of([0, 1, 2, 1, 0], [3, 1, 4, 1, 1], torch.device("cpu"))
    wide = None if lora_bias is None else lora_bias.float()
    want = reference(y.clone(), x, a.float(), b.float(), wide, mapping, slices)
    torch.testing.assert_close(add_lora(y.clone(), x, a, b, lora_bias, mapping, slices), want, rtol=1e-5, atol=1e-4)


def test_other_dtypes_take_the_reference():
    x, y = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 4, dtype=torch.bfloat16)  # bf16 activations
    a, b = torch.randn(1, 2, 8, dtype=torch.bfloat16), torch.randn(1, 4, 2, dtype=torch.bfloat16)
    mapping = LoRAMapping.of([0], [2], torch.device("cpu"))
    torch.testing.assert_close(add_lora(y, x, a, b, None, mapping, (4,)), reference(y, x, a, b, None, mapping, (4,)))
