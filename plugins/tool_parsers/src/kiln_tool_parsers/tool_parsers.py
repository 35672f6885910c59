"""Tool-call formats of popular model families, each described once in ``parse``.

Tagged formats (hermes, internlm, jamba, qwen3_coder) wrap each call in a start
and end tag; marker formats (mistral, granite) put a JSON list of calls after a
marker; llama3_json and pythonic make the whole output the calls.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from kiln.interfaces.parsers import ToolParse, ToolParser, partial_marker_suffix, short_call_id

_DECODER = json.JSONDecoder()


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def call_from_json(obj: Any) -> tuple[str, str] | None:
    """``{"name": ..., "arguments" | "parameters": {...} or its JSON text}`` as (name, arguments JSON)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (obj["name"], _dump(args)) if isinstance(args, dict) else None


def calls_from_json_text(body: str) -> list[tuple[str, str]] | None:
    """One call object or a list of them; None if any part does not parse."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_from_json(item) for item in items]
    return None if not calls or None in calls else calls


def _leading_json(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of ``text`` (after whitespace) and where it ends."""
    stripped = len(text) - len(text.lstrip())
    try:
        value, end = _DECODER.raw_decode(text, stripped)
    except json.JSONDecodeError:
        return None
    return value, end


class TaggedToolParser(ToolParser):
    """Calls wrapped in ``start`` ... ``end``; text outside the tags is content."""

    start = "<tool_call>"
    end = "</tool_call>"

    @classmethod
    def markup(cls) -> tuple[str, ...]:
        return cls.start, cls.end

    def parse_body(self, body: str) -> list[tuple[str, str]] | None:
        return calls_from_json_text(body)

    def parse(self, text: str, final: bool) -> ToolParse:
        content, calls, pos = [], [], 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - partial_marker_suffix(tail, self.start)])
                break
            content.append(text[pos:i])
            j = text.find(self.end, i + len(self.start))
            if j < 0:
                if final:  # never closed: not a call
                    content.append(text[i:])
                break
            parsed = self.parse_body(text[i + len(self.start) : j])
            if parsed is None:
                content.append(text[i : j + len(self.end)])  # malformed markup stays visible
            else:
                calls.extend(parsed)
            pos = j + len(self.end)
        return ToolParse("".join(content), calls)


class HermesToolParser(TaggedToolParser):
    """Hermes / Qwen2.5: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""


class InternLMToolParser(TaggedToolParser):
    """InternLM2: ``<|action_start|><|plugin|>{"name": ..., "parameters": {...}}<|action_end|>``."""

    start = "<|action_start|><|plugin|>"
    end = "<|action_end|>"


class DeepSeekV3ToolParser(TaggedToolParser):
    """DeepSeek-V3 / R1-0528: inside ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>``, each call as
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then its arguments in a fenced JSON block
    and ``<｜tool▁call▁end｜>``."""

    start, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_start, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    @classmethod
    def markup(cls) -> tuple[str, ...]:
        return cls.start, cls.end, cls.call_start, cls.call_end, cls.sep

    def parse_call(self, call: str) -> tuple[str, str] | None:
        kind, sep, rest = call.partition(self.sep)
        name, newline, block = rest.partition("\n")
        block = block.strip()
        if kind.strip() != "function" or not sep or not name.strip() or not newline or not block.startswith("```"):
            return None
        args = block.removeprefix("```").removeprefix("json").removesuffix("```")
        return call_from_json({"name": name.strip(), "arguments": args.strip()})

    def parse_body(self, body: str) -> list[tuple[str, str]] | None:
        calls, rest = [], body.strip()
        while rest:
            if not rest.startswith(self.call_start) or self.call_end not in rest:
                return None
            call, _, rest = rest[len(self.call_start) :].partition(self.call_end)
            calls.append(self.parse_call(call))
            rest = rest.strip()
        return calls if calls and None not in calls else None


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """DeepSeek-V3.1: as V3, each call ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``."""

    def parse_call(self, call: str) -> tuple[str, str] | None:
        name, sep, args = call.partition(self.sep)
        return call_from_json({"name": name.strip(), "arguments": args.strip()}) if sep and name.strip() else None


class JambaToolParser(TaggedToolParser):
    """Jamba: ``<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>``."""

    start = "<tool_calls>"
    end = "</tool_calls>"


class Qwen3CoderToolParser(TaggedToolParser):
    """Qwen3-Coder: ``<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>``.

    Values are text; they become JSON values by the parameter's type in the request's tools.
    """

    _FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.S)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def parse_body(self, body: str) -> list[tuple[str, str]] | None:
        match = self._FUNCTION.match(body)
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        types = self._parameter_types(name)
        args = {
            key.strip(): self._convert(value, types.get(key.strip())) for key, value in self._PARAMETER.findall(inner)
        }
        return [(name, _dump(args))]

    def _parameter_types(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            function = tool.get("function", tool)
            if function.get("name") == name:
                props = (function.get("parameters") or {}).get("properties") or {}
                return {k: (v or {}).get("type") for k, v in props.items()}
        return {}

    @staticmethod
    def _convert(value: str, kind: Any) -> Any:
        if kind in ("integer", "number", "boolean", "object", "array", "null"):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                return value
        return value


class MarkerToolParser(ToolParser):
    """Content, then ``marker`` and a JSON list of calls (anything after the list is content)."""

    marker = "[TOOL_CALLS]"

    @classmethod
    def markup(cls) -> tuple[str, ...]:
        return (cls.marker,)

    def parse(self, text: str, final: bool) -> ToolParse:
        i = text.find(self.marker)
        if i < 0:
            held = 0 if final else partial_marker_suffix(text, self.marker)
            return ToolParse(text[: len(text) - held], [])
        found = _leading_json(text[i + len(self.marker) :])
        calls = None
        if found is not None and isinstance(found[0], list):
            calls = [call_from_json(item) for item in found[0]]
            calls = None if not calls or None in calls else calls
        if calls is None:
            return ToolParse(text if final else text[:i], [])
        rest = text[i + len(self.marker) + found[1] :]
        return ToolParse(text[:i] + rest, calls)


class MistralToolParser(MarkerToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (tokenizers v2-v7), or from v11
    (Mistral Small 3.2, Magistral, Devstral) each call as ``[TOOL_CALLS]name[ARGS]{...}``, with
    ``[CALL_ID]id`` before ``[ARGS]`` in some. Calls of the later form come out one by one, each
    once its arguments are whole; a malformed one ends them, and it and the rest are content."""

    _HEAD = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_-]*\s*)?\[ARGS\]")

    @classmethod
    def markup(cls) -> tuple[str, ...]:
        return cls.marker, "[ARGS]", "[CALL_ID]"

    @classmethod
    def new_call_id(cls) -> str:
        return short_call_id()

    def parse(self, text: str, final: bool) -> ToolParse:
        i = text.find(self.marker)
        after = text[i + len(self.marker) :].lstrip() if i >= 0 else ""
        if i < 0 or not after or after.startswith("["):  # none yet, or the JSON list of v2-v7
            return super().parse(text, final)
        calls, at = [], i
        while text.startswith(self.marker, at):
            head = self._HEAD.match(text, at + len(self.marker))
            found = None if head is None else _leading_json(text[head.end() :])
            if found is None or not isinstance(found[0], dict):
                break
            calls.append((head.group(1), _dump(found[0])))
            at = head.end() + found[1]
            at += len(text[at:]) - len(text[at:].lstrip())
        # Before the end, what follows the calls may still become one.
        return ToolParse(text[:i] + text[at:] if final else text[:i], calls)


class GraniteToolParser(MarkerToolParser):
    """Granite 3: ``<|tool_call|>[{"name": ..., "arguments": {...}}]``."""

    marker = "<|tool_call|>"


class WholeOutputToolParser(ToolParser):
    """The whole output is the calls, or it is all content; decided when the output ends
    (until then a possible call is held back)."""

    def could_be_calls(self, stripped: str) -> bool:
        raise NotImplementedError

    def parse_calls(self, stripped: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> ToolParse:
        stripped = text.strip()
        if not final:
            return ToolParse("" if not stripped or self.could_be_calls(stripped) else text, [])
        calls = self.parse_calls(stripped) if stripped and self.could_be_calls(stripped) else None
        return ToolParse("", calls) if calls else ToolParse(text, [])


class Llama3JsonToolParser(WholeOutputToolParser):
    """Llama 3.x JSON calls: ``<|python_tag|>{"name": ..., "parameters": {...}}; {...}``."""

    tag = "<|python_tag|>"

    @classmethod
    def markup(cls) -> tuple[str, ...]:
        return (cls.tag,)

    def could_be_calls(self, stripped: str) -> bool:
        return stripped.startswith(("{", self.tag)) or self.tag.startswith(stripped)

    def parse_calls(self, stripped: str) -> list[tuple[str, str]] | None:
        body, calls = stripped.removeprefix(self.tag).strip(), []
        while body:
            found = _leading_json(body)
            call = call_from_json(found[0]) if found else None
            if call is None:
                return None
            calls.append(call)
            body = body[found[1] :].strip().removeprefix(";").strip()
        return calls


class PythonicToolParser(WholeOutputToolParser):
    """Python call syntax: ``[get_weather(city="Paris"), get_time()]``; arguments are literals."""

    def could_be_calls(self, stripped: str) -> bool:
        return stripped.startswith("[")

    def parse_calls(self, stripped: str) -> list[tuple[str, str]] | None:
        try:
            tree = ast.parse(stripped, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except ValueError:
                return None
            calls.append((node.func.id, _dump(args)))
        return calls
