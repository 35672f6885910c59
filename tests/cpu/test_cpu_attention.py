"""The CPU plugin's attention backend honours the AttentionBackend contract."""

from kiln.testing.contracts import AttentionBackendContract
from kiln_cpu.attention import CpuSdpaBackend


class TestCpuSdpaBackend(AttentionBackendContract):
    backend_cls = CpuSdpaBackend
