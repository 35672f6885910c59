"""Guided decoding cannot hurt the server: pathological constraints get a 400 or complete within a
bounded time (compiles past the limit are killed in their worker process), constraints that never
complete or dead-end end cleanly with their text, neighbours in the batch are unaffected, and the
compile cache stays within its budget. In-process server on a tiny model."""

from __future__ import annotations

import json
import re
import time

import pytest
from fastapi.testclient import TestClient
from tests.core.test_server_app import make_app

from kiln import LLM, SamplingParams
from kiln.engine.guided_limits import GuidedLimits
from kiln.engine.guided_manager import GuardedMatcher, GuideCache
from kiln.guided import GuidedDecodingParams, GuideMatcher, allocate_bitmask

TIMEOUT_S = 2  # tiny constraints compile in milliseconds; the pathological ones below take minutes


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with pytest.MonkeyPatch.context() as env:  # the limits are read when the engine starts
        env.setenv("KILN_GUIDED_COMPILE_TIMEOUT_S", str(TIMEOUT_S))
        env.setenv("KILN_GUIDED_MAX_BYTES", "65536")
        return LLM(tiny_model_dir("llama"), max_model_len=256, block_size=16, dtype="float32", max_num_seqs=8)


@pytest.fixture(scope="module")
def client(llm):
    _, app = make_app(llm.engine)
    with TestClient(app) as client:
        yield client


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def chat(client, max_tokens: int = 12, **fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Answer."}], "max_tokens": max_tokens}
    started = time.monotonic()
    response = client.post("/v1/chat/completions", json=body | fields)
    return response, time.monotonic() - started


def schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


# Nested rules make xgrammar's compile superlinear: 1000 of these (24 KB) take most of a minute.
SLOW_GRAMMAR = "root ::= r0\n" + "\n".join(f'r{i} ::= (r{i + 1} | "q")*' for i in range(1000)) + '\nr1000 ::= "z"'

# xgrammar 0.2.9 refuses a $ref cycle itself; 0.2.8 compiles it and Kiln finds no first token.
REF_CYCLE = "admits no output|Circular \\$ref chain"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (schema_format({"$ref": "#"}), REF_CYCLE),
        (schema_format({"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}), REF_CYCLE),
        ({"guided_grammar": "root ::= root"}, "admits no output"),
        ({"guided_json": json.dumps(nested(40))}, "KILN_GUIDED_MAX_DEPTH"),
        ({"guided_json": "[" * 100_000 + "]" * 100_000}, "nested too deeply"),
        (schema_format({"enum": [f"value_{i}" for i in range(10_000)]}), "KILN_GUIDED_MAX_BYTES"),
        ({"guided_choice": [f"option {i}" for i in range(10_000)]}, "KILN_GUIDED_MAX_BYTES"),
        ({"guided_regex": "a" * 70_000}, "KILN_GUIDED_MAX_BYTES"),
        ({"guided_grammar": SLOW_GRAMMAR}, f"compiling took longer than {TIMEOUT_S} s"),
        # xgrammar refuses (?i), so this falls back to lm-format-enforcer, whose DFA is exponential in it.
        ({"guided_regex": "(?i)(a|b)*a(a|b){24}"}, f"compiling took longer than {TIMEOUT_S} s"),
    ],
    ids=["ref-root", "ref-loop", "grammar-loop", "deep", "deep-text", "enum", "choice", "regex", "slow", "fallback"],
)
def test_pathological_constraints_get_a_400_in_bounded_time(client, request, fields, message):
    response, elapsed = chat(client, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert re.search(message, error["message"]), error
    assert elapsed < 60  # the worker start (imports, tokenizer tables) plus the limit, on a busy machine
    # A new constraint (a new compile) still works: a killed worker was replaced, nothing is stuck.
    fresh = "[0-9]{3}" + request.node.callspec.id
    ok, _ = chat(client, max_tokens=40, guided_regex=fresh)
    assert ok.status_code == 200 and re.fullmatch(fresh, ok.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_regex": "(a|aa)*b"},  # exponential for a backtracking matcher, linear for xgrammar
        {"guided_regex": "((a+)+)+(b{1,500}){1,500}"},
        {"guided_grammar": 'root ::= "(" root ")" | "x"'},  # recursive, with a base case
        schema_format({"enum": [f"value_{i}" for i in range(2_000)]}),
        schema_format({"type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False}),
    ],
    ids=["alternation", "nested-quantifiers", "recursive-grammar", "large-enum", "optional-self-reference"],
)
def test_heavy_but_sound_constraints_complete(client, fields):
    response, elapsed = chat(client, max_tokens=40, temperature=0, **fields)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and isinstance(choice["message"]["content"], str)
    assert elapsed < 60


def test_never_completing_schema_ends_at_length_with_its_text(client):
    # Every value of A holds another A: a valid prefix always exists, an end never does.
    endless = {"$ref": "#/$defs/A", "$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}},
                                                  "required": ["a"]}}}  # fmt: skip
    response, _ = chat(client, max_tokens=30, temperature=1.0, seed=1, **schema_format(endless))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith("{") and response.json()["usage"]["completion_tokens"] == 30


def test_empty_answer_is_an_empty_string_not_null(client, llm):
    eos = llm.get_tokenizer().eos_token_id
    response, _ = chat(client, logit_bias={str(eos): 100})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""


DEAD_END = 'root ::= "a" x | "b"\nx ::= x "c"'  # after "a" no token is allowed, ever


def test_dead_end_ends_the_sequence_and_spares_the_batch(llm):
    tok = llm.get_tokenizer()
    (a,) = tok.encode("a", add_special_tokens=False)
    dead = SamplingParams(max_tokens=10, temperature=0, logit_bias={a: 100.0},
                          guided_decoding=GuidedDecodingParams(grammar=DEAD_END))  # fmt: skip
    regex = SamplingParams(max_tokens=10, temperature=0, guided_decoding=GuidedDecodingParams(regex="[a-z]{4}"))
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = ["One", "Two", "Three"]
    alone = [llm.generate(p, s)[0].outputs[0] for p, s in zip(prompts[1:], [regex, free])]
    batch = [o.outputs[0] for o in llm.generate(prompts, [dead, regex, free])]
    assert batch[0].text == "a" and batch[0].finish_reason == "length"
    assert [(o.text, o.token_ids) for o in batch[1:]] == [(o.text, o.token_ids) for o in alone]


def test_dead_end_through_chat_keeps_the_text(client, llm):
    (a,) = llm.get_tokenizer().encode("a", add_special_tokens=False)
    response, _ = chat(client, guided_grammar=DEAD_END, logit_bias={str(a): 100}, temperature=0)
    choice = response.json()["choices"][0]
    assert response.status_code == 200 and choice["message"]["content"] == "a"
    assert choice["finish_reason"] == "length"
    # With the stop tokens banned too (min_tokens), the sequence still ends on its text, not garbage.
    response, _ = chat(client, guided_grammar=DEAD_END, logit_bias={str(a): 100}, temperature=0, min_tokens=5)
    choice = response.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("a", "length")


class FailingMatcher(GuideMatcher):
    """A backend's matcher that breaks after ``after`` tokens (a bug, or a runtime limit)."""

    def __init__(self, after: int) -> None:
        self.left = after

    def fill_bitmask(self, bitmask, row):
        if self.left == 0:
            raise RuntimeError("matcher broke")

    def accept(self, token_id):
        self.left -= 1
        return True

    def is_terminated(self):
        return False


def test_a_failing_matcher_allows_only_stop_tokens():
    vocab, stops = 100, [2, 63]  # 63: bit 31 of word 1, the int32 sign bit
    guarded = GuardedMatcher(FailingMatcher(after=1), stops, vocab)
    bitmask = allocate_bitmask(2, vocab)
    guarded.fill_bitmask(bitmask, 1)
    assert bitmask[1].tolist() == [-1] * 4  # the backend's row stands while it works
    assert guarded.accept(7) and not guarded.dead
    guarded.fill_bitmask(bitmask, 1)
    allowed = [t for t in range(vocab) if int(bitmask[1, t // 32]) >> (t % 32) & 1]
    assert guarded.dead and allowed == stops and not guarded.is_terminated()
    assert bitmask[0].tolist() == [-1] * 4  # the neighbour's row is untouched
    silent = GuardedMatcher(FailingMatcher(after=0), [], vocab)
    silent.fill_bitmask(bitmask, 0)
    assert silent.is_terminated()  # no stop token to offer: it ends where it is


def test_compile_cache_is_bounded_and_least_recently_used(llm):
    manager = llm.engine.input_processor.guided
    guides = [manager.compile(GuidedDecodingParams(regex=f"[0-9]{{{n}}}x")) for n in range(1, 5)]
    sizes = [g.memory_bytes() for g in guides]
    assert all(size > 0 for size in sizes)
    cache = GuideCache(max_bytes=sizes[0] + sizes[1] + sizes[2])
    for key, guide in zip("abc", guides):
        cache.put((key,), guide)
    assert cache.get(("a",)) is guides[0]  # now the most recently used
    cache.put(("d",), guides[3])
    assert cache.get(("b",)) is None and cache.get(("a",)) is guides[0] and cache.nbytes <= cache.max_bytes
    tiny = GuideCache(max_bytes=1)
    tiny.put(("a",), guides[0])
    assert len(tiny) == 0  # a guide over the whole budget is not kept
    assert manager.cache.nbytes <= manager.cache.max_bytes and len(manager.cache) > 0
    backend = manager.backend("xgrammar")
    assert backend.compiler.get_cache_size_bytes() == 0  # xgrammar's own, unbounded cache is off


def test_limits_from_the_environment(monkeypatch):
    monkeypatch.setenv("KILN_GUIDED_MAX_DEPTH", "8")
    monkeypatch.setenv("KILN_GUIDED_COMPILE_TIMEOUT_S", "0")
    limits = GuidedLimits.from_env()
    assert (limits.max_depth, limits.compile_timeout_s, limits.max_bytes) == (8, 0.0, 256 * 1024)
    with pytest.raises(ValueError, match="KILN_GUIDED_MAX_DEPTH"):
        limits.check(GuidedDecodingParams(json=nested(4)))
    limits.check(GuidedDecodingParams(json=nested(3)))  # 7 levels of objects
    monkeypatch.setenv("KILN_GUIDED_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="KILN_GUIDED_CACHE_MB"):
        GuidedLimits.from_env()
