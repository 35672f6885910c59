"""The OpenAI-compatible server end to end, through the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from tests.e2e.conftest import MODEL

from kiln.testing.server import metric_value

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name three colours."}]
IGNORE_EOS = {"ignore_eos": True}


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_health_version_models(http, client):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "kiln-default"]


def test_completion_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason
    assert whole.usage.completion_tokens == 24 or whole.choices[0].finish_reason == "stop"


def test_chat_stream_matches_non_stream(client):
    kwargs = dict(model="kiln-default", messages=CHAT, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    stream = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert stream[-1].choices == [] and stream[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_choices_and_seed(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, n=3, temperature=1.0, seed=7)
    first = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    again = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # each choice samples on its own
    assert first.usage.completion_tokens == 36


def test_streaming_n_and_multiple_prompts(http):
    body = {"model": MODEL, "prompt": ["Hello", "Goodbye"], "max_tokens": 5, "n": 2, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 4 * 5
    finished = {c["index"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]}
    assert finished == {0, 1, 2, 3}


def test_completion_logprobs_legacy_shape(client):
    out = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(value)
        assert max(top.values()) == pytest.approx(value)  # greedy: the chosen token is the most likely
    assert lp.text_offset == sorted(lp.text_offset)


def test_completion_echo_with_logprobs(client):
    prompt = "Water boils at"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0)
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    assert choice.logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert len(choice.logprobs.tokens) == out.usage.prompt_tokens + 3


def test_chat_logprobs_openai_shape(client):
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token


def test_return_tokens_as_token_ids(http):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": True}
    tokens = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens)


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    stop = base.strip()[2:4] if len(base.strip()) > 4 else base.strip()[-1]
    out = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    choice = out.choices[0]
    assert stop not in choice.text and base.startswith(choice.text)
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop


def test_usage_matches_tokenize(client, http):
    prompt = "Count the tokens in this sentence, please."
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
    tokenized = http.post("/tokenize", json={"prompt": prompt}).json()
    assert out.usage.prompt_tokens == tokenized["count"] == len(tokenized["tokens"])
    assert out.usage.completion_tokens == 4
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert chat.usage.prompt_tokens == http.post("/tokenize", json={"messages": CHAT}).json()["count"]
    assert http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"] == prompt


def test_prefix_cache_reported_in_usage(client):
    prompt = "A long shared preamble that fills a few blocks of the cache. " * 8
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_vllm_extra_sampling_params(client):
    out = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=8,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 8,
            "ignore_eos": True,
            "stop_token_ids": [2],
            "skip_special_tokens": True,
            "seed": 1,
            "priority": 0,
        },  # fmt: skip
    )
    assert out.usage.completion_tokens == 8


def test_generate_endpoint(http):
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "presence_penalty": 2}
    text = http.post("/generate", json=body).json()["text"]
    assert len(text) == 1 and text[0].startswith("hello") and len(text[0]) > len("hello")
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["text"] == text


def test_request_id_header(http):
    r = http.get("/health", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert http.get("/version").headers["x-request-id"]


def test_api_key(server):
    import httpx

    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    for path in ("/v1/completions", "/generate", "/tokenize"):  # inference outside /v1 needs the key too
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer test-ke"}):
            r = httpx.post(server.url + path, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    for path in ("/health", "/version", "/metrics"):  # for load balancers and scrapers: open
        assert httpx.get(server.url + path).status_code == 200


def test_cors_preflight(server):
    import httpx

    r = httpx.options(
        server.url + "/v1/chat/completions",
        headers={
            "Origin": "https://example.com",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },  # fmt: skip
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] in ("*", "https://example.com")
    assert "POST" in r.headers["access-control-allow-methods"]


def test_disconnect_mid_stream_frees_blocks(server, http):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = http.get("/metrics").text
        if metric_value(text, "kiln:num_requests_running") == 0 and metric_value(text, "kiln:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.2)
    assert metric_value(text, "kiln:num_requests_running") == 0
    assert metric_value(text, "kiln:kv_cache_usage_perc") == 0
    assert metric_value(text, "kiln:request_success_total", finished_reason="abort") >= 1
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "Still there?", "max_tokens": 2}).is_success


def test_metrics_after_requests(client, http):
    client.completions.create(model=MODEL, prompt="Metrics", max_tokens=3, extra_body={"ignore_eos": True})
    text = http.get("/metrics").text
    assert metric_value(text, "kiln:time_to_first_token_seconds_count") >= 1
    assert metric_value(text, "kiln:e2e_request_latency_seconds_count") >= 1
    assert metric_value(text, "kiln:time_per_output_token_seconds_count") >= 1
    assert metric_value(text, "kiln:generation_tokens_total") >= 3
    assert metric_value(text, "kiln:prompt_tokens_total") >= 1
    assert metric_value(text, "kiln:request_success_total", finished_reason="length") >= 1
    assert metric_value(text, "kiln:prefix_cache_queries_total") >= metric_value(text, "kiln:prefix_cache_hits_total")


def test_32_concurrent_streaming_clients(client, async_client):
    prompts = [f"Write a sentence about the number {i}." for i in range(32)]
    expected = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0, extra_body=IGNORE_EOS)
        .choices[0]
        .text
        for p in prompts[:4]
    ]

    async def one(prompt: str) -> tuple[str, int, str]:
        stream = await async_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body=IGNORE_EOS, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        text, usage, reason = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage, reason

    async def run():
        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(run())
    assert all(usage == 16 and reason == "length" and text for text, usage, reason in results)
    assert [r[0] for r in results[:4]] == expected  # batched with 31 others, same greedy text


def test_model_card_fingerprint_and_suffix(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert completion.system_fingerprint == chat.system_fingerprint and completion.system_fingerprint.startswith("fp_")
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):  # SmolLM2's tokenizer has no FIM tokens
        client.completions.create(model=MODEL, prompt="def f(", suffix="\n    return x", max_tokens=8)
