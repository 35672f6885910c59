"""Building the CPU plugin's C kernels (``kiln_cpu.native``): a compiler that fails leaves the
plugin on its torch fallbacks with the compiler's message logged, and nothing half built in
the cache."""

from __future__ import annotations

import logging
import os

from kiln_cpu import native


def test_a_failing_compiler_falls_back_to_torch_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    compiler = tmp_path / "cc"
    compiler.write_text('#!/bin/sh\necho "the compiler refused $*" >&2\nexit 1\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="kiln.cpu"):
        assert native.load_kernels.__wrapped__() is None  # the cached library of this process aside
    assert "building CPU kernels failed" in caplog.text and "the compiler refused" in caplog.text
    assert "paged_attention.c" in caplog.text  # the first source's error, the slowest one's
    assert os.listdir(tmp_path / "cache" / "cpu-kernels") == []  # no library, no objects
