"""Mixture-of-experts weights packed for the CPU kernels (``kiln_cpu.experts``): the plugin's
``fused_experts`` over them equals the reference over the stacked weights, in fp32 (tiled C
kernel) and bf16 (oneDNN prepacked), including another rank's experts (id -1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.interfaces.model import REFERENCE_OPS
from kiln_cpu import native
from kiln_cpu.experts import PackedExperts, use_packed_experts
from kiln_cpu.fused_ops import fused_experts
from kiln_cpu.packed_linear import prepacking_works

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="the C kernels did not build")


class Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w13 = nn.Parameter((torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype))
        self.w2 = nn.Parameter((torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype))


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_experts_match_the_reference(dtype, tokens):
    if dtype == torch.bfloat16 and not prepacking_works():
        pytest.skip("no oneDNN bf16 prepacking here")
    module = Experts(8, 64, 96, dtype)
    w13, w2 = module.w13.detach().clone(), module.w2.detach().clone()
    assert use_packed_experts(module) == 1
    assert isinstance(module.w13, PackedExperts) and not list(module.parameters())  # the originals are freed
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 64, generator=gen).to(dtype)
    weights, ids = REFERENCE_OPS["moe_route"](torch.randn(tokens, 8, generator=gen), 2, True)
    ids[0, 1] = -1  # another rank's expert
    expected = REFERENCE_OPS["fused_experts"](x, w13, w2, weights, ids)
    got = fused_experts(x, module.w13, module.w2, weights, ids)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, expected, **tol)


def test_without_the_c_kernels_the_experts_stay_stacked(tiny_model_dir):
    """KILN_CPU_NATIVE=0 (or no compiler): no plugin fused_experts to read packed experts, so the
    platform leaves them as they are and the reference runs them (bf16: oneDNN alone could pack)."""
    import os
    import subprocess
    import sys

    code = (
        "from kiln import LLM, SamplingParams\n"
        f"llm = LLM({tiny_model_dir('mixtral')!r}, dtype='bfloat16', max_model_len=128)\n"
        "out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "moe = next(m for m in llm.engine.executor.runner.model.modules() if hasattr(m, 'load_expert'))\n"
        "print(type(moe.w13).__name__, len(out[0].outputs[0].token_ids))\n"
    )
    env = {**os.environ, "KILN_CPU_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["Parameter", "4"]
