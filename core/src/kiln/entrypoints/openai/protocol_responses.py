"""Request bodies of OpenAI's Responses API (``POST /v1/responses``), as far as a local model honours it.

Input items are the ones a text model can replay through its chat template:
messages (text parts), ``function_call`` / ``function_call_output`` round trips
and ``reasoning``. Every field an output item carries is accepted back as input,
so ``input=previous.output + [...]`` works with the official client. Built-in
tools, background mode, ``include`` and other hosted features are refused by
name (``extra="forbid"`` does the rest), never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator

from kiln.entrypoints.openai.protocol import StrictModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    """Assistant text as the server returned it (annotations and logprobs do not reach the model)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


ContentPart = Annotated[InputText | OutputText, Field(discriminator="type")]


def _text_or(tag: str):
    """A ``str | list[...]`` union tagged by Python type, so an error names one branch, not both."""
    return Discriminator(lambda value: "text" if isinstance(value, str) else tag)


class MessageItem(StrictModel):
    """A message; ``type`` may be left out (OpenAI's "easy" input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("parts")], _text_or("parts")]
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[Annotated[str, Tag("text")] | Annotated[list[InputText], Tag("parts")], _text_or("parts")]
    id: str | None = None
    status: ItemStatus | None = None


class SummaryText(StrictModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: ItemStatus | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _clear_only(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("encrypted reasoning is not supported (Kiln returns reasoning in clear)")
        return value


def _item_type(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(StrictModel):
    """A function tool in the Responses' flat shape (no nested ``function`` object)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")] = (
        Field(default_factory=lambda: TextFormatText(type="text"))
    )


class ReasoningConfig(StrictModel):
    """``effort`` goes to the chat template as ``reasoning_effort`` (templates that read it use it).
    The reasoning item carries the whole reasoning as ``content``; ``summary`` stays empty, as in vLLM."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: Annotated[
        Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items"), Field(min_length=1)], _text_or("items")
    ]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    # NOTE: OpenAI's default (true) and vLLM's field default; unlike vLLM, which drops it unless
    # VLLM_ENABLE_RESPONSES_API_STORE is set, Kiln stores in a bounded LRU (nothing grows unbounded).
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # accepted only at the value meaning "not used": the features behind them are hosted ones
    background: bool = False
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    # vLLM's extras
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    priority: int = 0
    request_id: str | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{i}]: tool type {kind!r} is not supported (function tools only)")
        return tools

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool) -> bool:
        if value:
            raise ValueError("background responses are not supported")
        return value

    @field_validator("include")
    @classmethod
    def _no_include(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError(f"{', '.join(map(repr, value))}: not supported (nothing extra can be included)")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_auto_truncation(cls, value: str) -> str:
        if value == "auto":
            raise ValueError("'auto' is not supported; an input over the context length is a 400")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512.
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("at most 16 pairs, keys up to 64 characters and values up to 512")
        return value
