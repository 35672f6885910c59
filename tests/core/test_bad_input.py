"""Bad input raises a clear ValueError naming the field, and the engine keeps serving."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), max_model_len=64)


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ("", SamplingParams(), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": [1] * 64}, SamplingParams(), "max_model_len"),
        ({"prompt_token_ids": [10**7]}, SamplingParams(), "prompt"),
        ("hi", SamplingParams(logprobs=50), "logprobs"),
        ("hi", SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_bad_prompts_name_the_field_and_leave_the_engine_clean(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(["a fine prompt", prompt], params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.usage == 0.0
    out = llm.generate("still serving", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(temperature=-0.5), "temperature"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="model: .*does not exist"):
        LLM("/no/such/model")


def test_long_prompt_is_truncated_when_asked(llm):
    params = SamplingParams(max_tokens=2, truncate_prompt_tokens=10, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": list(range(100, 200))}, params)[0]
    assert len(out.outputs[0].token_ids) == 2
