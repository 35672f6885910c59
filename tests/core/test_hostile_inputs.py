"""Hostile input to every endpoint, in-process on a tiny model: non-finite and out-of-range numbers,
invalid Unicode, bodies that are not JSON (or not UTF-8), wrong types, odd headers and URLs, flags
that would do nothing. Every answer is a 4xx with an OpenAI-style error body or a valid 200, never a
5xx, and the server gives the same greedy text after the barrage as before it."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient
from tests.core.test_pooling_server import pooling_clients  # noqa: F401  (a fixture)
from tests.core.test_server_app import engine, make_app, serve_args  # noqa: F401  (engine is a fixture)

from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import run_server
from kiln.entrypoints.openai.validation import check_generation_overrides

BAD = "\ud800"  # a lone surrogate: json.dumps writes the escape "\ud800", as a hostile client would
X = "__X__"  # where a raw JSON literal goes in a body (json.dumps cannot write 1e999)

SAMPLING_NUMBERS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "n",
    "best_of",
    "seed",
    "min_tokens",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)


@dataclass(frozen=True)
class Endpoint:
    """A JSON endpoint: a valid body, its top-level numeric fields, and places a hostile value can go
    (an override with ``X`` somewhere in it, and the ``param`` the error must name). ``server``: the
    model that answers it, "generate" or a pooling one of ``pooling_clients`` ("embed", "score")."""

    body: dict
    numbers: tuple[str, ...]
    slots: tuple[tuple[dict, str], ...]
    server: str = "generate"


CHAT_MESSAGES = [{"role": "user", "content": "hello there"}]
TOOL = {"type": "function", "function": {"name": "f", "description": X, "parameters": {"type": "object"}}}
EMBED = Endpoint(
    {"model": "tiny", "input": "hello there"},
    ("dimensions", "truncate_prompt_tokens", "priority"),
    (
        ({"input": X}, "input"),
        ({"input": ["fine", X]}, "input"),
        ({"input": [1, X]}, "input"),
        ({"model": X}, "model"),
        ({"user": X}, "user"),
        ({"input": None, "messages": [{"role": "user", "content": X}]}, "messages"),
    ),
    "embed",
)
SCORE = Endpoint(
    {"model": "tiny", "text_1": "hello", "text_2": ["there", "world"]},
    ("truncate_prompt_tokens", "priority"),
    (({"text_1": X}, "text_1"), ({"text_2": ["fine", X]}, "text_2")),
    "score",
)
RERANK = Endpoint(
    {"model": "tiny", "query": "hello", "documents": ["there", "world"]},
    ("top_n", "truncate_prompt_tokens", "priority"),
    (({"query": X}, "query"), ({"documents": ["fine", X]}, "documents"), ({"documents": [{"text": X}]}, "documents")),
    "score",
)

# Every endpoint that takes a JSON body: a new one (pooling, ...) is one entry here.
ENDPOINTS = {
    "/v1/completions": Endpoint(
        {"model": "tiny", "prompt": "hello there", "max_tokens": 4},
        (*SAMPLING_NUMBERS, "logprobs", "length_penalty", "priority"),
        (
            ({"prompt": X}, "prompt"),
            ({"prompt": ["fine", X]}, "prompt"),
            ({"prompt": [1, X]}, "prompt"),
            ({"stop": [X]}, "stop"),
            ({"model": X}, "model"),
            ({"user": X}, "user"),
            ({"logit_bias": {"5": X}}, "logit_bias"),
            ({"guided_json": {"type": "object", "properties": {"a": {"maximum": X}}}}, "guided_json"),
        ),
    ),
    "/v1/chat/completions": Endpoint(
        {"model": "tiny", "messages": CHAT_MESSAGES, "max_tokens": 4},
        (*SAMPLING_NUMBERS, "top_logprobs", "max_completion_tokens", "length_penalty", "priority"),
        (
            ({"messages": [{"role": "user", "content": X}]}, "messages"),
            ({"messages": [{"role": "user", "content": [{"type": "text", "text": X}]}]}, "messages"),
            ({"messages": [{"role": X, "content": "hi"}]}, "messages"),
            ({"messages": [{"role": "user", "content": "hi", "name": X}]}, "messages"),
            ({"tools": [TOOL]}, "tools"),
            ({"chat_template_kwargs": {"k": X}}, "chat_template_kwargs"),
            ({"stop": X}, "stop"),
            ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": [X]}}}}, "response_format"),
        ),
    ),
    "/tokenize": Endpoint(
        {"model": "tiny", "prompt": "hello there"},
        (),
        (
            ({"prompt": X}, "prompt"),
            ({"prompt": None, "messages": [{"role": "user", "content": X}]}, "messages"),
            ({"prompt": None, "messages": CHAT_MESSAGES, "tools": [TOOL]}, "tools"),
        ),
    ),
    "/detokenize": Endpoint(
        {"model": "tiny", "tokens": [5, 6, 7]},
        (),
        (({"model": X}, "model"), ({"tokens": [1, X]}, "tokens")),
    ),
    "/generate": Endpoint(
        {"prompt": "hello there", "max_tokens": 4},
        (*SAMPLING_NUMBERS, "logprobs"),
        (
            ({"prompt": X}, "prompt"),
            ({"prompt": [1, X]}, "prompt"),
            ({"stop": [X]}, "stop"),
            ({"bad_words": [X]}, "bad_words"),
            ({"logit_bias": {"5": X}}, "logit_bias"),
        ),
    ),
    "/v1/responses": Endpoint(
        {"model": "tiny", "input": "hello there", "max_output_tokens": 4},
        ("max_output_tokens", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "priority"),
        (
            ({"input": X}, "input"),
            ({"instructions": X}, "instructions"),
            ({"input": [{"role": "user", "content": [{"type": "input_text", "text": X}]}]}, "input"),
            ({"metadata": {"k": X}}, "metadata"),
        ),
    ),
    "/v1/embeddings": EMBED,
    "/pooling": EMBED,
    "/classify": Endpoint(
        {"model": "tiny", "input": "hello there"},
        ("truncate_prompt_tokens", "priority"),
        (({"input": X}, "input"), ({"input": ["fine", X]}, "input"), ({"user": X}, "user")),
        "score",
    ),
    "/score": SCORE,  # on a cross-encoder; the /v1 spellings on an embedding model
    "/v1/score": dataclasses.replace(SCORE, server="embed"),
    "/rerank": RERANK,
    "/v1/rerank": dataclasses.replace(RERANK, server="embed"),
    "/v2/rerank": RERANK,
}
SAMPLING_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate")  # every SamplingParams field
NON_FINITE = ("NaN", "Infinity", "-Infinity", "1e999", '"NaN"', '"Infinity"', '"-inf"', '"1e999"')


@dataclass
class Server:
    client: TestClient
    greedy_before: list[str]  # taken before any hostile request


@pytest.fixture(scope="module")
def server(engine):  # noqa: F811
    _, app = make_app(engine)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield Server(client, greedy_answers(client))


@pytest.fixture
def client(request, server):
    """The generation server's client, or the pooling model's that answers the test's ``path``."""
    path = request.node.callspec.params.get("path") if hasattr(request.node, "callspec") else None
    kind = ENDPOINTS[path].server if path in ENDPOINTS else "generate"
    return server.client if kind == "generate" else request.getfixturevalue("pooling_clients")[kind]


def greedy_answers(client) -> list[str]:
    answers = []
    for path, body in (
        ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": CHAT_MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True}),
    ):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        answers.append(choice.get("text") or choice["message"]["content"])
    return answers


def post(client, path: str, body: dict, literal: str | None = None):
    """POST ``body`` as JSON with ``literal`` (raw JSON text) where ``X`` stands."""
    text = json.dumps(body)
    if literal is not None:
        assert f'"{X}"' in text
        text = text.replace(f'"{X}"', literal)
    return client.post(path, content=text.encode("utf-8"), headers={"content-type": "application/json"})


def assert_clean(r) -> None:
    """A valid 200 or a 4xx with OpenAI's error body; never a 5xx."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code == 200:
        assert not r.headers["content-type"].startswith("application/json") or r.json() is not None
        return
    assert 400 <= r.status_code < 500
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == r.status_code and error["message"] and error["type"].endswith("Error")


def assert_refused(r, param: str | None) -> None:
    assert_clean(r)
    assert r.status_code == 400, r.text[:500]
    assert r.json()["error"]["param"] == param, r.json()["error"]


# --------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("literal", NON_FINITE)
@pytest.mark.parametrize("path", ENDPOINTS)
def test_non_finite_numbers_are_refused_naming_the_field(client, path, literal):
    spec = ENDPOINTS[path]
    for name in spec.numbers:
        assert_refused(post(client, path, {**spec.body, name: X}, literal), name)
    if '"' not in literal:  # JSON forbids these anywhere, not only in numeric fields
        for override, param in spec.slots:
            assert_refused(post(client, path, {**spec.body, **override}, literal), param)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses"])
def test_streaming_requests_are_refused_before_the_stream_starts(client, path):
    spec = ENDPOINTS[path]
    r = post(client, path, {**spec.body, "stream": True, "temperature": X}, "NaN")
    assert_refused(r, "temperature")
    assert r.headers["content-type"].startswith("application/json")


OUT_OF_RANGE = [
    ("temperature", -0.5),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 2**70),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("n", 0),
    ("n", 1000),  # past --max-num-seqs
    ("n", 10**400),
    ("best_of", 0),
    ("seed", 2**64),
    ("seed", -(2**64)),
    ("min_tokens", -1),
    ("min_tokens", 5),  # past max_tokens=4
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 10**6),
    ("truncate_prompt_tokens", 0),
    ("logit_bias", {"5": 100.5}),
    ("logit_bias", {"5": -101}),
    ("logit_bias", {"five": 1}),
    ("logit_bias", {"999999999": 1}),
    ("logit_bias", {"5": "high"}),
    ("stop", [""]),
    ("stop", [1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("allowed_token_ids", []),
    ("bad_words", [3]),
    ("stop", [f"s{i}" for i in range(1025)]),  # past MAX_STRINGS: checked at every token
    ("bad_words", [f"w{i}" for i in range(1025)]),
    ("ignore_eos", "maybe"),
]


@pytest.mark.parametrize("path", SAMPLING_ENDPOINTS)
def test_sampling_values_out_of_range_are_refused_naming_the_field(client, path):
    spec = ENDPOINTS[path]
    for name, value in OUT_OF_RANGE:
        assert_refused(post(client, path, {**spec.body, name: value}), name)


# --------------------------------------------------------------------------- unicode
@pytest.mark.parametrize("path", ENDPOINTS)
def test_invalid_unicode_anywhere_is_refused_naming_where(client, path):
    spec = ENDPOINTS[path]
    for override, param in spec.slots:
        r = post(client, path, {**spec.body, **override}, json.dumps(BAD))
        assert_refused(r, param)
        assert "surrogate" in r.json()["error"]["message"]
    assert_refused(post(client, path, {**spec.body, BAD: 1}), None)  # in a key
    r = post(client, path, {**spec.body, "nested": {"deeper": [{BAD: 1}]}})
    assert_refused(r, "nested")


def test_valid_surrogate_pairs_and_odd_characters_are_served(client):
    for prompt in ("\U0001f600 smile", "a\x00b", "\u202e\ufeff\ufffd", "\U0010ffff"):
        r = post(client, "/v1/completions", {**ENDPOINTS["/v1/completions"].body, "prompt": prompt})
        assert r.status_code == 200, r.text
        r = post(client, "/tokenize", {"prompt": prompt})
        assert r.status_code == 200 and r.json()["count"] > 0


# --------------------------------------------------------------------------- bodies
NOT_JSON = [
    b"",
    b"{}",
    b"not json",
    b"[1, 2]",
    b"null",
    b'"text"',
    b"1e999",
    b"NaN",
    b"\xff\xfe{}",
    b'{"prompt": "\xed\xa0\x80"}',  # a surrogate encoded as UTF-8 bytes
    b'{"prompt": "caf\xe9"}',  # latin-1, not UTF-8
    "\ufeff{}".encode(),
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": ' + b"[" * 200 + b"]" * 200 + b"}",
    b'{"max_tokens": ' + b"1" * 5000 + b"}",
    b'{"prompt": "unterminated',
]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_malformed_and_empty_bodies_are_400(client, path):
    for raw in NOT_JSON:
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert_clean(r)
        assert r.status_code == 400, (raw[:40], r.text[:300])


@pytest.mark.parametrize("path", ENDPOINTS)
def test_content_types_and_headers(client, path):
    spec = ENDPOINTS[path]
    raw = json.dumps(spec.body).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        assert_clean(client.post(path, content=raw, headers={"content-type": content_type}))
    assert_clean(client.post(path, content=raw))  # no content-type
    weird = b"\xed\xa0\x80 \xff\xfe"  # a UTF-8 surrogate and bytes that are not UTF-8 at all
    headers = [(b"content-type", b"application/json"), (b"user-agent", weird), (b"authorization", weird)]
    assert client.post(path, content=raw, headers=headers).status_code == 200
    r = client.post(path, content=raw, headers={"content-type": "application/json; charset=latin-1"})
    assert r.status_code == 200


def test_odd_urls(client):
    for url in ("/v1/models/%ED%A0%80", "/v1/models/%ff%fe", "/v1/%00", "/v1/completions/" + "a" * 5000):
        assert_clean(client.get(url))
    body = ENDPOINTS["/v1/completions"].body
    assert post(client, "/v1/completions?x=%ED%A0%80&y=%ff", body).status_code == 200


# --------------------------------------------------------------------------- types and sizes
WRONG = (None, True, -1, 10**400, "\x00", [], {"a": {"b": []}})


def schema_fields(client, path: str) -> set[str]:
    """The top-level fields of the endpoint's request body, as its OpenAPI schema lists them."""
    schema = client.get("/openapi.json").json()
    body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = body["$ref"].rsplit("/", 1)[-1]
    return set(schema["components"]["schemas"][name]["properties"])


@pytest.mark.parametrize("path", ENDPOINTS)
def test_wrong_types_in_every_field_never_fail_the_server(client, path):
    spec = ENDPOINTS[path]
    names = {*schema_fields(client, path), *spec.numbers, *(name for override, _ in spec.slots for name in override)}
    for name in sorted(names):
        for value in WRONG:
            assert_clean(post(client, path, {**spec.body, name: value}))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_json_nested_inside_a_string_is_bounded_too(client, path):
    deep = "[" * 100_000  # JSON text in a string field escapes the body's depth check
    for constraint in ({"structural_tag": deep}, {"json": deep}):
        r = post(client, path, {**ENDPOINTS[path].body, "structured_outputs": constraint})
        assert_clean(r)
        assert r.status_code == 400


def test_large_but_valid_requests_are_served(client):
    body = ENDPOINTS["/v1/completions"].body
    for extra in (
        {"stop": [f"stop {i}" for i in range(1024)]},
        {"stop": ["x" * 100_000]},
        {"logit_bias": {str(i): 0.5 for i in range(2000)}},
        {"n": 8, "max_tokens": 2},
        {"prompt": [[7] * 8] * 8, "max_tokens": 2},
        {"allowed_token_ids": list(range(2000))},
        {"bad_words": [f"w{i}" for i in range(1024)]},
    ):
        r = post(client, "/v1/completions", {**body, **extra})
        assert r.status_code == 200, (list(extra), r.text[:300])
    r = post(client, "/v1/completions", {**body, "prompt": "x " * 100_000})
    assert_refused(r, "prompt")


# --------------------------------------------------------------------------- flags that would do nothing
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_and_priority_under_fcfs_are_refused(client, path):
    body = ENDPOINTS[path].body
    assert_refused(post(client, path, {**body, "stream_options": {"include_usage": True}}), "stream_options")
    r = post(client, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and '"usage"' in r.text and r.text.endswith("data: [DONE]\n\n")
    for priority in (1, -1, 10**400):
        assert_refused(post(client, path, {**body, "priority": priority}), "priority")
    assert post(client, path, {**body, "priority": 0}).status_code == 200


def test_priority_is_served_under_the_priority_policy(tiny_model_dir):
    config = EngineConfig.create(
        model=tiny_model_dir("llama"), max_model_len=64, block_size=16, dtype="float32", scheduling_policy="priority"
    )
    _, app = make_app(LLMEngine(config))
    with TestClient(app) as client:
        r = post(client, "/v1/completions", {**ENDPOINTS["/v1/completions"].body, "priority": -3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0


def test_bad_generation_overrides_fail_at_start_up():
    check_generation_overrides({"temperature": 0.2, "min_tokens": 20, "stop": ["x"]})  # max_tokens: per request
    for overrides, named in (
        ({"temprature": 0.5}, "'temprature'"),
        ({"max_new_tokens": 5}, "'max_new_tokens'"),
        ({"output_kind": 1}, "'output_kind'"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": "high"}, "top_p"),
        ({"logit_bias": {"5": 1000}}, "logit_bias"),
    ):
        with pytest.raises(ValueError, match=f"--override-generation-config: .*{named}"):
            check_generation_overrides(overrides)
    args = serve_args(["--override-generation-config", '{"temprature": 0.5}'])
    started = time.monotonic()
    with pytest.raises(ValueError, match="--override-generation-config"):
        run_server(args)
    assert time.monotonic() - started < 10  # before the model loads


# --------------------------------------------------------------------------- after the barrage
def test_server_is_healthy_and_deterministic_after_the_barrage(server, client, engine):  # noqa: F811
    assert client.get("/health").status_code == 200
    assert greedy_answers(client) == server.greedy_before
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        time.sleep(0.02)
    assert not engine.has_unfinished_requests() and engine.kv.usage == 0.0
