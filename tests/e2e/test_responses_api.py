"""The Responses API end to end on the default model, through the official openai client:
greedy output equal to the chat completion's, streamed events, a function tool round trip,
``text.format`` json_schema, the store and ``previous_response_id``, and refusals."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
    },
}
AS_CHAT_TOOL = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


def same_as_chat(client, response, messages: list[dict], max_tokens: int, **chat_kwargs) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **chat_kwargs
    )
    assert response.output_text == (chat.choices[0].message.content or "")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


def test_greedy_response_and_stream_equal_the_chat_completion(client):
    kwargs = dict(
        model=MODEL, instructions="Answer briefly.", input="Name a colour.", max_output_tokens=12, temperature=0
    )
    response = client.responses.create(**kwargs)
    assert response.id.startswith("resp_") and response.status in ("completed", "incomplete")
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
    same_as_chat(client, response, messages, 12)

    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1]
    assert final.type == f"response.{response.status}"
    assert deltas == done.text == final.response.output_text == response.output_text
    assert final.response.usage.output_tokens == response.usage.output_tokens


def test_function_tool_round_trip_streamed(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    stream = client.responses.create(
        model=MODEL,
        input=question,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
        stream=True,
        store=False,
    )
    events = list(stream)
    args_done = next(e for e in events if e.type == "response.function_call_arguments.done")
    first = events[-1].response
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.arguments == args_done.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    second = client.responses.create(
        model=MODEL, input=question + first.output + [result], tools=[WEATHER], max_output_tokens=16, temperature=0
    )
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    messages = question + [
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"},
    ]
    same_as_chat(client, second, messages, 16, tools=[AS_CHAT_TOOL])


def test_json_schema_text_format(client):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 10}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input="Pick a colour, as JSON.",
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_store_retrieve_delete_and_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, temperature=0)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=MODEL, input="Again.", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    messages = [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Again."},
    ]
    same_as_chat(client, second, messages, 8)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tools": [{"type": "web_search_preview"}]},
        {"background": True},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
    ],
)
def test_hosted_features_are_a_400(client, kwargs):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**{"model": MODEL, "input": "x", "max_output_tokens": 2, **kwargs})
