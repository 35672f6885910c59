"""The dense families beyond Llama (Phi-3, GLM-4, Gemma 1/2/3): greedy output equal to
transformers token for token on tiny random models, under chunked prefill, prefix-cache hits and
preemption; LongRoPE on both sides of its original context; partial and interleaved rotaries;
and the refusal of LoRA on families it is not mapped for."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from kiln import LLM
from kiln.models.sliding_window import sliding_windows
from kiln.testing.models import FAMILY_TOKENS, FAMILY_VARIANTS, assert_generates, hf_greedy

# family -> (config overrides, engine arguments it needs)
FAMILIES = {
    "phi3": ({}, {}),
    "phi3-partial-rotary-window": (dict(partial_rotary_factor=0.5, sliding_window=8), {}),  # Phi-4-mini's rotary
    "phi3-head96": (dict(hidden_size=384), {}),  # Phi-3's real head size (384 / 4 heads): the C kernels take it
    "glm": ({}, {}),  # half of each head rotates, in adjacent pairs; q/k/v biases
    "glm4": ({}, {}),  # and a norm after each sublayer
    "gemma": ({}, {}),
    "gemma2": ({}, {}),  # soft caps on scores and logits
    "gemma2-reference-attention": ({}, dict(attention_backend="torch_ref")),
    "gemma2-head256": (dict(head_dim=256), {}),  # Gemma 2's real head size: the CPU plugin's C kernels cap the scores
    "gemma3_text": ({}, {}),  # q/k norms; sliding and full layers with ropes of their own
    "gemma3_text-head256": (dict(head_dim=256), {}),  # Gemma's real head size: the CPU plugin's C kernels take it
}
GEMMA2_CAPS = dict(attn_logit_softcapping=3.0, final_logit_softcapping=5.0)  # low enough to bite on tiny logits


def model_dir(tiny_model_dir, family: str) -> str:
    model_type = family.split("-")[0]
    overrides = FAMILIES[family][0] | (GEMMA2_CAPS if model_type == "gemma2" else {})
    return tiny_model_dir(model_type, **overrides)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_reference(request, tiny_model_dir, varied_prompts):
    path = model_dir(tiny_model_dir, request.param)
    return path, FAMILIES[request.param][1], hf_greedy(path, varied_prompts, FAMILY_TOKENS)


@pytest.mark.parametrize("variant", list(FAMILY_VARIANTS))
def test_families_match_transformers(family_reference, varied_prompts, variant):
    path, needs, expected = family_reference
    assert_generates(path, varied_prompts, expected, **needs, **FAMILY_VARIANTS[variant])


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0] * 2, "long_factor": [2.0, 4.0, 8.0, 9.0] * 2}


@pytest.mark.parametrize("max_model_len", [48, 256], ids=["within", "extended"])
def test_longrope_matches_transformers_within_the_original_context(tiny_model_dir, max_model_len):
    """Sequences within LongRoPE's original 48 positions take its short factors in transformers,
    and in Kiln whatever context it serves (one factor per rotating pair of a 16-wide head)."""
    path = tiny_model_dir(
        "phi3", rope_scaling=LONGROPE, original_max_position_embeddings=48, max_position_embeddings=256
    )
    prompts = [[7, 8, 9], list(range(300, 330))]  # 30 + 16 tokens at the most
    assert_generates(path, prompts, hf_greedy(path, prompts, FAMILY_TOKENS), max_model_len=max_model_len)


def test_longrope_positions_past_the_original_context_take_the_long_factors(tiny_model_dir):
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kiln.models.rope import cos_sin_cache

    path = tiny_model_dir(
        "phi3", rope_scaling=LONGROPE, original_max_position_embeddings=48, max_position_embeddings=256
    )
    cfg = AutoConfig.from_pretrained(path)
    table = cos_sin_cache(16, 256, cfg)
    for seq_len, rows in ((48, slice(0, 48)), (256, slice(48, 256))):  # short factors, then long ones
        inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=seq_len)
        positions = torch.arange(256, dtype=torch.float64)[rows]
        expected = torch.outer(positions, inv_freq.double()).cos() * attention
        torch.testing.assert_close(table[rows, :8], expected.float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("model_type", "overrides", "windows"),
    [
        ("phi3", dict(sliding_window=2047), [2047] * 4),
        ("phi3", dict(sliding_window=None), [None] * 4),
        ("gemma2", dict(sliding_window=64), [64, None, 64, None]),
        ("gemma3_text", dict(sliding_window=64, sliding_window_pattern=2), [64, None, 64, None]),
        ("ministral", dict(sliding_window=64), [64] * 4),
        ("ministral", dict(sliding_window=64, layer_types=["full_attention", "sliding_attention"] * 2), [None, 64] * 2),
    ],
)
def test_layer_windows_follow_transformers(model_type, overrides, windows):
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=4, **overrides)
    assert sliding_windows(cfg, max_positions=8192) == windows


def test_lora_is_refused_on_families_it_is_not_mapped_for(tiny_model_dir):
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM does not support LoRA adapters"):  # latent attention
        LLM(tiny_model_dir("deepseek_v2"), dtype="float32", enable_lora=True)
