"""Tensor parallelism on the CPU (gloo): two ranks, each in its own process with half the
heads and half the MLP, give the single-process engine's tokens."""

from __future__ import annotations

import multiprocessing

import pytest

from kiln.testing.engine import run_and_shut_down as run


# qwen2: q/k/v biases are split too; glm: and its query/key rows reordered; phi3: fused projections
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "glm", "phi3"])
def test_two_ranks_match_one(tiny_model_dir, cpu_plugins, varied_prompts, model_type):
    common = dict(model=tiny_model_dir(model_type), device="cpu", dtype="float32", max_num_batched_tokens=64)
    split, engine = run(cpu_plugins, varied_prompts, tensor_parallel_size=2, **common)
    assert engine.executor.runner.backend.num_heads == 2  # of the model's 4
    assert split == run(cpu_plugins, varied_prompts, **common)[0]
    assert multiprocessing.active_children() == []  # shutdown stopped rank 1


def test_ranks_loading_one_at_a_time_match_one(tiny_model_dir, cpu_plugins, varied_prompts):
    """--max-parallel-loading-workers 1: rank 1 reads the checkpoint after rank 0 has (a barrier
    between the waves), then both serve as usual."""
    common = dict(model=tiny_model_dir("llama"), device="cpu", dtype="float32", max_num_batched_tokens=64)
    split, _ = run(cpu_plugins, varied_prompts, tensor_parallel_size=2, max_parallel_loading_workers=1, **common)
    assert split == run(cpu_plugins, varied_prompts, **common)[0]


def test_drafts_verify_across_two_ranks(tiny_model_dir, cpu_plugins, varied_prompts):
    """Speculative decoding under tensor parallelism: rank 1 runs the same draft rows (the step's
    batch carries them) and the tokens are those of one rank without drafts."""
    from kiln.testing.engine import make_engine, run_greedy
    from kiln.testing.spec_decode import NGRAM, ReplayProposer

    common = dict(model=tiny_model_dir("llama"), device="cpu", dtype="float32", max_num_batched_tokens=64)
    reference = run(cpu_plugins, varied_prompts, **common)[0]
    engine = make_engine(cpu_plugins, tensor_parallel_size=2, speculative_config=NGRAM, **common)
    try:
        engine.core.scheduler.proposer = ReplayProposer.of(varied_prompts, reference)
        assert run_greedy(engine, varied_prompts) == reference
        assert engine.core.scheduler.spec_stats.num_accepted_tokens > 0
    finally:
        engine.shutdown()


def test_an_eagle3_head_drafts_the_same_across_two_ranks(tiny_model_dir, cpu_plugins, tmp_path):
    """The target split over two ranks returns its layers' inputs whole on rank 0: the head
    (whole on rank 0) proposes what it proposes over one rank."""
    from kiln.testing.spec_decode import build_eagle3_head, greedy_with_proposals

    model = tiny_model_dir("llama", num_hidden_layers=3)
    head, _ = build_eagle3_head(model, tmp_path / "eagle3", draft_vocab_size=500, layer_ids=[0, 1, 2])
    eagle3 = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    common = dict(model=model, device="cpu", dtype="float32", speculative_config=eagle3)
    prompts = [[1000, 7, 9], list(range(100, 119))]
    split = greedy_with_proposals(cpu_plugins, prompts, 8, tensor_parallel_size=2, **common)
    assert split == greedy_with_proposals(cpu_plugins, prompts, 8, **common) and len(split[1]) > len(prompts)
    assert multiprocessing.active_children() == []


def test_a_size_that_does_not_divide_the_heads_fails_cleanly(tiny_model_dir, cpu_plugins):
    from kiln.testing.engine import make_engine

    with pytest.raises(
        ValueError, match=r"--tensor-parallel-size: 3 does not divide the model's attention heads \(4\)"
    ):
        make_engine(cpu_plugins, model=tiny_model_dir("llama"), device="cpu", tensor_parallel_size=3)
    assert multiprocessing.active_children() == []
