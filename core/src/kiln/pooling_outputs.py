"""What pooling requests return, in vLLM's shapes: ``PoolingRequestOutput`` and its typed views.

``LLM.encode`` returns ``PoolingRequestOutput`` (``.outputs.data``: a float32 tensor);
``LLM.embed``, ``LLM.classify`` and ``LLM.score`` return the same request with
``.outputs`` read as an embedding, class probabilities or a score.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kiln.outputs import RequestMetrics

T = TypeVar("T")


@dataclass(slots=True)
class PoolingOutput:
    """The pooled output: (hidden,) or (labels,) for one vector, (tokens, hidden) per token."""

    data: Any  # a float32 CPU torch.Tensor


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # one per label (raw logits when use_activation is off)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
        return cls(*_fields(out, EmbeddingOutput(out.outputs.data.tolist())))


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput[PoolingOutput]) -> ClassificationRequestOutput:
        return cls(*_fields(out, ClassificationOutput(out.outputs.data.tolist())))


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @classmethod
    def from_score(cls, out: PoolingRequestOutput, score: float) -> ScoringRequestOutput:
        return cls(*_fields(out, ScoringOutput(float(score))))


def _fields(out: PoolingRequestOutput, outputs: Any) -> tuple:
    return out.request_id, outputs, out.prompt_token_ids, out.finished, out.prompt, out.num_cached_tokens, out.metrics
