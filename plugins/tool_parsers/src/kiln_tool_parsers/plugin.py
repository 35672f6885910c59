"""Registers the tool-call parsers, reasoning parsers and chat templates of this distribution."""

from __future__ import annotations

from importlib.resources import files

import kiln

_TOOL_PARSERS = {
    "hermes": "HermesToolParser",
    "llama3_json": "Llama3JsonToolParser",
    "mistral": "MistralToolParser",
    "pythonic": "PythonicToolParser",
    "internlm": "InternLMToolParser",
    "granite": "GraniteToolParser",
    "jamba": "JambaToolParser",
    "qwen3_coder": "Qwen3CoderToolParser",
    "deepseek_v3": "DeepSeekV3ToolParser",
    "deepseek_v31": "DeepSeekV31ToolParser",
}
_REASONING_PARSERS = {
    "deepseek_r1": "DeepSeekR1ReasoningParser",
    "qwen3": "Qwen3ReasoningParser",
    "mistral": "MistralReasoningParser",
    "granite": "GraniteReasoningParser",
}


def chatml_tools_template() -> str:
    return files("kiln_tool_parsers").joinpath("templates/chatml_tools.jinja").read_text(encoding="utf-8")


@kiln.hookimpl
def register_tool_parsers(register) -> None:
    for name, cls in _TOOL_PARSERS.items():
        register(name, f"kiln_tool_parsers.tool_parsers:{cls}")


@kiln.hookimpl
def register_reasoning_parsers(register) -> None:
    for name, cls in _REASONING_PARSERS.items():
        register(name, f"kiln_tool_parsers.reasoning_parsers:{cls}")


@kiln.hookimpl
def register_chat_templates(register) -> None:
    register("chatml_tools", chatml_tools_template)
    register("hermes", chatml_tools_template)
