"""Guided decoding through the server on the default model: every constrained output is valid,
through the official openai client (extra_body and response_format), streaming and not."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from tests.e2e.conftest import MODEL

from kiln.testing.schemas import CHARACTER_SCHEMA

pytestmark = pytest.mark.slow


def varied_schemas(count: int = 50) -> list[dict]:
    """Nested objects, arrays, enums, required fields, bounded numbers, $ref/definitions."""
    leaves = [
        {"type": "string", "maxLength": 12},
        {"type": "integer", "minimum": -5, "maximum": 500},
        {"type": "number", "minimum": 0, "maximum": 1},
        {"type": "boolean"},
        {"enum": ["low", "mid", "high"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
        {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        {"$ref": "#/definitions/Point"},
        {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["id"]},
        {"type": ["string", "null"], "maxLength": 5},
    ]
    names = ["name", "age", "score", "ok", "level", "digits", "words", "where", "child", "note"]
    schemas = []
    for i in range(count):
        picked = [(names[(i + j) % 10] + str(j), leaves[(i * 3 + j * 7) % 10]) for j in range(1 + i % 4)]
        properties = dict(picked)
        if i % 5 == 4:  # nest one level deeper
            properties = {"outer": {"type": "object", "properties": properties, "required": list(properties)}}
        required = list(properties)[: 1 + i % len(properties)]
        schemas.append(
            {
                "type": "object",
                "properties": properties,
                "required": required,
                "definitions": {
                    "Point": {
                        "type": "object",
                        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"enum": [1, 2]}},
                        "required": ["x", "y"],
                    }
                },
            }
        )
    return schemas


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fifty_json_schemas_all_validate(async_client, temperature):
    schemas = varied_schemas()

    async def one(i: int, schema: dict) -> str:
        messages = [{"role": "user", "content": f"Fill in record number {i} as JSON."}]
        kwargs = dict(model=MODEL, messages=messages, max_tokens=400, temperature=temperature, seed=i)
        if i % 2:
            kwargs["extra_body"] = {"guided_json": schema}
        else:
            kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": f"r{i}", "schema": schema}}
        if i % 3 == 0:
            stream = await async_client.chat.completions.create(stream=True, **kwargs)
            parts, reason = [], None
            async for chunk in stream:
                parts.append(chunk.choices[0].delta.content or "")
                reason = chunk.choices[0].finish_reason or reason
            return "".join(parts), reason
        out = await async_client.chat.completions.create(**kwargs)
        return out.choices[0].message.content, out.choices[0].finish_reason

    async def run():
        return await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))

    for schema, (text, reason) in zip(schemas, asyncio.run(run())):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_character_schema_from_the_seed(client):
    prompt = (
        "Meet our valorous character, named Knight, who has reached the age of 32. Clad in impenetrable plate "
        "armor, Knight is well-prepared for any battle. Armed with a trusty sword and boasting a strength score "
        "of 90, this character stands as a formidable warrior on the field. Please provide details for this "
        "character, including their Name, Age, preferred Armor, Weapon, and Strength"
    )
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=200,
        temperature=0,
        extra_body={"guided_json": json.dumps(CHARACTER_SCHEMA)},
    )
    value = json.loads(out.choices[0].text)
    jsonschema.validate(value, CHARACTER_SCHEMA)
    assert out.choices[0].finish_reason == "stop"


def test_json_object_regex_choice_grammar(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with the keys name and colour of a cat."}],
        max_tokens=600,
        response_format={"type": "json_object"},
        temperature=0,  # an unbounded object: at temperature 1 it may outgrow max_tokens
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    cases = [
        ({"guided_regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        ({"guided_regex": r"(?i)(yes|no)"}, lambda t: re.fullmatch(r"(?i)(yes|no)", t)),  # via the fallback
        ({"guided_choice": ["positive", "negative", "neutral"]}, lambda t: t in ("positive", "negative", "neutral")),
        (
            {"guided_grammar": 'root ::= "SELECT " col " FROM " tbl\ncol ::= "id" | "name"\ntbl ::= "users" | "items"'},
            lambda t: re.fullmatch(r"SELECT (id|name) FROM (users|items)", t),
        ),
    ]
    for extra, check in cases:
        for stream in (False, True):
            kwargs = dict(model=MODEL, prompt="Answer:", max_tokens=30, temperature=1.0, n=2, seed=4, extra_body=extra)
            if stream:
                texts = ["", ""]
                for chunk in client.completions.create(stream=True, **kwargs):
                    for choice in chunk.choices:
                        texts[choice.index] += choice.text
            else:
                texts = [c.text for c in client.completions.create(**kwargs).choices]
            assert all(check(t) for t in texts), (extra, texts)


def test_structured_outputs_equals_the_legacy_field(client):
    kwargs = dict(model=MODEL, prompt="The character:", max_tokens=200, temperature=0)
    legacy = client.completions.create(**kwargs, extra_body={"guided_json": CHARACTER_SCHEMA})
    current = client.completions.create(**kwargs, extra_body={"structured_outputs": {"json": CHARACTER_SCHEMA}})
    assert current.choices[0].text == legacy.choices[0].text
    jsonschema.validate(json.loads(current.choices[0].text), CHARACTER_SCHEMA)
