"""A third-party Kiln plugin: one tool parser and one chat template."""

from __future__ import annotations

import json

import kiln
from kiln.interfaces.parsers import ToolParse, ToolParser

PREFIX = "CALL "

TEMPLATE = """{%- for message in messages -%}
<|im_start|>{{ message.role }}
{% if message.role == "system" and tools %}{{ message.content }}
Call a tool by writing a line: CALL <name> <arguments as JSON>. Tools: {{ tools | map(attribute="function.name") | join(", ") }}
{% else %}{{ message.content or "" }}{% for call in message.tool_calls or [] %}
CALL {{ call.function.name }} {{ call.function.arguments | tojson }}{% endfor %}
{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""


class ExampleCallParser(ToolParser):
    """Lines ``CALL name {json}`` are calls; every other line is content."""

    def parse(self, text: str, final: bool) -> ToolParse:
        content, calls = [], []
        for line in text.splitlines(keepends=True):
            complete = final or line.endswith("\n")
            body = line.rstrip("\n")
            if not complete and (body.startswith(PREFIX) or PREFIX.startswith(body)):
                break  # this line may still become a call
            name, _, args = body.removeprefix(PREFIX).partition(" ")
            if body.startswith(PREFIX) and name:
                try:
                    calls.append((name, json.dumps(json.loads(args or "{}"))))
                    continue
                except json.JSONDecodeError:
                    pass  # not a call after all: content
            content.append(line)
        return ToolParse("".join(content), calls)


@kiln.hookimpl
def register_tool_parsers(register) -> None:
    register("example_call", "kiln_plugin_example:ExampleCallParser")


@kiln.hookimpl
def register_chat_templates(register) -> None:
    register("example_calls", TEMPLATE)
