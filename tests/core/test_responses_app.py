"""``/v1/responses`` in-process on a tiny model: the chat path's greedy output, the stream's event
protocol, the store, input items as chat messages, and the features refused by name."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from tests.core.test_server_app import make_app, serve_args

from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import build_app
from kiln.entrypoints.openai.protocol_responses import ResponsesRequest
from kiln.entrypoints.openai.serving import ServerOptions
from kiln.entrypoints.openai.serving_responses import (
    INPUT_ITEMS,
    OutputItems,
    ResponseStore,
    StoredResponse,
    items_to_messages,
)
from kiln.interfaces.parsers import DeltaMessage, ReasoningParser, ToolCallDelta


def tiny_engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(
        EngineConfig.create(
            model=tiny_model_dir("llama"), max_model_len=256, block_size=16, dtype="float32", max_num_seqs=8
        )
    )


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    _, app = make_app(tiny_engine(tiny_model_dir))
    with TestClient(app) as c:
        yield c


class PrefixReasoning(ReasoningParser):
    """The first 12 characters are reasoning, the rest the answer: random text splits both ways."""

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        return text[:12], text[12:]


def chat_text(client, messages: list[dict], max_tokens: int) -> tuple[str, dict]:
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"] or "", body


def output_text(response: dict) -> str:
    return "".join(p["text"] for i in response["output"] if i["type"] == "message" for p in i["content"])


def sse_events(text: str) -> list[dict]:
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        events.append(payload)
    return events


def test_greedy_response_equals_the_chat_completion(client):
    r = client.post(
        "/v1/responses",
        json={"input": "Hello there", "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    response = r.json()
    expected, chat = chat_text(
        client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}], 6
    )
    assert response["id"].startswith("resp_") and response["object"] == "response"
    assert output_text(response) == expected
    usage = response["usage"]
    assert usage["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    length = chat["choices"][0]["finish_reason"] == "length"
    assert response["status"] == ("incomplete" if length else "completed")
    assert response["incomplete_details"] == ({"reason": "max_output_tokens"} if length else None)


def test_stream_events_tell_the_same_response(client):
    body = {"input": "Count with me", "max_output_tokens": 6, "temperature": 0, "stream": True}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    final = events[-1]["response"]
    assert events[-1]["type"] == f"response.{final['status']}"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    expected, _ = chat_text(client, [{"role": "user", "content": "Count with me"}], 6)
    assert deltas == output_text(final) == expected
    assert client.get(f"/v1/responses/{final['id']}").json() == final  # stored as streamed


def test_store_get_delete_and_previous_response_id(client):
    first = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4, "temperature": 0}).json()
    reply = output_text(first)
    second = client.post(
        "/v1/responses",
        json={"input": "And then?", "previous_response_id": first["id"], "max_output_tokens": 4, "temperature": 0},
    ).json()
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And then?"},
    ]
    expected, chat = chat_text(client, conversation, 4)
    assert output_text(second) == expected
    assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert second["previous_response_id"] == first["id"]

    assert client.get(f"/v1/responses/{first['id']}").json() == first
    deleted = client.delete(f"/v1/responses/{first['id']}")
    assert deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
    for r in (client.get(f"/v1/responses/{first['id']}"), client.delete(f"/v1/responses/{first['id']}")):
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    gone = client.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"

    stateless = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2, "store": False}).json()
    assert client.get(f"/v1/responses/{stateless['id']}").status_code == 404


def test_store_drops_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    store.get("a")  # now "b" is the oldest
    store.put("c", StoredResponse({"id": "c"}, []))
    assert len(store) == 2 and store.get("a").body == {"id": "a"} and store.get("c").body == {"id": "c"}
    with pytest.raises(Exception, match="not found"):
        store.get("b")


def test_store_is_bounded_in_bytes_too():
    store = ResponseStore(capacity=100, max_bytes=3000)
    for i in range(10):
        store.put(f"r{i}", StoredResponse({"id": f"r{i}"}, [{"role": "assistant", "content": "x" * 1000}]))
    assert store.bytes <= 3000 and len(store) == 2
    assert store.get("r9").body == {"id": "r9"}
    store.delete("r9")
    assert len(store) == 1 and 0 < store.bytes <= 1500


def test_input_items_become_chat_messages():
    req = ResponsesRequest(
        input=[
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "5 C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20 C"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Cold and warm.", "annotations": []}]},
        ]
    )
    call = lambda i, city: {  # noqa: E731
        "id": i,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    assert items_to_messages(req.input) == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("c1", "Oslo"), call("c2", "Rome")],
            "reasoning_content": "Look it up.",
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "20 C"},
        {"role": "assistant", "content": [{"type": "text", "text": "Cold and warm."}]},
    ]


def test_output_items_and_their_events():
    output = OutputItems()
    output.feed(DeltaMessage(reasoning_content="Think"))
    output.feed(DeltaMessage(reasoning_content="ing.", content="Calling"))
    output.feed(DeltaMessage(tool_calls=[ToolCallDelta(0, "call-1", "f", '{"x": 1}')]))
    output.finish(incomplete=False)
    assert [i["type"] for i in output.items] == ["reasoning", "message", "function_call"]
    assert output.items[0]["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert output.items[1]["content"][0]["text"] == "Calling"
    assert output.items[2]["call_id"] == "call-1" and output.items[2]["arguments"] == '{"x": 1}'
    assert all(i["status"] == "completed" for i in output.items)
    kinds = [e["type"] for e in output.take_events()]
    assert kinds[:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
    ]
    assert kinds[-4:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert kinds.count("response.output_item.done") == 3 and output.take_events() == []
    # Output items are valid input items (a client sends them back), and replay as one assistant turn.
    assert items_to_messages(INPUT_ITEMS.validate_python(output.items)) == [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Calling"}],
            "reasoning_content": "Thinking.",
            "tool_calls": [{"id": "call-1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        }
    ]


def test_an_empty_reply_is_an_empty_message():
    output = OutputItems()
    output.finish(incomplete=True)
    assert output.items[0]["type"] == "message" and output.items[0]["status"] == "incomplete"
    assert output.items[0]["content"][0]["text"] == ""


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [{"type": "web_search_preview"}]}, "tools", "web_search_preview"),
        ({"background": True}, "background", "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "reasoning.encrypted_content"),
        ({"truncation": "auto"}, "truncation", "auto"),
        ({"top_logprobs": 2}, "top_logprobs", "Extra inputs"),
        ({"temperature": "NaN"}, "temperature", "finite"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]}, "input", "encrypted"),
        ({"tool_choice": "auto", "tools": [{"type": "function", "name": "f"}]}, "tool_choice", "tool-call-parser"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "16"),
        ({"input": []}, "input", "at least 1 item"),
        ({"max_output_tokens": 10_000}, "max_output_tokens", "maximum context length"),  # the chat path's check
    ],
)
def test_unsupported_features_are_refused_by_name(client, body, param, words):
    r = client.post("/v1/responses", json={"input": "x", "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_unknown_model_is_a_404(client):
    r = client.post("/v1/responses", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_reasoning_parser_output_becomes_a_reasoning_item(tiny_model_dir):
    options = ServerOptions(served_model_names=["tiny"], disable_log_requests=True, reasoning_parser=PrefixReasoning)
    app = build_app(AsyncEngine(tiny_engine(tiny_model_dir), log_stats_interval=None), options, serve_args([]))
    body = {"input": "Why?", "max_output_tokens": 8, "temperature": 0}
    with TestClient(app) as client:
        response = client.post("/v1/responses", json=body).json()
        events = sse_events(client.post("/v1/responses", json={**body, "stream": True}).text)
        _, chat = chat_text(client, [{"role": "user", "content": "Why?"}], 8)
    message = chat["choices"][0]["message"]
    reasoning, answer = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == message["reasoning_content"]
    assert answer["type"] == "message" and output_text(response) == message["content"]
    reasoning_tokens = chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == reasoning_tokens > 0
    streamed_usage = events[-1]["response"]["usage"]  # cached_tokens differ: the prompt is cached by now
    assert streamed_usage["output_tokens_details"] == response["usage"]["output_tokens_details"]
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert streamed == message["reasoning_content"]
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]
