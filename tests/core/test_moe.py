"""Mixtures of experts (Mixtral, Qwen2-MoE with a shared expert and a dense layer, Qwen3-MoE):
greedy output equal to transformers token for token under chunked prefill, prefix-cache hits and
preemption; two tensor-parallel ranks, slicing every expert or holding whole experts
(``--enable-expert-parallel``), give one rank's tokens."""

from __future__ import annotations

import multiprocessing

import pytest

from kiln.testing.engine import run_and_shut_down
from kiln.testing.models import FAMILY_TOKENS, FAMILY_VARIANTS, assert_generates, hf_greedy


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def moe_reference(request, tiny_model_dir, varied_prompts):
    path = tiny_model_dir(request.param)
    return path, hf_greedy(path, varied_prompts, FAMILY_TOKENS)


@pytest.mark.parametrize("variant", list(FAMILY_VARIANTS))
def test_moe_models_match_transformers(moe_reference, varied_prompts, variant):
    path, expected = moe_reference
    assert_generates(path, varied_prompts, expected, **FAMILY_VARIANTS[variant])


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced-experts", "expert-parallel"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_two_ranks_match_one(tiny_model_dir, cpu_plugins, varied_prompts, model_type, expert_parallel):
    common = dict(model=tiny_model_dir(model_type), device="cpu", dtype="float32", max_num_batched_tokens=64)
    split, engine = run_and_shut_down(
        cpu_plugins, varied_prompts, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **common
    )
    moe = next(m for m in engine.executor.runner.model.modules() if hasattr(m, "load_expert"))
    # Rank 0 holds experts 0-1 whole, or the first half of all 4 experts' intermediate size.
    inter = 128 if model_type == "mixtral" else 32
    assert moe.w13.shape[0] == (2 if expert_parallel else 4)
    assert moe.w2.shape[-1] == (inter if expert_parallel else inter // 2)
    assert split == run_and_shut_down(cpu_plugins, varied_prompts, **common)[0]
    assert multiprocessing.active_children() == []


def test_expert_parallel_needs_the_experts_to_divide(tiny_model_dir, cpu_plugins):
    from kiln.testing.engine import make_engine

    with pytest.raises(Exception, match=r"--tensor-parallel-size: 3 does not divide the model.s number of experts"):
        make_engine(
            cpu_plugins, model=tiny_model_dir("mixtral", num_attention_heads=3, num_key_value_heads=3, head_dim=16),
            device="cpu", tensor_parallel_size=3, enable_expert_parallel=True,
        )  # fmt: skip
