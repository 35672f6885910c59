"""``--model-impl transformers``: architectures Kiln has no class for (GPT-2, OPT) served through
Kiln's scheduler, paged KV cache and attention backend via transformers' attention interface, equal
to transformers token for token under chunked prefill, prefix-cache hits and preemption; and the
start-up error for such an architecture without the flag."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from kiln.testing.models import hf_greedy

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
ENGINE_VARIANTS = {
    "default": {},
    "chunked-prefill-tiny-budget": dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    "forced-preemption": dict(block_size=16, num_gpu_blocks_override=13, max_model_len=160),
}


@pytest.fixture(scope="module", params=["gpt2", "opt"])
def fallback_reference(request, tiny_model_dir, varied_prompts):
    path = tiny_model_dir(request.param)
    return path, hf_greedy(path, varied_prompts, NEW_TOKENS)


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_fallback_matches_transformers(fallback_reference, varied_prompts, variant):
    path, expected = fallback_reference
    llm = LLM(path, model_impl="transformers", dtype="float32", **{"max_model_len": 256, **ENGINE_VARIANTS[variant]})
    prompts = [{"prompt_token_ids": p} for p in varied_prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected  # prefix-cache hits


def test_a_kiln_architecture_through_the_fallback_matches_kiln(tiny_model_dir, varied_prompts):
    path = tiny_model_dir("qwen3")
    prompts = [{"prompt_token_ids": p} for p in varied_prompts]
    native = LLM(path, dtype="float32", max_model_len=256).generate(prompts, GREEDY)
    fallback = LLM(path, model_impl="transformers", dtype="float32", max_model_len=256).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in fallback] == [o.outputs[0].token_ids for o in native]


def test_an_unwritten_architecture_names_the_fallback(tiny_model_dir):
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*is not supported.*--model-impl transformers"):
        LLM(tiny_model_dir("gpt2"), dtype="float32")
