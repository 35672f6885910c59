"""The Ascend platform and its fused ops honour the platform and ops contracts, under the CPU
emulation of torch_npu that test_ascend.py installs (tests/ascend/fake_torch_npu.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from tests.ascend import fake_torch_npu, fake_torchair  # noqa: I001

from kiln.testing.contracts import PlatformContract
from kiln.testing.lora_contract import LoRAOpsContract
from kiln.testing.ops_contract import OpsContract
from kiln_ascend import ops, plugin
from kiln_ascend.platform import NpuPlatform
from kiln_cpu.platform import CpuPlatform


@pytest.fixture(autouse=True)
def emulated_torch_npu(monkeypatch, tmp_path):
    """As in test_ascend.py: the emulation in place of torch_npu and torchair, no gear list set."""
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu)
    monkeypatch.setitem(sys.modules, "torchair", fake_torchair)
    monkeypatch.setenv("TORCHAIR_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("PTA_TORCHAIR_DECODE_GEAR_LIST", raising=False)
    fake_torch_npu.calls.clear()


class EmulatedNpu(NpuPlatform):
    """The Ascend platform with its device calls (which need ``torch.npu``) on the CPU; config
    checks, dtypes, graph sizes and ops are NpuPlatform's own."""

    device = CpuPlatform.device
    mem_get_info = CpuPlatform.mem_get_info
    peak_memory_of = CpuPlatform.peak_memory_of  # Platform's: None

    def synchronize(self) -> None:
        pass


def registered_spec():
    specs = []
    plugin.register_platforms(specs.append)
    (spec,) = specs
    return spec


class TestAscendPlatformContract(PlatformContract):
    platform_cls = EmulatedNpu
    spec = registered_spec()
    # The emulation runs the device calls on the CPU: torch has no "npu" device without torch_npu.
    expected_device_type = "cpu"


class TestAscendOpsContract(OpsContract):
    """kiln_ascend.ops through the emulated torch_npu ops (which follow torch_npu's documented
    contracts): argument order, views, dtype conversions and results of the glue."""

    ops = ops.fused_ops()

    def test_the_npu_ops_ran(self):
        x = torch.randn(3, 8)
        self.ops["silu_and_mul"](x)
        self.ops["rms_norm"](x, torch.ones(8), 1e-6)
        assert fake_torch_npu.calls == ["npu_swiglu", "npu_rms_norm"]


class TestAscendLoRAContract(LoRAOpsContract):
    """add_lora through the emulated npu_grouped_matmul."""

    ops = ops.fused_ops()
