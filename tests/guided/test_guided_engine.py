"""Guided decoding in the engine on a tiny random model: the mask is really applied, constraints
hold whatever the weights, compiles are cached, fallback and errors behave."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kiln import LLM, SamplingParams
from kiln.guided import GuidedDecodingParams, GuidedManager

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "score"],
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), max_model_len=512, block_size=16, dtype="float32")


def test_the_only_allowed_token_is_sampled_whatever_the_logits(llm):
    tok = llm.get_tokenizer()
    text = "7"  # one character: no other token spells a prefix of it
    (word,) = tok.encode(text, add_special_tokens=False)
    rival = word + 1
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            max_tokens=4,
            temperature=temperature,
            seed=3,
            logit_bias={rival: 100.0},  # without the mask, the rival always wins
            guided_decoding=GuidedDecodingParams(choice=(text,)),
        )
        out = llm.generate("Hello", params)[0].outputs[0]
        assert out.token_ids[0] == word and out.text == text
        assert out.finish_reason == "stop"
    free = llm.generate("Hello", SamplingParams(max_tokens=1, logit_bias={rival: 100.0}))[0].outputs[0]
    assert free.token_ids == [rival]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_holds_for_random_weights_with_n_and_seed(llm, temperature):
    params = SamplingParams(
        max_tokens=200, temperature=temperature, n=3, seed=5, guided_decoding=GuidedDecodingParams(json=SCHEMA)
    )
    outs = llm.generate(["Give me JSON", "Another one"], params)
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_regex_choice_and_grammar(llm):
    cases = [
        (GuidedDecodingParams(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (GuidedDecodingParams(choice=("red", "green", "blue")), lambda t: t in ("red", "green", "blue")),
        (
            GuidedDecodingParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
            lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t),
        ),
    ]
    for guide, check in cases:
        outs = llm.generate("x", SamplingParams(max_tokens=40, temperature=1.0, n=4, seed=1, guided_decoding=guide))
        for c in outs[0].outputs:
            assert check(c.text) and c.finish_reason == "stop", (guide.kind, c.text)


def test_compiles_once_per_constraint(llm):
    manager = llm.engine.input_processor.guided
    backend = manager.backend("xgrammar")
    calls = []
    original = backend.compile
    backend.compile = lambda params: calls.append(params) or original(params)
    try:
        schema = {"type": "object", "properties": {"only": {"type": "boolean"}}, "required": ["only"]}
        for _ in range(3):
            llm.generate(
                "x", SamplingParams(max_tokens=20, guided_decoding=GuidedDecodingParams(json=json.dumps(schema)))
            )
    finally:
        del backend.compile
    assert len(calls) == 1


def test_fallback_to_lm_format_enforcer_unless_refused(llm):
    guide = GuidedDecodingParams(regex="(?i)yes|no")  # xgrammar refuses the (?i) flag
    out = llm.generate("x", SamplingParams(max_tokens=10, temperature=1.0, seed=2, guided_decoding=guide))[0]
    assert re.fullmatch("(?i)yes|no", out.outputs[0].text)
    strict = GuidedDecodingParams(regex="(?i)yes|no", backend="xgrammar:no-fallback")
    with pytest.raises(ValueError, match="not supported"):
        llm.generate("x", SamplingParams(max_tokens=10, guided_decoding=strict))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(regex="a(b"), "parenthesis is not closed"),
        (dict(grammar="root ::= ("), "EBNF parser error"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(choice=()), "non-empty"),
        (dict(json={"type": "object"}, regex="a"), "exactly one"),
        (dict(json={"type": "object"}, backend="nope"), "not installed"),
    ],
)
def test_invalid_constraints_are_reported(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("x", SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(**kwargs)))
    assert not llm.engine.has_unfinished_requests()


def test_without_a_backend_plugin_the_error_says_what_to_install(kiln_plugins, llm):
    manager = GuidedManager(kiln_plugins.registry, llm.get_tokenizer(), 49152)
    with pytest.raises(ValueError, match="pip install kiln-plugin-guided"):
        manager.compile(GuidedDecodingParams(regex="a"))


def test_constraints_survive_preemption_and_chunked_prefill(tiny_model_dir):
    # Few KV blocks and a small token budget: requests are chunked and preempted (recomputed).
    llm = LLM(
        tiny_model_dir("llama"),
        max_model_len=160,
        block_size=16,
        dtype="float32",
        num_gpu_blocks_override=13,
        max_num_batched_tokens=64,
        kv_cache_ratio=1.0,
    )
    prompts = [f"Record {i} of the ledger. " * 6 for i in range(6)]
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=9, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    outs = llm.generate(prompts, params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_structural_tag_forces_a_tagged_call(llm):
    """The form tool calling uses (``tool_choice: required``): a tag around schema-valid JSON."""
    args = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    tag = {
        "type": "structural_tag",
        "format": {"type": "tag", "begin": "<tool_call>", "content": {"type": "json_schema", "json_schema": args}, "end": "</tool_call>"},
    }  # fmt: skip
    guide = GuidedDecodingParams(structural_tag=json.dumps(tag))
    out = llm.generate("x", SamplingParams(max_tokens=300, temperature=0, guided_decoding=guide))[0].outputs[0]
    match = re.fullmatch(r"<tool_call>(.*)</tool_call>", out.text, re.S)
    assert match, out.text
    jsonschema.validate(json.loads(match.group(1)), args)
