"""Chat templates render in Kiln's bounded sandbox: the same text as transformers' ``apply_chat_template``
for the templates Kiln ships and tests, a 400 (never a 500 or a hang) for a template that fails or
runs away, and per-request templates only with ``--trust-request-chat-template``."""

from __future__ import annotations

import copy
import time

import pytest
from fastapi.testclient import TestClient
from tests.core.test_server_app import serve_args
from transformers import AutoTokenizer

from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.chat_rendering import render_chat_template
from kiln.entrypoints.chat_template_sandbox import DEFAULT_LIMITS, ChatTemplateError, RenderLimits, render_template
from kiln.entrypoints.openai.api_server import build_app
from kiln.entrypoints.openai.serving import ServerOptions
from kiln_tool_parsers.plugin import chatml_tools_template

# Exercises what transformers gives a template: special tokens, tools and documents, tojson's
# options, namespace, dict, loop controls, {% generation %}, strftime_now, raise_exception,
# reasoning aliases, content parts and extra variables.
FEATURES = """{{ bos_token }}{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}
{%- if tools %}Tools:{% for t in tools %}
{{ t | tojson(indent=2) }}{% endfor %}
{{ tools | tojson }}{% endif %}
{%- if documents %}{% for d in documents %}[{{ loop.index }}] {{ d.title }}: {{ d.text }}
{% endfor %}{% endif %}
Year {{ strftime_now('%Y') }}
{% for m in messages %}
{%- if m.role not in ('system', 'user', 'assistant', 'tool') %}{{ raise_exception('bad role ' ~ m.role) }}{% endif %}
{%- if loop.index0 > 40 %}{% break %}{% endif %}
<{{ m.role }}>{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{%- if m.thinking is defined %}(thinking){% endif %}
{%- if m.content is string %}{{ m.content | trim }}{% elif m.content %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}
{%- for c in m.tool_calls or [] %}{{ {'name': c.function.name, 'args': c.function.arguments} | tojson(sort_keys=true) }}{% endfor %}
{%- if loop.index0 == ns.last_user %} (last user, {{ '%d/%d' | format(loop.index, messages | length) }}){% endif %}
{% generation %}{{ eos_token }}{% endgeneration %}
{% endfor %}
{%- if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}
{{ dict(a=1, b=[1, 2]) | tojson }} {{ messages | map(attribute='role') | unique | join(',') }} {{ range(4) | sum }}
{{- ' {}:{}'.format('x', 2) }} {{ messages[::-1][0].role }} {{ 'é<b>' | tojson }}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now>, é",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hey  ", "reasoning_content": "greet back"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning": "the tool said so", "name": None},
    ],
]
TEMPLATES = {"model": None, "chatml_tools": chatml_tools_template(), "features": FEATURES}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))  # the default model's tokenizer and template


def both(tokenizer, messages, template, **kwargs) -> tuple[str, str]:
    """transformers' rendering and Kiln's, or the exception class of each."""
    variables = kwargs.pop("variables", {})
    try:
        want = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs, **variables)
    except Exception as exc:
        want = type(exc).__name__
    try:
        got = render_chat_template(tokenizer, messages, template, variables=variables, **kwargs)
    except ChatTemplateError:
        got = "ChatTemplateError"
    return want, got


@pytest.mark.parametrize("name", TEMPLATES)
def test_renders_as_transformers_does(tokenizer, name):
    rendered = 0
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            for add_generation_prompt, continue_final_message in ((True, False), (False, False), (False, True)):
                if continue_final_message and messages[-1]["role"] != "assistant":
                    continue
                want, got = both(
                    tokenizer,
                    copy.deepcopy(messages),
                    TEMPLATES[name],
                    tools=tools,
                    documents=[{"title": "Doc", "text": "Body"}] if name == "features" else None,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    variables={"enable_thinking": False} if tools else {},
                )
                if want == got:
                    rendered += 1
                else:  # only where transformers fails too (the model's template needs string content)
                    assert got == "ChatTemplateError" and want in ("TypeError", "UndefinedError"), (want, got)
    assert rendered >= 10


def test_variables_override_special_tokens_and_named_templates_are_chosen(tokenizer):
    messages = CONVERSATIONS[0]
    want, got = both(tokenizer, messages, FEATURES, variables={"bos_token": "<BOS>"})
    assert want == got and got.startswith("<BOS>")
    named = copy.copy(tokenizer)
    named.chat_template = {"default": "plain {{ messages[0].content }}", "tool_use": "tools {{ tools | length }}"}
    for tools in (None, TOOLS):
        want, got = both(named, messages, None, tools=tools)
        assert want == got and got.startswith("tools 1" if tools else "plain Hello")
    assert both(named, messages, "tool_use", tools=TOOLS)[1] == "tools 1"


def test_the_models_own_template_renders_in_the_sandbox(tokenizer):
    # The template a GGUF file's metadata (or a tokenizer config) carries goes through the same bounds.
    hostile = copy.copy(tokenizer)
    hostile.chat_template = "{% for i in range(10**9) %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="range"):
        render_chat_template(hostile, CONVERSATIONS[0])


def test_the_deadline_stops_a_template_between_hooks():
    template = "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s.count('y') }}{% endfor %}"
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="longer than 0.2 s"):
        render_template(template, {}, RenderLimits(seconds=0.2))
    assert time.monotonic() - started < 2


# --------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig.create(
            model=tiny_model_dir("llama"), max_model_len=256, block_size=16, dtype="float32", max_num_seqs=4
        )
    )
    options = ServerOptions(served_model_names=["tiny"], disable_log_requests=True)
    app = build_app(AsyncEngine(engine, log_stats_interval=None), options, serve_args([]))
    with TestClient(app) as client:
        yield client, options


@pytest.fixture
def untrusted(server):
    client, options = server
    options.trust_request_chat_template = False
    return client


@pytest.fixture
def trusted(server):
    client, options = server
    options.trust_request_chat_template = True
    yield client
    options.trust_request_chat_template = False


HELLO = [{"role": "user", "content": "Hello"}]


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, "temperature": 0, **body})


def assert_error(response, param: str, fragment: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400 and fragment in error["message"], error


@pytest.mark.parametrize(
    "body, param",
    [
        ({"chat_template": "{{ messages[0].content }}"}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs"),
    ],
)
def test_request_templates_need_the_flag(untrusted, body, param):
    assert_error(chat(untrusted, **body), param, "--trust-request-chat-template")
    assert_error(untrusted.post("/tokenize", json={"messages": HELLO, **body}), param, "--trust-request-chat-template")


def test_plain_template_variables_need_no_flag(untrusted, tokenizer):
    r = untrusted.post("/tokenize", json={"messages": HELLO, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200
    assert r.json()["tokens"] == tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, return_dict=False)
    assert chat(untrusted, chat_template_kwargs={"enable_thinking": False}).status_code == 200
    assert_error(chat(untrusted, chat_template_kwargs={"messages": []}), "chat_template_kwargs", "messages")


def test_trusted_request_templates_render(trusted, tokenizer):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}{{ suffix }}"
    expected = tokenizer.encode("[user] Hello!", add_special_tokens=False)
    for body in (
        {"chat_template": template, "chat_template_kwargs": {"suffix": "!"}},
        {"chat_template_kwargs": {"chat_template": template, "suffix": "!"}},
    ):
        r = trusted.post("/tokenize", json={"messages": HELLO, **body})
        assert r.status_code == 200 and r.json()["tokens"] == expected, r.text
        assert chat(trusted, **body).status_code == 200


NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
OUTPUT_FLOOD = "{% for i in range(100000) %}{% for j in range(1000) %}" + "A" * 64 + "{% endfor %}{% endfor %}"
HOSTILE = [
    ("{% for i in range(10**9) %}{% endfor %}", "chat_template", "range() has more than 100000 items"),
    (NESTED_LOOPS, "chat_template", "rendering stopped"),
    ("{{ 'a' * 10**10 }}", "chat_template", "would build a value"),
    ("{% set x = 'ab' %}" + "{% set x = x ~ x %}" * 40 + "{{ x }}", "chat_template", "'~' operator"),
    (
        "{% set ns = namespace(x='ab') %}{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x }}",
        "chat_template",
        "rendering stopped",
    ),
    (
        "{% set ns = namespace(x=[1]) %}{% for i in range(64) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x }}",
        "chat_template",
        "rendering stopped",
    ),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "chat_template", "nested deeper than 64"),
    (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
        "chat_template",
        "rendering stopped",
    ),
    ("{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}", "chat_template", "nested deeper"),
    ("{{ 2 ** 100000000 }}", "chat_template", "integer of about"),
    ("{{ '{:>10000000000}'.format('a') }}", "chat_template", "format() would build"),
    ("{{ '%10000000000s' % 'a' }}", "chat_template", "would build"),
    ("{{ 'a'.ljust(10**10) }}{{ (1).to_bytes(10**10, 'big') }}", "chat_template", "ljust() would build"),
    ("{{ 'a' | center(10**10) }}", "chat_template", "center filter"),
    ("{% set s = 'x' * 1000000 %}{{ s.join(range(100000) | map('string')) }}", "chat_template", "join()"),
    ("{% set s = 'x' * 1000000 %}{{ s.replace('', s) }}", "chat_template", "replace()"),
    (r"{% set s = '\n' * 1000000 %}{{ s | indent(1000) }}", "chat_template", "indent filter"),
    ("{{ range(100000) | list | tojson(indent=100000) }}", "chat_template", "tojson"),
    (OUTPUT_FLOOD, "chat_template", "output is longer than"),
    ("{% set b %}" + OUTPUT_FLOOD + "{% endset %}{{ b | length }}", "chat_template", "rendering stopped"),
    ("{% set ns = namespace(a=1) %}{{ [ns] * 1000 }}", "chat_template", "namespace cannot be stored"),
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "chat_template", "recursion too deep"),
    ("{% for %}", "chat_template", "not a valid template (line 1)"),
    ("{{ 1 }}" * 20000, "chat_template", "the template is longer than 131072 characters"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat_template", "unsafe"),
    ("{{ raise_exception('roles must alternate') }}", "messages", "roles must alternate"),
    ("{{ messages[0].nope.deeper }}", "messages", "has no attribute 'nope'"),
    ("{{ 2.0 ** 100000 }}", "messages", "Numerical result out of range"),
    ("{{ 1 // 0 }}", "messages", "division"),
]


@pytest.mark.parametrize("template, param, fragment", HOSTILE, ids=[f"hostile{i}" for i in range(len(HOSTILE))])
def test_hostile_templates_are_a_bounded_400(trusted, tokenizer, template, param, fragment):
    started = time.monotonic()
    assert_error(chat(trusted, chat_template=template), param, fragment)
    assert time.monotonic() - started < DEFAULT_LIMITS.seconds + 3
    r = trusted.post("/tokenize", json={"messages": HELLO})  # and the server still answers, the same way
    assert r.status_code == 200
    assert r.json()["tokens"] == tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, return_dict=False)


def test_a_slow_template_is_stopped_by_the_deadline(trusted):
    template = "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s.count('y') }}{% endfor %}"
    started = time.monotonic()
    r = trusted.post("/tokenize", json={"messages": HELLO, "chat_template": template})
    assert_error(r, "chat_template", f"longer than {DEFAULT_LIMITS.seconds:g} s")
    assert DEFAULT_LIMITS.seconds <= time.monotonic() - started < DEFAULT_LIMITS.seconds + 3
