"""Rope variants and config overrides against transformers: YaRN (with and without the mscale
terms) token for token, ``--rope-scaling`` / ``--rope-theta`` / ``--hf-overrides`` changing the
model as the same edit of its config.json does, and bad values named."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig
from kiln.testing.models import hf_greedy

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
YARN_MSCALE = {**YARN, "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16}


def greedy(path: str, prompts, **engine_args) -> list[list[int]]:
    llm = LLM(path, **{"dtype": "float32", "max_model_len": 512, **engine_args})
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


@pytest.mark.parametrize("rope", [YARN, YARN_MSCALE], ids=["yarn", "yarn-mscale"])
def test_yarn_matches_transformers(tiny_model_dir, varied_prompts, rope):
    path = tiny_model_dir("llama", rope_parameters=rope)
    assert greedy(path, varied_prompts) == hf_greedy(path, varied_prompts, NEW_TOKENS)


def test_rope_flags_equal_editing_the_config(tiny_model_dir, varied_prompts, tmp_path):
    plain = tiny_model_dir("llama")
    yarn = tiny_model_dir("llama", rope_parameters=YARN)  # the same weights: rope adds no parameters
    scaling = {k: v for k, v in YARN.items() if k != "rope_theta"}
    assert greedy(plain, varied_prompts, rope_scaling=json.dumps(scaling)) == greedy(yarn, varied_prompts)
    assert greedy(plain, varied_prompts) != greedy(yarn, varied_prompts)  # so the flag did something

    edited = tmp_path / "theta"
    shutil.copytree(plain, edited)
    config = json.loads((edited / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    config["rms_norm_eps"] = 1e-3
    (edited / "config.json").write_text(json.dumps(config))
    expected = hf_greedy(str(edited), varied_prompts, NEW_TOKENS)
    assert greedy(plain, varied_prompts, rope_theta=5000.0, hf_overrides={"rms_norm_eps": 1e-3}) == expected


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(rope_scaling="{not json"), "--rope-scaling: not valid JSON"),
        (dict(hf_overrides="[1, 2]"), "--hf-overrides: must be a JSON object"),
        (dict(rope_theta=-1.0), "--rope-theta"),
        (dict(tokenizer_mode="slow"), "--tokenizer-mode: slow is not supported: transformers 5 has no slow"),
        (dict(tokenizer_mode="custom"), "--tokenizer-mode"),
    ],
)
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(**kwargs)


def test_an_unsupported_rope_type_says_which_are(tiny_model_dir):
    with pytest.raises(ValueError, match="rope type 'ntk_mixed' is not supported .*dynamic.* yarn"):
        LLM(tiny_model_dir("llama"), rope_scaling={"rope_type": "ntk_mixed", "factor": 2.0})


DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}


@pytest.mark.parametrize("max_model_len", [512, 8192])
def test_dynamic_ntk_matches_transformers_within_the_trained_context(tiny_model_dir, varied_prompts, max_model_len):
    """Within its trained 2048 positions transformers' dynamic NTK rope is the plain one; so is Kiln's,
    whatever context it serves (8192: the 4x the factor allows)."""
    path = tiny_model_dir("llama", rope_parameters=DYNAMIC)
    assert greedy(path, varied_prompts, max_model_len=max_model_len) == hf_greedy(path, varied_prompts, NEW_TOKENS)


def test_dynamic_ntk_beyond_the_trained_context_takes_the_served_length(tiny_model_dir):
    """Serving 4096 positions of a model trained on 2048, the positions past 2048 take transformers'
    dynamic rope for a 4096-token sequence, those before the plain one; the context limit is 4x the
    trained one, as vLLM counts it."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kiln.models.rope import context_limit, cos_sin_cache

    cfg = AutoConfig.from_pretrained(tiny_model_dir("llama", rope_parameters=DYNAMIC))
    table = cos_sin_cache(64, 4096, cfg)
    for seq_len, rows in ((2048, slice(0, 2048)), (4096, slice(2048, 4096))):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=seq_len)
        freqs = torch.outer(torch.arange(4096, dtype=torch.float64)[rows], inv_freq.double())
        # transformers computes the frequencies in fp32: phases part by ~1e-4 at the far positions
        torch.testing.assert_close(table[rows, :32], freqs.cos().float(), atol=5e-4, rtol=0)
    assert context_limit(cfg, 2048) == 8192


def test_rope_scaling_in_the_older_spelling(tiny_model_dir, varied_prompts):
    plain, yarn = tiny_model_dir("llama"), tiny_model_dir("llama", rope_parameters=YARN)
    old = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}  # as Qwen's documents write it
    assert greedy(plain, varied_prompts, rope_scaling=old) == greedy(yarn, varied_prompts)


def test_overriding_the_scaling_keeps_the_model_theta(tiny_model_dir):
    from kiln.models.rope import rope_settings

    path = tiny_model_dir("llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    for flags in (dict(hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
                  dict(rope_scaling={"rope_type": "linear", "factor": 2.0})):  # fmt: skip
        llm = LLM(path, dtype="float32", max_model_len=256, **flags)
        theta, scaling = rope_settings(llm.engine.executor.runner.model.config)
        assert (theta, scaling["rope_type"], scaling["factor"]) == (500000.0, "linear", 2.0)


def test_a_stretching_rope_raises_the_context_limit(tiny_model_dir):
    """YaRN x4 over 1024 original positions: 4096 positions (vLLM's rule), beyond the config's 2048."""
    llm = LLM(tiny_model_dir("llama"), rope_scaling={**YARN, "original_max_position_embeddings": 1024})
    assert llm.engine.config.max_model_len == 4096
    assert LLM(tiny_model_dir("llama")).engine.config.max_model_len == 2048
