"""``--model-impl transformers``: architectures Kiln has no class for (GPT-2, OPT) served through
Kiln's scheduler, paged KV cache and attention backend via transformers' attention interface, equal
to transformers token for token under chunked prefill, prefix-cache hits and preemption; and the
start-up error for such an architecture without the flag."""

from __future__ import annotations

import pytest

from kiln import LLM
from kiln.testing.models import FAMILY_TOKENS, FAMILY_VARIANTS, assert_generates, hf_greedy


@pytest.fixture(scope="module", params=["gpt2", "opt"])
def fallback_reference(request, tiny_model_dir, varied_prompts):
    path = tiny_model_dir(request.param)
    return path, hf_greedy(path, varied_prompts, FAMILY_TOKENS)


@pytest.mark.parametrize("variant", list(FAMILY_VARIANTS))
def test_fallback_matches_transformers(fallback_reference, varied_prompts, variant):
    path, expected = fallback_reference
    assert_generates(path, varied_prompts, expected, model_impl="transformers", **FAMILY_VARIANTS[variant])


def test_a_kiln_architecture_through_the_fallback_matches_transformers(tiny_model_dir, varied_prompts):
    path = tiny_model_dir("qwen3")
    assert_generates(path, varied_prompts, hf_greedy(path, varied_prompts, FAMILY_TOKENS), model_impl="transformers")


def test_soft_caps_through_the_fallback_match_transformers(tiny_model_dir, varied_prompts):
    """Gemma 2's caps: the attention's reaches Kiln's backend, the logits' is applied after the head."""
    path = tiny_model_dir("gemma2", attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    assert_generates(path, varied_prompts, hf_greedy(path, varied_prompts, FAMILY_TOKENS), model_impl="transformers")


def test_a_checkpoint_without_the_base_model_prefix_loads(tiny_model_dir, tmp_path, varied_prompts):
    """GPT-2 as first released names its tensors without ``transformer.``."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    source = tiny_model_dir("gpt2")
    shutil.copytree(source, tmp_path / "gpt2")
    state = load_file(str(Path(source, "model.safetensors")))
    save_file(
        {n.removeprefix("transformer."): t for n, t in state.items()}, str(tmp_path / "gpt2" / "model.safetensors")
    )
    expected = hf_greedy(source, varied_prompts, FAMILY_TOKENS)
    assert_generates(str(tmp_path / "gpt2"), varied_prompts, expected, model_impl="transformers")


def test_an_unwritten_architecture_names_the_fallback(tiny_model_dir):
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*is not supported.*--model-impl transformers"):
        LLM(tiny_model_dir("gpt2"), dtype="float32")
