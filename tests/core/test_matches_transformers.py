"""Greedy output must equal Hugging Face transformers token for token on the same weights.

Both sides run in fp32: in bf16, different (equally valid) kernels round differently
and greedy paths may part after a few tokens.
"""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from kiln.testing.models import hf_greedy

NEW_TOKENS = 24
# min_tokens mirrors the reference's min_new_tokens: EOS is masked, not just ignored.
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)

ENGINE_VARIANTS = {
    "default": {},
    "chunked-prefill-tiny-budget": dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    "no-chunked-prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "block-size-16": dict(block_size=16),
    "reference-attention": dict(attention_backend="torch_ref"),
    # 12 usable blocks of 16 tokens for 5 prompts of up to 77 + 24 tokens: forces preemption.
    "forced-preemption": dict(block_size=16, num_gpu_blocks_override=13, max_model_len=160),
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral", "ministral"])
def tiny_reference(request, tiny_model_dir, varied_prompts):
    path = tiny_model_dir(request.param)
    return path, hf_greedy(path, varied_prompts, NEW_TOKENS)


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_tiny_models_match_transformers(tiny_reference, varied_prompts, variant):
    path, expected = tiny_reference
    llm = LLM(path, **{"max_model_len": 256, "dtype": "float32", **ENGINE_VARIANTS[variant]})
    outputs = llm.generate([{"prompt_token_ids": p} for p in varied_prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_forced_preemption_really_preempts(tiny_model_dir, varied_prompts):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", **ENGINE_VARIANTS["forced-preemption"])
    for p in varied_prompts:
        llm.engine.add_request(None, {"prompt_token_ids": p}, GREEDY)
    preempted = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        preempted = max(preempted, max((r.num_preemptions for r in llm.engine.core.scheduler.running), default=0))
    assert preempted > 0
    assert llm.engine.kv.usage == 0.0


@pytest.fixture(scope="module")
def default_llm(default_model_dir):
    return LLM(default_model_dir, dtype="float32")  # exact parity needs the reference's dtype


@pytest.mark.slow
def test_default_model_chat_matches_transformers(default_llm, default_model_dir):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = default_llm.apply_chat_template(messages)
    out = default_llm.chat(messages, SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == hf_greedy(default_model_dir, [ids], 64, stop_at_eos=True)[0]
    assert out.outputs[0].token_ids == [504, 3575, 282, 4649, 314, 7042, 30, 2]


@pytest.mark.slow
def test_default_model_plain_prompts_match_transformers(default_llm, default_model_dir):
    tok = default_llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=64, min_tokens=64, temperature=0)
    outputs = default_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(default_model_dir, prompts, 64)
    assert outputs[0].outputs[0].token_ids[:8] == [7042, 30, 198, 198, 504, 2988, 314, 42]
