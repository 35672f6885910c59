"""Beam search through the server in-process: ``use_beam_search``, ``length_penalty`` and
``early_stopping`` on /v1/completions (streaming too), /v1/chat/completions and /generate give
the offline engine's hypotheses; what beam search cannot honour is a 400 naming the field."""

from __future__ import annotations

import argparse
import json

import pytest
from fastapi.testclient import TestClient

from kiln import LLM, SamplingParams
from kiln.engine.async_engine import AsyncEngine
from kiln.entrypoints.openai.api_server import build_app
from kiln.entrypoints.openai.cli_args import add_serve_args
from kiln.entrypoints.openai.serving import ServerOptions

BEAM = {"model": "tiny", "use_beam_search": True, "n": 3, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256, block_size=16)


@pytest.fixture
def client(llm):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    options = ServerOptions(served_model_names=["tiny"], disable_log_requests=True)
    with TestClient(build_app(AsyncEngine(llm.engine, log_stats_interval=None), options, parser.parse_args([]))) as c:
        yield c


def offline(llm, prompt_ids, **fields) -> list[str]:
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=6, ignore_eos=True, **fields)
    return [o.text for o in llm.generate([{"prompt_token_ids": prompt_ids}], params)[0].outputs]


def test_completions(llm, client):
    expected = offline(llm, llm.get_tokenizer().encode("Once upon a time"), length_penalty=0.5)
    r = client.post("/v1/completions", json={**BEAM, "prompt": "Once upon a time", "length_penalty": 0.5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in body["choices"]] == expected
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 18


def test_completions_stream(llm, client):
    expected = offline(llm, llm.get_tokenizer().encode("Once upon a time"), early_stopping=True)
    fields = {**BEAM, "prompt": "Once upon a time", "early_stopping": True, "stream": True}
    texts, finishes = ["", "", ""], [None, None, None]
    with client.stream("POST", "/v1/completions", json=fields) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
                    finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
    assert texts == expected and finishes == ["length"] * 3


def test_chat(llm, client):
    messages = [{"role": "user", "content": "Say hi"}]
    expected = offline(llm, llm.apply_chat_template(messages))
    r = client.post("/v1/chat/completions", json={**BEAM, "messages": messages})
    assert r.status_code == 200, r.text
    assert [c["message"]["content"] for c in r.json()["choices"]] == expected


def test_generate(llm, client):
    expected = offline(llm, llm.get_tokenizer().encode("Hello"), length_penalty=2.0)
    fields = {"use_beam_search": True, "n": 3, "max_tokens": 6, "ignore_eos": True, "length_penalty": 2.0}
    r = client.post("/generate", json={"prompt": "Hello", **fields})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == ["Hello" + t for t in expected]


@pytest.mark.parametrize(
    "route,fields,param,says",
    [
        ("/v1/completions", {"top_p": 0.5}, "top_p", "not supported with beam search"),
        ("/v1/completions", {"logprobs": 2}, "logprobs", "not supported with beam search"),
        ("/v1/completions", {"guided_regex": "[a-z]+"}, "guided", "not supported with beam search"),
        ("/v1/completions", {"use_beam_search": False, "early_stopping": True}, "early_stopping", "beam search only"),
        ("/v1/completions", {"early_stopping": "maybe"}, "early_stopping", "should be 'never'"),
        ("/generate", {"stop": ["x"]}, "stop", "not supported with beam search"),
        ("/v1/completions", {"n": 300}, "n", "at most 256 sequences per request (--max-num-seqs)"),
    ],
)
def test_refusals(client, route, fields, param, says):
    body = {**BEAM, "prompt": "Hi", **fields}
    if route == "/generate":
        body = {k: v for k, v in body.items() if k != "model"}
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in (error.get("param") or "") + error["message"]
    assert says in error["message"]
