"""The CPU platform and its fused C ops honour the platform and ops contracts."""

from __future__ import annotations

import torch

from kiln.testing.contracts import PlatformContract
from kiln.testing.lora_contract import LoRAOpsContract
from kiln.testing.ops_contract import OpsContract
from kiln_cpu import native, plugin
from kiln_cpu.platform import CpuPlatform


def registered_spec():
    specs = []
    plugin.register_platforms(specs.append)
    (spec,) = specs
    return spec


class TestCpuPlatformContract(PlatformContract):
    platform_cls = CpuPlatform
    spec = registered_spec()


class TestCpuOpsContract(OpsContract):
    """The C kernels for fp32/bf16 (fp16 goes to the reference inside the wrappers), at the
    tolerances of test_fused_ops.py: fp32 differs only in summation order, bf16 by at most one
    bf16 ulp where a rounding flips."""

    ops = CpuPlatform().custom_ops()
    atol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
    # Documented in kiln_cpu.fused_ops: they write their results into x/residual and q/k, as
    # vLLM's kernels do (the model never reuses those inputs).
    in_place_ops = frozenset({"fused_add_rms_norm", "rotary_embedding"})


class TestCpuLoRAContract(LoRAOpsContract):
    """The C kernel for fp32 activations; other dtypes go to the reference inside the wrapper."""

    ops = CpuPlatform().custom_ops()


def test_the_ops_contract_runs_the_c_kernels():
    """Without the C kernels (no compiler) custom_ops is empty and the ops contract skips everything."""
    assert native.load_kernels() is not None and set(TestCpuOpsContract.ops) == {
        "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "gelu_tanh_and_mul", "add_lora",
        "fused_experts", "moe_route", "argmax",
    }  # fmt: skip
