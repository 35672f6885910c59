"""Request bodies of the OpenAI-compatible API (vLLM's dialect) and its error shape.

Unknown fields are refused (``extra="forbid"``) and fields Kiln knows but does
not implement yet are refused by name, so a client never gets silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error returned to the client as ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        413: "RequestTooLargeError",
        503: "ServiceUnavailableError",
    }

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "InternalServerError" if self.status >= 500 else "BadRequestError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


class StrictModel(BaseModel):
    """A request body: unknown fields refused; allow_inf_nan off, or "NaN" / "Infinity" given as
    strings would become floats."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, allow_inf_nan=False)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``; vLLM's ``structural_tag`` type carries xgrammar's structural tag
    (``format``, or the older ``structures`` with ``triggers``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs``: one constraint (``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object`` or ``structural_tag``) and the options that shape it."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")  # ``json`` would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class SamplingFields(StrictModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI's and vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    priority: int = 0
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    # guided decoding (vLLM's names)
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None
    max_tokens: int | None = 16
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    """A chat message; extra keys (``name``, ``tool_calls``, ``tool_call_id``...) go to the template as given."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class GenerateRequest(BaseModel):
    """vLLM's simple ``/generate``: a prompt plus any ``SamplingParams`` field."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    prompt: str | list[int]
    stream: bool = False
    structured_outputs: StructuredOutputs | None = None


class LoadLoRAAdapterRequest(StrictModel):
    """vLLM's ``/v1/load_lora_adapter`` body; ``load_inplace`` replaces an adapter of that name."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(StrictModel):
    """vLLM's ``/v1/unload_lora_adapter`` body: the adapter's name, or its ``lora_int_id``."""

    lora_name: str | None = None
    lora_int_id: int | None = None
