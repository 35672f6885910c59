"""The CPU plugin's attention backend honours the AttentionBackend contract, with and
without its native decode kernel."""

import torch

from kiln.testing.contracts import AttentionBackendContract
from kiln_cpu import native
from kiln_cpu.attention import CpuAttentionBackend


class TorchOnlyBackend(CpuAttentionBackend):
    """The fallback used where no C compiler is available."""

    def __init__(self, *args):
        super().__init__(*args)
        self.native = None


class TestCpuAttentionNative(AttentionBackendContract):
    backend_cls = CpuAttentionBackend


class TestCpuAttentionTorchFallback(AttentionBackendContract):
    backend_cls = TorchOnlyBackend


class TestCpuAttentionBfloat16(AttentionBackendContract):
    backend_cls = CpuAttentionBackend
    dtype = torch.bfloat16
    atol = 2e-2


def test_native_kernel_builds_here():
    assert native.load_kernels() is not None


def test_engine_on_cpu_uses_the_plugin_backend(tiny_model_dir):
    from kiln import LLM

    engine = LLM(tiny_model_dir("llama"), max_model_len=64).engine
    assert engine.platform.name == "cpu"
    assert isinstance(engine.runner.backend, CpuAttentionBackend) and engine.runner.backend.native is not None
