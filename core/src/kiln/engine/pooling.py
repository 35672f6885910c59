"""The engine's pooling path: a model served with a pooling task (``--task embed`` and friends)
takes ``PoolingParams`` requests instead of ``SamplingParams`` ones.

  PoolingInputProcessor ─▶ Request(pooling_params) ─▶ scheduler: the whole prompt in one step
        (tokens, checks,        (no sampling params)     (no chunking; encoders: no prefix cache)
         defaults resolved)                                        │
                                    model runner pools its rows ◀──┘ (kiln.models.pooler.pool)
                                               │
  PoolingOutputProcessor ◀─ finish_pooled ◀────┘ the request ends that step, its blocks freed
        (PoolingRequestOutput)

The two processors stand in for the generation ones (same methods) in an engine whose model
pools; ``check_task`` refuses the other kind of request with a message naming ``--task``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kiln.engine.input_processor import ProcessedRequest
from kiln.engine.output_processor import OutputResult
from kiln.engine.request import EngineCoreOutput, Request, RequestStatus
from kiln.outputs import RequestMetrics
from kiln.pooling_outputs import PoolingOutput, PoolingRequestOutput
from kiln.pooling_params import HEADS, PoolerConfig, PoolingParams, check_task

if TYPE_CHECKING:
    from kiln.engine.input_processor import PromptInput
    from kiln.engine.model_info import ModelInfo
    from kiln.engine.scheduler import Scheduler


@dataclass(slots=True)
class PoolingGroup:
    """A pooling request as the output side sees it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics


@dataclass(frozen=True, slots=True)
class PoolingModelInfo:
    """What the pooling input side needs beyond ``ModelInfo``."""

    pooler: PoolerConfig
    hidden_size: int
    type_vocab_size: int  # token type (segment) ids the model embeds; 0: none
    matryoshka_dimensions: tuple[int, ...] | None = None  # the only ``dimensions`` a matryoshka model takes
    labels: tuple[str, ...] = ()  # a classifier's label names, by class index


class PoolingInputProcessor:
    def __init__(self, model: ModelInfo, info: PoolingModelInfo) -> None:
        self.model = model
        self.info = info
        self.tokenizer = model.tokenizer
        self._ids = itertools.count()

    def compile_guide(self, params: object) -> None:
        """Guided decoding is for generation: refuse it as ``check_task`` does."""
        check_task(self.model.task, params)

    def process(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> ProcessedRequest:
        """Tokenize, truncate and validate; raises ``ValueError`` naming the bad field.

        ``prompt``: text, token ids, or a dict with ``prompt`` or ``prompt_token_ids`` (and
        ``token_type_ids`` for a cross-encoder's pair, see ``tokenize_pair``)."""
        check_task(self.model.task, params)
        resolved = self.resolve(params)
        request_id = request_id or str(next(self._ids))
        text, ids, token_types = self._tokens(prompt, params.truncate_prompt_tokens)
        self._validate(ids, token_types)
        req = Request(
            request_id,
            ids,
            None,
            frozenset(),
            arrival_time or time.time(),
            priority,
            pooling_params=resolved,
            token_type_ids=token_types,
        )
        return ProcessedRequest([req], PoolingGroup(request_id, text, ids, req.metrics))

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """``params`` with the model's defaults filled in, checked against the model."""
        head, pooler = HEADS[self.model.task], self.info.pooler
        if head != "embed":
            for name in ("dimensions", "normalize"):
                if getattr(params, name) is not None:
                    raise ValueError(f"{name}: only embedding models (--task embed) take it")
        if head != "classify" and params.use_activation is not None:
            raise ValueError("use_activation: only classification models (--task classify or score) take it")
        truncation_limit(params.truncate_prompt_tokens, self.model.max_model_len)
        dimensions = params.dimensions if params.dimensions is not None else pooler.dimensions
        if dimensions is not None:
            allowed = self.info.matryoshka_dimensions
            if allowed and dimensions not in allowed:
                raise ValueError(f"dimensions: the model was trained for {list(allowed)}, got {dimensions}")
            if dimensions > self.info.hidden_size:
                raise ValueError(f"dimensions: at most the model's {self.info.hidden_size}, got {dimensions}")
        return replace(
            params,
            task=params.task or "encode",
            head=head,
            pooling_type=pooler.pooling_type,
            dimensions=dimensions,
            normalize=pooler.normalize if params.normalize is None else params.normalize,
            use_activation=pooler.use_activation if params.use_activation is None else params.use_activation,
        )

    def _tokens(self, prompt: PromptInput, truncate: int | None) -> tuple[str | None, list[int], list[int] | None]:
        limit = truncation_limit(truncate, self.model.max_model_len)
        text, types = None, None
        if isinstance(prompt, dict):
            types = prompt.get("token_type_ids")
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            else:
                prompt = prompt["prompt"]
        if isinstance(prompt, str):
            text, ids = prompt, encode_text(self.tokenizer, prompt, truncate, self.model.max_model_len)
        elif not isinstance(prompt, dict):
            ids = list(prompt)
        if limit is not None and len(ids) > limit:
            # Token ids keep their tail, as generation prompts (and vLLM) do: last-token pooling reads it.
            ids, types = ids[-limit:], None if types is None else list(types)[-limit:]
        return text, ids, None if types is None else list(types)

    def _validate(self, ids: list[int], token_types: list[int] | None) -> None:
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        limit = self.model.max_model_len
        if len(ids) > limit:
            raise ValueError(
                f"prompt: {len(ids)} tokens are more than this model's maximum context length of {limit}; "
                "shorten it or set truncate_prompt_tokens"
            )
        if token_types is not None:
            kinds = self.info.type_vocab_size
            if len(token_types) != len(ids) or any(not 0 <= t < max(kinds, 1) for t in token_types):
                raise ValueError(f"token_type_ids: one per prompt token, each in [0, {max(kinds, 1)})")


def truncation_limit(truncate: int | None, max_model_len: int) -> int | None:
    """The prompt tokens ``truncate_prompt_tokens`` keeps (``-1``: ``max_model_len``; None: all of
    them); ``ValueError`` past ``max_model_len`` or below -1 (before a tokenizer sees it)."""
    if truncate is not None and (truncate == 0 or truncate < -1):
        raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate}.")
    if truncate is not None and truncate > max_model_len:
        raise ValueError(f"truncate_prompt_tokens: at most max_model_len={max_model_len}, got {truncate}")
    return max_model_len if truncate == -1 else truncate


def encode_text(
    tokenizer, text: str, truncate: int | None, max_model_len: int, add_special_tokens: bool = True
) -> list[int]:
    """``text``'s token ids; ``truncate`` (``-1``: ``max_model_len``) cuts them as the tokenizer does
    (from its ``truncation_side``, keeping special tokens such as BERT's final ``[SEP]``)."""
    limit = truncation_limit(truncate, max_model_len)
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, truncation=limit is not None, max_length=limit)
    return encoded["input_ids"]


def tokenize_pair(tokenizer, first: str, second: str, truncate: int | None, max_model_len: int) -> dict:
    """A cross-encoder's input for a (query, document) pair: ``{"prompt_token_ids", "token_type_ids"}``
    as the tokenizer builds it (``[CLS] a [SEP] b [SEP]``, segment ids 0 then 1 where the model has them).
    Truncation (``-1``: to ``max_model_len``) cuts the longer text first, as transformers does."""
    limit = truncation_limit(truncate, max_model_len)
    special = tokenizer.num_special_tokens_to_add(pair=True)
    if limit is not None and limit <= special:  # the tokenizer would ignore it and keep the whole pair
        raise ValueError(f"truncate_prompt_tokens: a pair needs more than its {special} special tokens, got {limit}")
    encoded = tokenizer(first, second, truncation=limit is not None and "longest_first", max_length=limit)
    out = {"prompt_token_ids": encoded["input_ids"]}
    if "token_type_ids" in encoded:
        out["token_type_ids"] = encoded["token_type_ids"]
    return out


class PoolingOutputProcessor:
    """Turns the core's finished pooling requests into ``PoolingRequestOutput``s."""

    def __init__(self) -> None:
        self.groups: dict[str, PoolingGroup] = {}

    def add(self, group: PoolingGroup) -> None:
        self.groups[group.request_id] = group

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the ids the core must abort."""
        return [request_id] if self.groups.pop(request_id, None) is not None else []

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def process(self, outputs: list[EngineCoreOutput]) -> OutputResult:
        now = time.time()
        finished = []
        for out in outputs:
            group = self.groups.pop(out.request_id, None) if out.pooled is not None else None
            if group is None:
                continue  # aborted while the step ran
            group.metrics.finished_time = now
            finished.append(
                PoolingRequestOutput(
                    group.request_id,
                    PoolingOutput(out.pooled),
                    group.prompt_token_ids,
                    True,
                    group.prompt,
                    out.num_cached_tokens,
                    group.metrics,
                )
            )
        return OutputResult(finished, [])


def finish_pooled(scheduler: Scheduler, pooled: dict) -> list[EngineCoreOutput]:
    """End the pooling requests this step computed (their whole prompt), one output each with its
    pooled tensor; the scheduler frees their blocks at once."""
    if not pooled:
        return []
    scheduler.finish_requests([req.request_id for req in pooled], RequestStatus.FINISHED_STOPPED)
    return [
        EngineCoreOutput(
            req.request_id, [], finish_reason="stop", num_cached_tokens=req.num_cached_tokens or 0, pooled=data
        )
        for req, data in pooled.items()
    ]
