"""Beam search on the Ascend path (the emulation): beams decode through the torchair graphs on
the Ascend cache layout, share their prompt blocks and copy partial ones, and give the CPU
plugin's hypotheses."""

from __future__ import annotations

import pytest
from tests.ascend import test_ascend

# test_ascend.py's fixtures: the emulation installed as torch_npu and torchair (autouse), and the
# plugins with the "npu_emulated" platform (the Ascend platform with its device calls on the CPU).
emulated_torch_npu = test_ascend.emulated_torch_npu
npu_plugins = test_ascend.npu_plugins

PROMPTS = [[1000], list(range(100, 119)), list(range(2000, 2070))]


def test_beams_match_the_cpu_plugin(tiny_model_dir, npu_plugins):
    from kiln.testing.engine import make_engine, run_beam_search

    common = dict(model=tiny_model_dir("llama"), dtype="float32", max_num_batched_tokens=128, max_num_seqs=16)
    npu_engine = make_engine(npu_plugins, device="npu_emulated", block_size=64, **common)
    npu = run_beam_search(npu_engine, PROMPTS, 4, 8, ignore_eos=True)
    cpu = run_beam_search(
        make_engine(npu_plugins, device="cpu", block_size=16, **common), PROMPTS, 4, 8, ignore_eos=True
    )
    assert [[t for t, _ in beams] for beams in npu] == [[t for t, _ in beams] for beams in cpu]
    for got, ref in zip(npu, cpu):
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in ref], abs=1e-3)
    assert npu_engine.executor.runner.graph_steps > 0  # beams decoded through the gears' graphs
    assert npu_engine.kv.usage == 0.0
