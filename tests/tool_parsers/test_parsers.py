"""Every tool and reasoning parser on canned outputs: the whole-text result is right, and the
deltas streamed one character or one token at a time reassemble to exactly that result."""

from __future__ import annotations

import json

import pytest

from kiln.plugins import get_plugin_manager, load_ref

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "detail": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip

PARIS = ("get_weather", {"city": "Paris", "days": 3})
NESTED = ("get_weather", {"city": "Zürich 東京", "detail": {"range": [1, 2.5], "tags": ["a", {"b": None}]}})
TIME = ("get_time", {})


def j(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def hermes(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {j(args)}}}\n</tool_call>'


def qwen3_coder(name, args):
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else j(v)}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def deepseek_v3(calls):
    body = "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{j(a)}\n```<｜tool▁call▁end｜>" for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def deepseek_v31(calls):
    body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{j(a)}<｜tool▁call▁end｜>" for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def as_list(calls, key="arguments"):
    return j([{"name": n, key: a} for n, a in calls])


# parser -> [(output, expected content, expected calls)]
CASES = {
    "hermes": [
        (hermes(*PARIS), "", [PARIS]),
        (hermes(*PARIS) + "\n" + hermes(*TIME), "\n", [PARIS, TIME]),
        ("Let me check.\n" + hermes(*NESTED), "Let me check.\n", [NESTED]),
        ("No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
        ('<tool_call>{"name": "get_time", "arguments": {</tool_call> done', '<tool_call>{"name": "get_time", "arguments": {</tool_call> done', []),
        ("Cut short <tool_call>\n{\"name\": \"get_ti", "Cut short <tool_call>\n{\"name\": \"get_ti", []),
    ],
    "llama3_json": [
        (j({"name": PARIS[0], "parameters": PARIS[1]}), "", [PARIS]),
        ("<|python_tag|>" + j({"name": "get_time", "parameters": {}}) + "; " + j({"name": NESTED[0], "parameters": NESTED[1]}), "", [TIME, NESTED]),
        ("The weather is fine.", "The weather is fine.", []),
        ('{"name": "get_time", "parameters": ', '{"name": "get_time", "parameters": ', []),
    ],
    "mistral": [
        ("[TOOL_CALLS]" + as_list([PARIS]), "", [PARIS]),
        ("Sure. [TOOL_CALLS]" + as_list([PARIS, NESTED]), "Sure. ", [PARIS, NESTED]),
        ("Plain answer [TOOL", "Plain answer [TOOL", []),
        ("[TOOL_CALLS][{\"name\": 1}]", "[TOOL_CALLS][{\"name\": 1}]", []),
        # tokenizers v11+: a marker per call, the name, maybe a call id, [ARGS] and the arguments
        ("[TOOL_CALLS]get_weather[ARGS]" + j(PARIS[1]), "", [PARIS]),
        ("Sure. [TOOL_CALLS]get_weather[ARGS]" + j(PARIS[1]) + "[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]"
         + j(NESTED[1]), "Sure. ", [PARIS, NESTED]),
        ("[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{\"city\": ", "[TOOL_CALLS]get_weather[ARGS]{\"city\": ",
         [TIME]),
        ("[TOOL_CALLS]get_weather{\"city\": \"Paris\"}", "[TOOL_CALLS]get_weather{\"city\": \"Paris\"}", []),
    ],
    "deepseek_v3": [
        (deepseek_v3([PARIS]), "", [PARIS]),
        ("Checking.\n\n" + deepseek_v3([NESTED, TIME]), "Checking.\n\n", [NESTED, TIME]),
        (deepseek_v31([PARIS]), deepseek_v31([PARIS]), []),  # the other format is not this one
        ("No call: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{",
         "No call: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{", []),
    ],
    "deepseek_v31": [
        (deepseek_v31([PARIS]), "", [PARIS]),
        ("Let me look.\n" + deepseek_v31([NESTED, TIME]), "Let me look.\n", [NESTED, TIME]),
        (deepseek_v3([TIME]), deepseek_v3([TIME]), []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3)]', "", [PARIS]),
        ("[get_time(), get_weather(city='Zürich 東京', detail={'range': [1, 2.5], 'tags': ['a', {'b': None}]})]", "", [TIME, NESTED]),
        ("[1, 2, 3] is a list.", "[1, 2, 3] is a list.", []),
        ("Just text", "Just text", []),
    ],
    "internlm": [
        ("Checking.<|action_start|><|plugin|>\n" + j({"name": PARIS[0], "parameters": PARIS[1]}) + "<|action_end|>", "Checking.", [PARIS]),
        ("<|action_start|><|plugin|>not json<|action_end|>", "<|action_start|><|plugin|>not json<|action_end|>", []),
    ],
    "granite": [
        ("<|tool_call|>" + as_list([PARIS, TIME]), "", [PARIS, TIME]),
        ("Answer without calls.", "Answer without calls.", []),
    ],
    "jamba": [
        ("<tool_calls>" + as_list([NESTED]) + "</tool_calls>", "", [NESTED]),
        ("Hi <tool_calls>[oops]</tool_calls>", "Hi <tool_calls>[oops]</tool_calls>", []),
    ],
    "qwen3_coder": [
        (qwen3_coder(*PARIS), "", [PARIS]),
        ("Let me look.\n" + qwen3_coder(*NESTED) + "\n" + qwen3_coder(*TIME), "Let me look.\n\n", [NESTED, TIME]),
        ("<tool_call>\n<function=get_time>\n", "<tool_call>\n<function=get_time>\n", []),
    ],
    "example_call": [  # the third-party plugin in examples/plugin_example
        ('Checking.\nCALL get_weather {"city": "Paris", "days": 3}\nDone.', "Checking.\nDone.", [PARIS]),
        ("CALL get_time {}\nCALL broken {", "CALL broken {", [TIME]),
    ],
}  # fmt: skip

REASONING = {
    "deepseek_r1": [
        ("<think>Add 2 and 2.</think>It is 4.", "Add 2 and 2.", "It is 4."),
        ("The template opened it.</think>\n\nFour.", "The template opened it.", "\n\nFour."),
        ("<think>Still thinking when cut", "Still thinking when cut", ""),
    ],
    "qwen3": [
        ("<think>\nplan\n</think>\n\nanswer", "\nplan\n", "\n\nanswer"),
        ("no thinking at all", "", "no thinking at all"),
        ("opened by the template</think>done", "opened by the template", "done"),
    ],
    "mistral": [
        ("[THINK]Compare 9.11 and 9.9.[/THINK]9.9 is larger.", "Compare 9.11 and 9.9.", "9.9 is larger."),
        ("Straight to the answer.", "", "Straight to the answer."),
        ("[THINK]cut short", "cut short", ""),
    ],
    "granite": [
        ("Here is my thought process: think hard. Here is my response: 42", "think hard. ", "42"),
        ("Just an answer.", "", "Just an answer."),
    ],
}


def load(kind: str, name: str):
    return load_ref(get_plugin_manager().registry.table(kind)[name])


@pytest.fixture(scope="module")
def token_pieces(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)

    def pieces(text: str) -> list[str]:
        ids = tok.encode(text, add_special_tokens=False)
        out, prev = [], ""
        for i in range(len(ids)):
            now = tok.decode(ids[: i + 1])
            if not now.endswith("\ufffd"):
                out.append(now[len(prev) :])
                prev = now
        assert prev == text
        return out

    return pieces


def streamed_tools(parser, chunks):
    content, calls, ids = "", [], set()
    for delta in [parser.extract_streaming(c, []) for c in chunks] + [parser.finish()]:
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls:
            assert call.index == len(calls) and call.name and call.id not in ids
            ids.add(call.id)
            calls.append((call.name, json.loads(call.arguments)))
    return content, calls


@pytest.mark.parametrize(("name", "case"), [(n, c) for n, cases in CASES.items() for c in cases])
def test_tool_parser(name, case, token_pieces):
    text, content, calls = case
    cls = load("tool_parsers", name)
    whole = cls(None, TOOLS).extract_tool_calls(text)
    got = [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
    assert (whole.content or "", got) == (content, calls)
    assert whole.tools_called == bool(calls)
    for chunks in (list(text), token_pieces(text), [text]):
        assert streamed_tools(cls(None, TOOLS), chunks) == (content, calls)


@pytest.mark.parametrize(("name", "case"), [(n, c) for n, cases in REASONING.items() for c in cases])
def test_reasoning_parser(name, case, token_pieces):
    text, reasoning, content = case
    cls = load("reasoning_parsers", name)
    assert cls().extract_reasoning(text) == (reasoning or None, content or None)
    for chunks in (list(text), token_pieces(text)):
        parser, got = cls(), ["", ""]
        for delta in [parser.extract_streaming(c, []) for c in chunks] + [parser.finish()]:
            if delta is not None:
                got[0] += delta.reasoning_content or ""
                got[1] += delta.content or ""
        assert got == [reasoning, content]


def test_mistral_call_ids_are_what_mistral_conversations_accept():
    cls = load("tool_parsers", "mistral")
    calls = cls(None, TOOLS).extract_tool_calls("[TOOL_CALLS]" + as_list([PARIS, TIME])).tool_calls
    assert len(calls) == 2 and calls[0].id != calls[1].id
    assert all(len(c.id) == 9 and c.id.isalnum() and c.id.isascii() for c in calls)
