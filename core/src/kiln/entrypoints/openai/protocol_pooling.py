"""Request bodies of the pooling endpoints (vLLM's shapes): ``/v1/embeddings``, ``/pooling``,
``/score``, ``/rerank`` and ``/classify``. Unknown fields are refused, as everywhere."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kiln.entrypoints.openai.protocol import ChatMessage, StrictModel

PromptList = str | list[str] | list[int] | list[list[int]]


class ActivationFields(StrictModel):
    """Classification outputs: softmax (sigmoid for one label) or raw logits. ``softmax`` and
    ``activation`` are vLLM's older names for ``use_activation``."""

    use_activation: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None

    def activation_flag(self) -> bool | None:
        return next((v for v in (self.use_activation, self.softmax, self.activation) if v is not None), None)


class EmbeddingRequest(StrictModel):
    """OpenAI's embeddings body, or vLLM's chat form (``messages`` instead of ``input``)."""

    model: str | None = None
    input: PromptList | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # -1: to max_model_len
    normalize: bool | None = None
    add_special_tokens: bool | None = None  # default: true for input, false for messages (vLLM's)
    priority: int = 0
    request_id: str | None = None
    # the chat form's template options, as /v1/chat/completions has them
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class PoolingRequest(EmbeddingRequest, ActivationFields):
    """``/pooling``: the model's own pooled output (embeddings, class probabilities, token states)."""


class ClassificationRequest(ActivationFields):
    model: str | None = None
    input: PromptList
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None


class ScoreRequest(ActivationFields):
    """vLLM's ``/score``: ``text_1`` against ``text_2``, 1-to-1, 1-to-N or N-to-N."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    request_id: str | None = None


class RerankDocument(StrictModel):
    text: str


class RerankRequest(ActivationFields):
    """``/rerank`` (Jina and Cohere): ``documents`` ordered by relevance to ``query``."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int = Field(0, ge=0)  # 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    request_id: str | None = None

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]
