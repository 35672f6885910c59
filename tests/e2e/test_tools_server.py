"""Tool calling end to end on the default model, through the official openai client."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import openai
import pytest
from tests.e2e.conftest import MODEL

from kiln.testing.server import RemoteServer

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}


def varied_tools(count: int = 20) -> list[dict]:
    kinds = [
        {"type": "string", "maxLength": 16},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"type": "number", "minimum": -1, "maximum": 1},
        {"type": "boolean"},
        {"enum": ["asc", "desc"]},
        {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        {
            "type": "object",
            "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
            "required": ["lat"],
        },
    ]
    tools = []
    for i in range(count):
        props = {f"p{j}": kinds[(i + 2 * j) % len(kinds)] for j in range(1 + i % 3)}
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": f"Tool number {i}",
                    "parameters": {"type": "object", "properties": props, "required": list(props)},
                },
            }
        )
    return tools


def check_calls(message, tools) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_required_and_named_calls_are_always_valid(async_client):
    tools = varied_tools()

    async def one(i: int, tool: dict):
        kwargs = dict(
            model=MODEL,
            messages=[{"role": "user", "content": f"Use {tool['function']['name']} on something."}],
            tools=[tool, WEATHER],
            max_tokens=300,
            temperature=1.0,
            seed=i,
            parallel_tool_calls=False,  # one call each: the constraint ends by itself (a 2-core CI budget)
        )
        if i % 2:
            kwargs["tool_choice"] = {"type": "function", "function": {"name": tool["function"]["name"]}}
        else:
            kwargs["tool_choice"] = "required"
        return await async_client.chat.completions.create(**kwargs)

    async def run():
        return await asyncio.gather(*(one(i, t) for i, t in enumerate(tools)))

    for i, (tool, out) in enumerate(zip(tools, asyncio.run(run()))):
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message, [tool, WEATHER])
        if i % 2:
            assert [c.function.name for c in choice.message.tool_calls] == [tool["function"]["name"]]


def test_streamed_tool_calls_follow_the_openai_delta_shape(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # one call: the constraint then ends by itself
        max_tokens=200,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            else:
                assert delta.function.name is None  # the name comes once
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


def test_two_turns_with_a_tool_result_in_the_history(client):
    first = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=0,
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": -3, "sky": "snow"})},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=40)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_auto_parses_hermes_calls_and_malformed_output_is_content(client):
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER],
        max_tokens=60,
        extra_body={"guided_regex": forced.replace("{", r"\{").replace("}", r"\}")},  # the model "writes" a call
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Rome", "unit": "C"}
    broken = "<tool_call>\\{not json</tool_call> sorry"
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        max_tokens=40,
        extra_body={"guided_regex": broken},
    )
    assert out.choices[0].message.content == "<tool_call>{not json</tool_call> sorry"
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason == "stop"


def test_auto_without_the_flag_is_a_400(server):
    plain = openai.OpenAI(base_url=server.url + "/v1", api_key="test-key", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        plain.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


@pytest.mark.parametrize(
    ("args", "regex", "expected"),
    [
        (  # a parser from a file, and the example plugin's chat template by name
            ["--tool-parser-plugin", str(Path(__file__).with_name("file_tool_parser.py")),
             "--tool-call-parser", "arrow_call", "--chat-template", "example_calls"],
            r'Here\. >>> get_weather \{"city": "Lima", "unit": "C"\}',
            ("Here. ", {"city": "Lima", "unit": "C"}),
        ),
        (  # the third-party example plugin's parser, selected by name
            ["--tool-call-parser", "example_call", "--chat-template", "example_calls"],
            r'Sure\.\nCALL get_weather \{"city": "Pune", "unit": "F"\}',
            ("Sure.\n", {"city": "Pune", "unit": "F"}),
        ),
    ],
)  # fmt: skip
def test_plugin_parsers_by_name(default_model_dir, args, regex, expected):
    with RemoteServer(
        ["--max-model-len", "1024", "--served-model-name", MODEL, "--enable-auto-tool-choice", *args]
    ) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], max_tokens=60)
        out = client.chat.completions.create(extra_body={"guided_regex": regex}, **kwargs)
        message = out.choices[0].message
        assert (message.content, json.loads(message.tool_calls[0].function.arguments)) == expected
        chunks = list(client.chat.completions.create(stream=True, extra_body={"guided_regex": regex}, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        arguments = "".join(
            t.function.arguments or "" for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []
        )
        assert (content, json.loads(arguments)) == expected


def test_reasoning_content_whole_and_streamed(default_model_dir):
    args = [
        "--max-model-len",
        "1024",
        "--served-model-name",
        MODEL,
        "--enable-reasoning",
        "--reasoning-parser",
        "deepseek_r1",
    ]
    with RemoteServer(args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        kwargs = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "2+2?"}],
            max_tokens=40,
            extra_body={"guided_regex": r"<think>Two and two\.</think>Four\."},  # the model "thinks"
        )
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert (message.reasoning_content, message.content) == ("Two and two.", "Four.")
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
        assert (reasoning, content) == ("Two and two.", "Four.")
