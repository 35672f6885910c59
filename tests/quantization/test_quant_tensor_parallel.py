"""Quantized checkpoints under tensor parallelism: each rank takes its slice of the codes and
of the scales and zero points with them, and two ranks give one rank's tokens."""

import multiprocessing

import pytest

from kiln.cli import main

FAST = ["--num-calibration-samples", "4", "--seq-len", "32", "--group-size", "32", "-t", "fp32"]


def greedy(plugins, prompts, **engine_args):
    from kiln.testing.engine import make_engine, run_greedy

    engine = make_engine(plugins, **engine_args)
    try:
        return run_greedy(engine, prompts)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "quant_type,extra",
    [("awq", []), ("gptq", []), ("gptq", ["--act-order", "--static-groups", "--no-sym"]), ("weight_only_int8", [])],
)
def test_two_ranks_match_one(tiny_model_dir, tmp_path, cpu_plugins, varied_prompts, quant_type, extra):
    """Act-order with static groups keeps the groups in column order, so it shards as plain GPTQ does."""
    out = str(tmp_path / "q")
    assert main(["quantize", "-i", tiny_model_dir("llama"), "-o", out, "-quant_type", quant_type, *FAST, *extra]) == 0
    common = dict(model=out, device="cpu", dtype="float32", max_num_batched_tokens=64)
    assert greedy(cpu_plugins, varied_prompts, tensor_parallel_size=2, **common) == greedy(
        cpu_plugins, varied_prompts, **common
    )
    assert multiprocessing.active_children() == []


def test_act_order_checkpoints_are_served_on_one_rank(tiny_model_dir, tmp_path, cpu_plugins):
    from kiln.testing.engine import make_engine

    out = str(tmp_path / "q")
    assert (
        main(["quantize", "-i", tiny_model_dir("llama"), "-o", out, "-quant_type", "gptq", "--act-order", *FAST]) == 0
    )
    with pytest.raises(ValueError, match="act-order .desc_act. checkpoints are served on one rank"):
        make_engine(cpu_plugins, model=out, device="cpu", tensor_parallel_size=2)
    assert multiprocessing.active_children() == []
