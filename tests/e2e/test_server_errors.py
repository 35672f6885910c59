"""Bad input gets an OpenAI-style error with a 4xx code, never a 500, and the server keeps serving."""

from __future__ import annotations

import openai
import pytest
from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow

COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}

BAD = [
    ("/v1/completions", {**COMPLETION, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**COMPLETION, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**COMPLETION, "n": 0}, 400, "n"),
    ("/v1/completions", {**COMPLETION, "n": 100000}, 400, "n"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 4000}, 400, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "prompt": "word " * 2100}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {**COMPLETION, "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {**COMPLETION, "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {**COMPLETION, "model": "gpt-5"}, 404, "model"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {**COMPLETION, "use_beam_search": True, "top_p": 0.5}, 400, "top_p"),
    ("/v1/completions", {**COMPLETION, "length_penalty": 2.0}, 400, "length_penalty"),
    ("/v1/completions", {**COMPLETION, "guided_regex": "a(b"}, 400, "guided_regex"),
    ("/v1/completions", {**COMPLETION, "guided_grammar": "root ::= ("}, 400, "guided_grammar"),
    ("/v1/completions", {**COMPLETION, "guided_json": "{not json"}, 400, "guided_json"),
    ("/v1/completions", {**COMPLETION, "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {**COMPLETION, "guided_json": {"type": "object"}, "guided_regex": "a"}, 400, "guided_json"),
    ("/v1/completions", {**COMPLETION, "guided_regex": "(?i)a", "guided_decoding_backend": "xgrammar:no-fallback"},
     400, "guided"),
    ("/v1/completions", {**COMPLETION, "guided_regex": "a", "guided_whitespace_pattern": " "}, 400, "guided"),
    ("/v1/completions", {**COMPLETION, "best_of": 3, "n": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 9}, 400, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required", "tools": []}, 400, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ raise_exception('no') }}"}, 400, "chat_template"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), BAD, ids=[f"{p}:{b.get('param', i)}" for i, (p, b, *_) in enumerate(BAD)]
)
def test_bad_request(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    assert error["param"] == param, error


def test_invalid_json_body(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_unknown_route_is_json_404(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=-2)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])


def test_still_serving_after_errors(client):
    out = client.completions.create(model=MODEL, prompt="Still fine", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
