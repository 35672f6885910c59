"""Tools in chat: ``tool_choice`` (none / auto / required / a named function), the parsers that turn
output into tool calls and reasoning, and their composition per choice (whole and streamed).

``auto`` uses the server's ``--tool-call-parser``. ``required`` and a named function are
enforced with guided decoding: the model must write a JSON list of ``{"name", "parameters"}``
(required) or the named function's arguments, which always parse.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from kiln.interfaces.guided import GuidedDecodingParams
from kiln.interfaces.parsers import (
    DeltaMessage,
    ReasoningParser,
    ToolCall,
    ToolParse,
    ToolParser,
    short_call_id,
)
from kiln.interfaces.tokenizer import is_mistral


class ForcedToolParser(ToolParser):
    """Calls ``tool_choice`` forces through guided decoding; their ids as ``call_ids`` makes them
    (the server's tool parser's, or Mistral's short ones for a mistral_common tokenizer)."""

    def __init__(self, call_ids: Callable[[], str] | None = None) -> None:
        super().__init__()
        if call_ids is not None:
            self.new_call_id = call_ids


class RequiredToolParser(ForcedToolParser):
    """Output constrained to ``[{"name": ..., "parameters": {...}}, ...]``; parsed when complete."""

    def parse(self, text: str, final: bool) -> ToolParse:
        if not final:
            return ToolParse("", [])
        try:
            items = json.loads(text)
            return ToolParse("", [(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items])
        except (json.JSONDecodeError, KeyError, TypeError):
            return ToolParse(text, [])  # cut short (max_tokens): what there is, as content


class NamedToolParser(ForcedToolParser):
    """Output constrained to the named function's arguments."""

    def __init__(self, name: str, call_ids: Callable[[], str] | None = None) -> None:
        super().__init__(call_ids)
        self.name = name

    def parse(self, text: str, final: bool) -> ToolParse:
        if not final:
            return ToolParse("", [])
        try:
            return ToolParse("", [(self.name, json.dumps(json.loads(text), ensure_ascii=False))])
        except json.JSONDecodeError:
            return ToolParse(text, [])


@dataclass
class ToolSetup:
    """How a chat request's output is read: parser factories and the constraint, if any."""

    make_tool_parser: Callable[[], ToolParser] | None = None
    make_reasoning_parser: Callable[[], ReasoningParser] | None = None
    guided: GuidedDecodingParams | None = None
    parallel: bool = True
    markup: tuple[str, ...] = ()  # the parsers' markup (their ``markup()``), kept in the text if special


def _functions(tools: list[dict]) -> dict[str, dict]:
    out = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or "name" not in function:
            raise APIError("tools: each tool must be {'type': 'function', 'function': {'name', ...}}", param="tools")
        out[function["name"]] = function
    return out


def tool_setup(
    req: ChatCompletionRequest,
    tokenizer,
    tool_parser: type[ToolParser] | None,
    auto_enabled: bool,
    reasoning_parser: type[ReasoningParser] | None,
) -> ToolSetup:
    setup = ToolSetup(parallel=req.parallel_tool_calls is not False)
    if reasoning_parser is not None:
        setup.make_reasoning_parser = lambda: reasoning_parser(tokenizer)
        setup.markup = reasoning_parser.markup()
    tools = req.tools or []
    functions = _functions(tools) if tools else {}
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools and auto_enabled else "none")
    if choice == "none":
        return setup
    if not tools:
        raise APIError("tool_choice: needs tools", param="tool_choice")
    call_ids = tool_parser.new_call_id if tool_parser is not None else short_call_id if is_mistral(tokenizer) else None
    if choice == "auto":
        if not (auto_enabled and tool_parser is not None):
            raise APIError(
                '"auto" tool choice needs --enable-auto-tool-choice and --tool-call-parser', param="tool_choice"
            )
        setup.make_tool_parser = lambda: tool_parser(tokenizer, tools)
        setup.markup += tool_parser.markup()
        return setup
    if choice == "required":
        call_schemas = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": f.get("parameters") or {"type": "object"}},
                "required": ["name", "parameters"],
            }
            for name, f in functions.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call_schemas}}
        if not setup.parallel:
            schema["maxItems"] = 1
        setup.guided = GuidedDecodingParams(json=schema)
        setup.make_tool_parser = lambda: RequiredToolParser(call_ids)
        return setup
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise APIError(f"tool_choice: function {name!r} is not among the tools", param="tool_choice")
        setup.guided = GuidedDecodingParams(json=functions[name].get("parameters") or {"type": "object"})
        setup.make_tool_parser = lambda: NamedToolParser(name, call_ids)
        return setup
    raise APIError(f"tool_choice: {choice!r} is not none, auto, required or a named function", param="tool_choice")


def messages_for_template(messages: list[dict]) -> list[dict]:
    """Assistant tool-call arguments arrive as JSON text; templates expect objects (as vLLM does)."""
    for message in messages:
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # left as text: the template shows what the client sent
    return messages


class ChoiceOutput:
    """One choice's text through the reasoning parser, then the tool parser; whole or streamed."""

    def __init__(self, setup: ToolSetup) -> None:
        self.reasoning = setup.make_reasoning_parser() if setup.make_reasoning_parser else None
        self.tools = setup.make_tool_parser() if setup.make_tool_parser else None
        self.parallel = setup.parallel
        self.num_calls = 0

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of the finished text."""
        reasoning, content = self.reasoning.extract_reasoning(text) if self.reasoning else (None, text)
        if self.tools is None or content is None:
            return reasoning, content, []
        extracted = self.tools.extract_tool_calls(content)
        calls = extracted.tool_calls if self.parallel else extracted.tool_calls[:1]
        return reasoning, extracted.content, calls

    def delta(self, text: str, final: bool) -> DeltaMessage | None:
        """New text in; what became certain out (``final``: the choice ended, flush)."""
        out = DeltaMessage()
        if self.reasoning is None:
            out.content = text
        else:
            for part in filter(None, (self.reasoning.extract_streaming(text) if text else None,
                                      self.reasoning.finish() if final else None)):  # fmt: skip
                out.reasoning_content = (out.reasoning_content or "") + (part.reasoning_content or "") or None
                out.content = (out.content or "") + (part.content or "") or None
        if self.tools is not None:
            pieces = [self.tools.extract_streaming(out.content or "")] + ([self.tools.finish()] if final else [])
            out.content = "".join(p.content or "" for p in pieces if p) or None
            for piece in filter(None, pieces):
                for call in piece.tool_calls:
                    if self.parallel or call.index == 0:
                        out.tool_calls.append(call)
            self.num_calls += len(out.tool_calls)
        return out if out else None
