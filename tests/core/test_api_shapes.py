"""Request and response shapes of current vLLM / OpenAI clients, in-process on tiny models:
``structured_outputs`` (each kind, its options, conflicts), ``GET /v1/models/{id}``,
``system_fingerprint``, ``suffix`` (fill-in-the-middle) and ``completion_tokens_details``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import jsonschema
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import build_app
from kiln.entrypoints.openai.cli_args import add_serve_args
from kiln.entrypoints.openai.serving import ServerOptions, system_fingerprint
from kiln.entrypoints.openai.structured_outputs import closed_objects
from kiln.interfaces.parsers import ReasoningParser
from kiln.testing.models import build_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}},
    "required": ["ok", "level"],
}
TAGGED = {"begin": "<a>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</a>"}
TAG = {"type": "tag", "begin": "<a>", "content": {"type": "regex", "pattern": "[0-9]{2}"}, "end": "</a>"}
GREEDY = {"model": "tiny", "prompt": "The answer is", "max_tokens": 48, "temperature": 0}


def make_engine(model_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig.create(model=model_dir, max_model_len=256, block_size=16, dtype="float32"))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def fim_engine(tmp_path_factory, default_model_dir):
    """A tiny model whose tokenizer has StarCoder's fill-in-the-middle tokens (SmolLM2's has none)."""
    root = tmp_path_factory.mktemp("fim")
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.add_tokens(["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"], special_tokens=True)
    tokenizer.save_pretrained(root / "tokenizer")
    return make_engine(build_tiny_model("llama", root / "model", root / "tokenizer"))


def client_for(engine: LLMEngine, **options) -> TestClient:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    options = {"served_model_names": ["tiny"], "disable_log_requests": True, **options}
    app = build_app(AsyncEngine(engine, log_stats_interval=None), ServerOptions(**options), parser.parse_args([]))
    return TestClient(app)


@pytest.fixture
def client(engine):  # one server at a time drives the engine: per test, not per module
    with client_for(engine, served_model_names=["tiny", "org/tiny"]) as c:
        yield c


def complete(client: TestClient, **fields) -> dict:
    response = client.post("/v1/completions", json={**GREEDY, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def sse_events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


# ------------------------------------------------------------------ structured_outputs
CASES = [  # (structured_outputs, the same constraint in a legacy spelling, the check of the output)
    ({"json": SCHEMA}, {"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"regex": "[ab]{3}-[0-9]{2}"}, {"guided_regex": "[ab]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[ab]{3}-[0-9]{2}", t)),
    ({"choice": ["red", "green"]}, {"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"grammar": 'root ::= "(" [0-9] [0-9]? ")"'}, {"guided_grammar": 'root ::= "(" [0-9] [0-9]? ")"'},
     lambda t: re.fullmatch(r"\(\d\d?\)", t)),
    ({"json_object": True}, {"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"structural_tag": json.dumps({"type": "structural_tag", "format": TAG})},
     {"response_format": {"type": "structural_tag", "format": TAG}}, lambda t: re.fullmatch("<a>[0-9]{2}</a>", t)),
]  # fmt: skip


@pytest.mark.parametrize("structured, legacy, check", CASES, ids=[next(iter(c[0])) for c in CASES])
def test_structured_outputs_each_kind_matches_and_equals_legacy(client, structured, legacy, check):
    out = complete(client, structured_outputs=structured)["choices"][0]
    assert out["finish_reason"] == "stop", out
    assert check(out["text"]) is not False
    assert complete(client, **legacy)["choices"][0]["text"] == out["text"]


def test_structured_outputs_in_chat_and_generate(client):
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "Pick"}], "max_tokens": 8, "temperature": 0,
              "structured_outputs": {"choice": ["left", "right"]}},
    )  # fmt: skip
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] in ("left", "right")
    generate = client.post(
        "/generate", json={"prompt": "Pick", "temperature": 0, "structured_outputs": {"regex": "[xy]{4}"}}
    )
    assert generate.status_code == 200 and re.fullmatch("Pick[xy]{4}", generate.json()["text"][0])
    refused = client.post("/generate", json={"prompt": "Pick", "guided_decoding": {"regex": "x"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "guided_decoding"


def test_vllm_legacy_structural_tag_is_its_triggered_tags_equivalent(client):
    legacy = {"structures": [{"begin": "<a>", "schema": SCHEMA, "end": "</a>"}], "triggers": ["<a"]}
    current = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a"], "tags": [TAGGED]}}
    texts = {
        complete(client, structured_outputs={"structural_tag": tag}, max_tokens=24)["choices"][0]["text"]
        for tag in (json.dumps({"type": "structural_tag", **legacy}), current)
    }
    texts.add(
        complete(client, response_format={"type": "structural_tag", **legacy}, max_tokens=24)["choices"][0]["text"]
    )
    assert len(texts) == 1
    bad = client.post(
        "/v1/completions", json={**GREEDY, "structured_outputs": {"structural_tag": '{"structures": [1]}'}}
    )
    assert bad.status_code == 400 and "begin" in bad.json()["error"]["message"]


def test_structured_outputs_options(client):
    compact = complete(client, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})["choices"][0]
    value = json.loads(compact["text"])
    assert compact["text"] == json.dumps(value, separators=(",", ":"))
    # lm-format-enforcer cannot take a choice; xgrammar takes over unless fallback is disabled
    lmfe = {"guided_decoding_backend": "lm-format-enforcer", "max_tokens": 4}
    assert complete(client, structured_outputs={"choice": ["a", "b"]}, **lmfe)["choices"][0]["text"] in ("a", "b")
    strict = client.post(
        "/v1/completions",
        json={**GREEDY, **lmfe, "structured_outputs": {"choice": ["a", "b"], "disable_fallback": True}},
    )
    assert strict.status_code == 400 and "lm-format-enforcer" in strict.json()["error"]["message"]
    pattern = client.post(
        "/v1/completions", json={**GREEDY, "structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}}
    )
    assert pattern.status_code == 400 and "whitespace_pattern" in pattern.json()["error"]["message"]


def test_disable_additional_properties_closes_every_object_schema():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "string"}, "inner": {"type": "object", "properties": {}}},
        "$defs": {"Open": {"type": "object", "additionalProperties": True}},
        "anyOf": [{"properties": {"x": {"type": "integer"}}}],
        "items": {"type": "object"},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["properties"] == {"type": "string"}  # a property named "properties" is no schema map
    assert closed["$defs"]["Open"]["additionalProperties"] is True
    assert closed["anyOf"][0]["additionalProperties"] is False and closed["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"guided_json": SCHEMA, "structured_outputs": {"regex": "a"}}, ["guided_json", "structured_outputs.regex"]),
        ({"structured_outputs": {"json": SCHEMA, "choice": ["a"]}}, ["structured_outputs.json", "structured_outputs.choice"]),
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, ["guided_json", "response_format"]),
        ({"structured_outputs": {"disable_fallback": True}}, ["structured_outputs"]),
    ],
)  # fmt: skip
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_two_constraints_or_none_are_a_400_naming_them(client, fields, named, endpoint):
    body = {**GREEDY, **fields}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    response = client.post(endpoint, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert all(name in error["message"] for name in named), error
    assert error["param"] == named[0].split(".")[0]


# ------------------------------------------------------------------ models, fingerprint
def test_model_card_by_id(client):
    listed = client.get("/v1/models").json()["data"]
    for card in listed:
        assert client.get(f"/v1/models/{card['id']}").json() == card
    missing = client.get("/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "The model `nope` does not exist.", "type": "NotFoundError", "param": "model", "code": 404
    }  # fmt: skip


def test_system_fingerprint_on_every_response_and_stable(engine):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with client_for(engine) as client:
        fingerprint = complete(client)["system_fingerprint"]
        assert re.fullmatch("fp_[0-9a-f]{12}", fingerprint)
        assert client.post("/v1/chat/completions", json=chat).json()["system_fingerprint"] == fingerprint
        for path, body in (("/v1/completions", {**GREEDY, "max_tokens": 4}), ("/v1/chat/completions", chat)):
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            with client.stream("POST", path, json=stream) as r:
                assert {event["system_fingerprint"] for event in sse_events(r)} == {fingerprint}
    with client_for(engine) as other:  # another server of the same build and model
        assert complete(other)["system_fingerprint"] == fingerprint
    model = engine.model_info
    assert system_fingerprint(dataclasses.replace(model, dtype="bfloat16")) != fingerprint
    assert system_fingerprint(dataclasses.replace(model, path="/elsewhere")) != fingerprint


# ------------------------------------------------------------------ suffix (fill-in-the-middle)
def test_suffix_without_fim_tokens_is_a_400(client):
    response = client.post("/v1/completions", json={**GREEDY, "suffix": "return x"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "suffix" and "fill-in-the-middle" in response.json()["error"]["message"]


def test_suffix_builds_the_prefix_suffix_middle_prompt(fim_engine):
    tokenizer = fim_engine.model_info.tokenizer
    fim_prefix, fim_suffix, fim_middle = (
        tokenizer.get_vocab()[f"<fim_{part}>"] for part in ("prefix", "suffix", "middle")
    )
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    prefix_ids, suffix_ids = (tokenizer.encode(text, add_special_tokens=False) for text in (prefix, suffix))
    layout = [fim_prefix, *prefix_ids, fim_suffix, *suffix_ids, fim_middle]
    with client_for(fim_engine) as client:
        by_hand = complete(client, prompt=layout, max_tokens=12, ignore_eos=True)
        for prompt in (prefix, prefix_ids):  # a text prompt, and the same as token ids
            fim = complete(client, prompt=prompt, suffix=suffix, max_tokens=12, ignore_eos=True)
            assert fim["usage"]["prompt_tokens"] == len(layout)
            assert fim["choices"][0]["text"] == by_hand["choices"][0]["text"]
        for refused in ({"echo": True}, {"truncate_prompt_tokens": 4}):
            r = client.post("/v1/completions", json={**GREEDY, "suffix": suffix, **refused})
            assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


# ------------------------------------------------------------------ completion_tokens_details
class FirstCharsReasoning(ReasoningParser):
    """Test format: the first 12 characters of the output are the reasoning."""

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        return text[:12], text[12:]


def test_reasoning_tokens_in_usage(engine):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Think"}], "max_tokens": 16, "ignore_eos": True,
            "temperature": 0, "logprobs": True, "return_tokens_as_token_ids": True}  # fmt: skip
    with client_for(engine) as plain:
        assert "completion_tokens_details" not in plain.post("/v1/chat/completions", json=chat).json()["usage"]
    tokenizer = engine.model_info.tokenizer
    with client_for(engine, reasoning_parser=FirstCharsReasoning) as thinking:
        whole = thinking.post("/v1/chat/completions", json=chat).json()
        count = whole["usage"]["completion_tokens_details"]["reasoning_tokens"]
        ids = [int(t["token"].removeprefix("token_id:")) for t in whole["choices"][0]["logprobs"]["content"]]
        assert 0 < count < len(ids) == whole["usage"]["completion_tokens"]
        # the fewest leading tokens that hold the 12 reasoning characters
        assert len(tokenizer.decode(ids[: count - 1], skip_special_tokens=True)) < 12
        assert len(tokenizer.decode(ids[:count], skip_special_tokens=True)) >= 12
        stream = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        with thinking.stream("POST", "/v1/chat/completions", json=stream) as r:
            usage = sse_events(r)[-1]["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": count}
