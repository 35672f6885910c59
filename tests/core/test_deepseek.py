"""DeepSeek-V2 (no query compression, softmax routing in groups) and DeepSeek-V3 (compressed
queries, sigmoid routing with a per-expert correction, normalised weights): multi-head latent
attention over the paged cache as one latent head, equal to transformers token for token under
chunked prefill, prefix-cache hits and preemption; two ranks (heads split, the latent replicated)
give one rank's tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.testing.engine import run_and_shut_down
from kiln.testing.models import FAMILY_TOKENS, FAMILY_VARIANTS, assert_generates, hf_greedy


def as_released(path: str, copy: Path) -> str:
    """A copy of ``path`` (the tiny models are shared) as V3 is released: its routing correction,
    zeros in a fresh model, given values that change the choice; and a layer past the last, as
    V3's multi-token-prediction head ships (both ignore it)."""
    path = str(shutil.copytree(path, copy))
    file = Path(path, "model.safetensors")
    state = load_file(str(file))
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in state if n.endswith("e_score_correction_bias")]:
        state[name] = torch.rand(state[name].shape, generator=gen) * 0.5
    state["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def deepseek_reference(request, tiny_model_dir, varied_prompts, tmp_path_factory):
    path = tiny_model_dir(request.param)
    if request.param == "deepseek_v3":
        path = as_released(path, tmp_path_factory.mktemp("released") / "deepseek_v3")
    return path, hf_greedy(path, varied_prompts, FAMILY_TOKENS)


@pytest.mark.parametrize("variant", list(FAMILY_VARIANTS))
def test_deepseek_matches_transformers(deepseek_reference, varied_prompts, variant):
    path, expected = deepseek_reference
    llm = assert_generates(path, varied_prompts, expected, **FAMILY_VARIANTS[variant])
    backend = llm.engine.executor.runner.backend
    assert (backend.num_kv_heads, backend.head_dim) == (1, 32 + 16)  # the cache holds one latent head


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced-experts", "expert-parallel"])
def test_two_ranks_match_one(tiny_model_dir, cpu_plugins, varied_prompts, expert_parallel):
    common = dict(model=tiny_model_dir("deepseek_v2"), device="cpu", dtype="float32", max_num_batched_tokens=64)
    split, engine = run_and_shut_down(
        cpu_plugins, varied_prompts, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **common
    )
    assert engine.executor.runner.backend.num_heads == 2  # of 4
    assert split == run_and_shut_down(cpu_plugins, varied_prompts, **common)[0]
