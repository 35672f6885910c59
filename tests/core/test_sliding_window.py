"""Sliding-window attention (Mistral-7B-v0.1, Qwen2 with use_sliding_window): which layers get a
window, greedy output equal to transformers token for token on the CPU plugin with prompts and
generations longer than the window (prefills, tiny chunked-prefill budgets and prefix-cache hits
past the window), and a refusal at start-up by a backend that cannot apply one."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from kiln import LLM, SamplingParams
from kiln.attention.torch_ref import TorchRefAttentionBackend
from kiln.models.sliding_window import sliding_windows
from kiln.testing.models import hf_greedy
from kiln.testing.plugins import registered_attention_backend

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
# Windows well under the prompts (up to 77 tokens) and a block (16); Qwen2's first layer is full.
MODELS = {
    "mistral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=12, max_window_layers=1),
}
ENGINE_VARIANTS = {"default": {}, "reference-attention": dict(attention_backend="torch_ref")}


def config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, num_hidden_layers=4, **overrides)


@pytest.mark.parametrize(
    ("cfg", "windows"),
    [
        (config("mistral", sliding_window=4096), [4096] * 4),
        (config("mistral", sliding_window=None), [None] * 4),
        (config("mistral", sliding_window=8192), [None] * 4),  # no shorter than max_positions: no cut
        (config("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2), [None, None, 64, 64]),
        (config("qwen2", use_sliding_window=False, sliding_window=64, max_window_layers=2), [None] * 4),
        (config("qwen3", use_sliding_window=True, sliding_window=64, max_window_layers=0), [64] * 4),
        (
            config(
                "qwen2",
                use_sliding_window=True,
                sliding_window=64,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
            [64, None, 64, None],
        ),
        (config("llama", sliding_window=64), [None] * 4),  # transformers' Llama has no window
    ],
    ids=["mistral", "mistral-none", "mistral-wide", "qwen2", "qwen2-off", "qwen3", "qwen2-layer-types", "llama"],
)
def test_layer_windows_follow_transformers(cfg, windows):
    assert sliding_windows(cfg, max_positions=8192) == windows


@pytest.fixture(scope="module", params=list(MODELS))
def windowed_reference(request, tiny_model_dir, varied_prompts):
    path = tiny_model_dir(request.param, **MODELS[request.param])
    return path, hf_greedy(path, varied_prompts, NEW_TOKENS)


def test_the_window_changes_the_reference(windowed_reference, tiny_model_dir, varied_prompts):
    """The same weights without a window generate otherwise, so the matches below test the window."""
    path, expected = windowed_reference
    model_type = AutoConfig.from_pretrained(path).model_type
    assert hf_greedy(tiny_model_dir(model_type), varied_prompts[3:4], NEW_TOKENS) != expected[3:4]


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_windowed_models_match_transformers(windowed_reference, varied_prompts, variant):
    path, expected = windowed_reference
    llm = LLM(path, **{"max_model_len": 256, "dtype": "float32", **ENGINE_VARIANTS[variant]})
    windows = [layer.self_attn.sliding_window for layer in llm.engine.executor.runner.model.layers]
    assert windows == sliding_windows(AutoConfig.from_pretrained(path), 256) and any(windows)
    outputs = llm.generate([{"prompt_token_ids": p} for p in varied_prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_chunked_prefill_and_prefix_cache_hits_past_the_window(windowed_reference, varied_prompts):
    """Prefills in chunks of 16 tokens, then the prompts again on a warm prefix cache (hits
    ending well past the window): the outputs stay the reference's."""
    path, expected = windowed_reference
    llm = LLM(path, max_model_len=256, dtype="float32", block_size=16, enable_chunked_prefill=True,
              max_num_batched_tokens=16)  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in varied_prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    hits = llm.engine.kv.prefix_hits
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.kv.prefix_hits - hits >= 64  # the two longest prompts' full blocks at least


def test_a_backend_without_windows_is_refused_at_start(tiny_model_dir):
    class FullOnlyBackend(TorchRefAttentionBackend):
        name = "full_only"
        supports_sliding_window = False

    with registered_attention_backend("full_only", FullOnlyBackend):
        with pytest.raises(ValueError, match="sliding window of 8 tokens.*'full_only' cannot apply"):
            LLM(tiny_model_dir("mistral", **MODELS["mistral"]), attention_backend="full_only", max_model_len=64)
        # At most the window long, the window cuts nothing: the backend serves the model.
        LLM(tiny_model_dir("mistral", **MODELS["mistral"]), attention_backend="full_only", max_model_len=8)
