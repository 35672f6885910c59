"""What ``bench/serve_compare.py`` records of the machine a run was on (``kernel_ab.py`` records
the same): a run with the instruction sets held down (AVX2 emulation) must say so, since the
CPU flags it records describe a wider machine."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import serve_compare  # noqa: E402  (bench/ is scripts, not a package)


def test_a_run_under_isa_limits_records_and_names_them(monkeypatch):
    for name in serve_compare.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KILN_CPU_MARCH", "x86-64-v3")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    info = serve_compare.machine()
    assert info["isa_limits"] == {"KILN_CPU_MARCH": "x86-64-v3", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert "held to KILN_CPU_MARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2;" in serve_compare.describe(info)


def test_a_run_without_limits_names_none(monkeypatch):
    for name in serve_compare.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    info = serve_compare.machine()
    assert info["isa_limits"] == {}
    assert "held to" not in serve_compare.describe(info)
