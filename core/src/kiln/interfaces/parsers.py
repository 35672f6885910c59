"""Tool-call and reasoning parsers: the interfaces plugins implement, and their streaming.

A parser object lives for one request. Implementations describe their format
once, in ``parse(text, final)``: what of the text so far is plain content, which
tool calls (or which reasoning) it holds, holding back anything that might still
turn into markup. The base classes derive both APIs from it:

* whole text: ``extract_tool_calls(text)`` / ``extract_reasoning(text)``;
* streaming: ``extract_streaming(delta_text, delta_token_ids)`` returns a
  ``DeltaMessage`` with what became certain since the last call, or None, and
  ``finish()`` flushes the rest when the request ends.

Because every streamed piece is the difference between two successive parses,
the deltas always reassemble to exactly the whole-text result. A tool call is
emitted once it is complete and valid, so a client never sees a call that later
turns out to be malformed (malformed markup is returned as content).

A vLLM parser ports by moving its format knowledge into ``parse``: vLLM's
``extract_tool_calls(model_output, request)`` is ``parse(text, final=True)``,
and its hand-written ``extract_tool_calls_streaming`` is not needed.
"""

from __future__ import annotations

import random
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def short_call_id() -> str:
    """9 letters and digits: the only call ids Mistral's chat templates and mistral_common accept
    when a client sends the calls back."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        out: dict[str, Any] = {"index": self.index, "function": {"arguments": self.arguments}}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            out["function"]["name"] = self.name
        return out


@dataclass
class DeltaMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


@dataclass
class ToolParse:
    """What ``ToolParser.parse`` sees in the text so far."""

    content: str
    calls: list[tuple[str, str]]  # complete calls: (name, arguments JSON text)


class ToolParser(ABC):
    """Extracts tool calls from a model's output; one object per request.

    ``tools`` are the request's tool definitions (OpenAI shape), for parsers that
    need parameter types. Register a subclass with ``register_tool_parsers``:
    ``register("name", "pkg.module:Class")``.
    """

    @classmethod
    def markup(cls) -> tuple[str, ...]:
        """The format's markup strings (tags, markers). A tokenizer may hold them as special
        tokens (Mistral's ``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``), which
        ``skip_special_tokens`` (on by default) drops from the text: Kiln keeps those in the
        text this parser reads, and only those."""
        return ()

    def __init__(self, tokenizer=None, tools: list[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or []
        self._text = ""
        self._sent_content = 0
        self._sent_calls: list[ToolCall] = []

    @abstractmethod
    def parse(self, text: str, final: bool) -> ToolParse:
        """Content and complete calls in ``text``. With ``final=False`` the text may grow:
        leave out of ``content`` anything that could still become markup. With
        ``final=True`` unparseable markup is content. The content of a non-final parse
        must be a prefix of the content of any later parse."""

    @classmethod
    def new_call_id(cls) -> str:
        """The id of a call found (``tool_calls[].id``): override where the model's chat format
        constrains the ids that clients send back (Mistral's: ``short_call_id``). Calls that
        ``tool_choice`` forces take their ids from the server's ``--tool-call-parser`` too."""
        return new_call_id()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The whole output at once."""
        parsed = self.parse(text, final=True)
        calls = [ToolCall(name, args, self.new_call_id()) for name, args in parsed.calls]
        return ExtractedToolCalls(parsed.content or None, calls)

    def extract_streaming(self, delta_text: str, delta_token_ids: list[int] | None = None) -> DeltaMessage | None:
        """Feed newly generated text; return what became certain, or None."""
        self._text += delta_text
        return self._diff(self.parse(self._text, final=False))

    def finish(self) -> DeltaMessage | None:
        """The request ended: flush what was held back."""
        return self._diff(self.parse(self._text, final=True))

    def _diff(self, parsed: ToolParse) -> DeltaMessage | None:
        delta = DeltaMessage()
        if len(parsed.content) > self._sent_content:
            delta.content = parsed.content[self._sent_content :]
            self._sent_content = len(parsed.content)
        for name, args in parsed.calls[len(self._sent_calls) :]:
            call = ToolCall(name, args, self.new_call_id())
            delta.tool_calls.append(ToolCallDelta(len(self._sent_calls), call.id, name, args))
            self._sent_calls.append(call)
        return delta or None


class ReasoningParser(ABC):
    """Splits a model's output into reasoning and answer; one object per request.

    Register a subclass with ``register_reasoning_parsers``.
    """

    @classmethod
    def markup(cls) -> tuple[str, ...]:
        """The format's tags, as ``ToolParser.markup``: those a tokenizer holds as special tokens
        stay in the text this parser reads."""
        return ()

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self._text = ""
        self._sent = (0, 0)

    @abstractmethod
    def parse(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) in ``text``; with ``final=False`` hold back partial tags.
        Successive non-final parses must only extend both parts."""

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self.parse(text, final=True)
        return reasoning or None, content or None

    def extract_streaming(self, delta_text: str, delta_token_ids: list[int] | None = None) -> DeltaMessage | None:
        self._text += delta_text
        return self._diff(*self.parse(self._text, final=False))

    def finish(self) -> DeltaMessage | None:
        return self._diff(*self.parse(self._text, final=True))

    def _diff(self, reasoning: str, content: str) -> DeltaMessage | None:
        sent_reasoning, sent_content = self._sent
        delta = DeltaMessage(
            reasoning_content=reasoning[sent_reasoning:] or None, content=content[sent_content:] or None
        )
        self._sent = (max(sent_reasoning, len(reasoning)), max(sent_content, len(content)))
        return delta or None


def partial_marker_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
