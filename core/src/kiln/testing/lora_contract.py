"""The contract of a platform's ``add_lora`` op (``kiln.interfaces.lora``).

Plugin authors subclass it in their own tests::

    from kiln.testing.lora_contract import LoRAOpsContract

    class TestMyLoRA(LoRAOpsContract):
        ops = MyPlatform().custom_ops()
        device = "mine"
        dtypes = (torch.float16, torch.bfloat16)

Each case mixes tokens of several adapter slots and of the base model (slot -1), in decode
and prefill shapes, with merged projections (several output slices), slots of ranks below
the maximum (zero-padded, as ``LoRALinear`` fills them), and with and without a bias.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import pytest
import torch

from kiln.interfaces.lora import LoRAMapping
from kiln.interfaces.lora import add_lora as reference

# (slices, max rank, in_features, bias)
CASES = [
    ((96, 32, 32), 16, 64, True), ((40,), 8, 37, False), ((64, 64), 32, 128, False), ((12, 6, 6), 3, 20, True),
    ((200,), 32, 1000, False),  # a long reduction over few outputs (where GPU kernels split K)
]  # fmt: skip
# (each request's slot, its tokens): decodes only, prefills beside decodes, one slot's long run
BATCHES = {
    "decodes": ([2, -1, 0, 2, 1, 0], [1] * 6),
    "prefills": ([1, -1, 2, 0], [5, 3, 17, 1]),
    "long-segment": ([1, 1, -1, 1], [70, 3, 4, 1]),
}


class LoRAOpsContract:
    """``ops["add_lora"]`` against the reference: values within ``atol``/``rtol``, the base
    model's rows left exactly as they were, the result's shape and dtype those of ``y``."""

    ops: ClassVar[dict[str, Callable]]
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    atol: ClassVar[dict[torch.dtype, float]] = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 2e-1}
    rtol: ClassVar[dict[torch.dtype, float]] = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}

    @pytest.mark.parametrize("batch", list(BATCHES))
    @pytest.mark.parametrize("case", range(len(CASES)), ids=[f"slices{c[0]}-r{c[1]}" for c in CASES])
    def test_add_lora_matches_reference(self, case: int, batch: str) -> None:
        op = self.ops.get("add_lora")
        if op is None:
            pytest.skip("the platform does not override add_lora: the reference runs")
        slices, max_rank, inputs, bias = CASES[case]
        slots, query_lens = BATCHES[batch]
        gen = torch.Generator().manual_seed(case)
        for dtype in self.dtypes:
            a = torch.randn(3, len(slices) * max_rank, inputs, generator=gen) / inputs**0.5
            b = torch.randn(3, sum(slices), max_rank, generator=gen) / max_rank**0.5
            for slot, rank in enumerate([max_rank, max_rank // 2, 1]):  # ranks below the maximum: zero-padded
                for i in range(len(slices)):
                    a[slot, i * max_rank + rank : (i + 1) * max_rank] = 0
                b[slot, :, rank:] = 0
            lora_bias = torch.randn(3, sum(slices), generator=gen) if bias else None
            x = torch.randn(sum(query_lens), inputs, generator=gen)
            y = torch.randn(sum(query_lens), sum(slices), generator=gen)
            args = [t if t is None else t.to(dtype).to(self.device) for t in (y, x, a, b, lora_bias)]
            mapping = LoRAMapping.of(slots, query_lens, torch.device(self.device))
            want = reference(args[0].clone(), *args[1:], mapping, slices)
            before = args[0].clone()
            got = op(args[0], *args[1:], mapping, slices)
            assert (got.shape, got.dtype) == (want.shape, want.dtype), f"{got.shape} {got.dtype} ({dtype})"
            torch.testing.assert_close(got.float(), want.float(), atol=self.atol[dtype], rtol=self.rtol[dtype])
            base = (mapping.token_slots < 0).to(got.device)
            assert torch.equal(got[base], before[base]), f"add_lora changed the base model's rows ({dtype})"
