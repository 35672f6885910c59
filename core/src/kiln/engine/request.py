"""A request's state as the engine core sees it, and what the core emits for it each step.

No tensors here: the scheduler, the KV manager and the input/output processors
share these types without importing torch (a meta-test holds them to it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.outputs import RequestMetrics

if TYPE_CHECKING:
    from kiln.engine.beam_search import BeamGroup, BeamHypothesis
    from kiln.engine.kv_cache import Block
    from kiln.interfaces.guided import GuideMatcher
    from kiln.lora.request import LoRARequest
    from kiln.pooling_params import PoolingParams
    from kiln.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is. Only ``kiln.engine.scheduler`` sets a ``FINISHED_*`` status."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False, slots=True)
class Request:
    """One sequence being generated.

    The scheduling invariant: ``num_computed_tokens`` advances towards
    ``num_tokens`` (prompt + outputs so far); a request samples when a step
    brings it level. ``metrics`` is shared with the output processor's view of the
    same sequence: the core writes the scheduling and forward times, the output
    processor the token times.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None  # None: a pooling request (``pooling_params``)
    eos_token_ids: frozenset[int]
    arrival_time: float
    priority: int = 0
    cache_salt: object = None  # requests fanned out from one prompt share this, so share blocks
    seed: int | None = None  # the sampler keeps a generator seeded with it, for this request only
    matcher: GuideMatcher | None = None  # guided decoding: this sequence's constraint state
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit on first scheduling
    status: RequestStatus = RequestStatus.WAITING
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs were emitted (recompute skips them)
    metrics: RequestMetrics | None = None
    beam: BeamGroup | None = None  # beam search: the group this sequence is one beam of
    # A pooling request (kiln.engine.pooling): prefill-only, ends with its pooled output.
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None  # a cross-encoder pair's segment ids, one per prompt token
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)
    lora_waits: int = 0  # steps it waited for an adapter slot (the scheduler's fairness)
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens scheduled after its last token

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_sampled_rows(self) -> int:
        """Logits rows a step that reaches this sequence's end samples from: its last token's,
        then one per draft (speculative decoding)."""
        return 1 + len(self.spec_token_ids)

    def fork(self, request_id: str) -> Request:
        """A copy of this sequence under a new id, for beam search: same tokens, progress and
        metrics (one record per user request); ``KVCacheManager.fork`` shares the blocks."""
        child = Request(
            request_id, self.prompt_token_ids, self.sampling_params, self.eos_token_ids, self.arrival_time,
            self.priority, self.cache_salt, metrics=self.metrics, beam=self.beam, lora_request=self.lora_request,
        )  # fmt: skip
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.num_prompt_logprobs = self.num_prompt_logprobs
        child.block_hashes = list(self.block_hashes)
        return child

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def stop_ids(self) -> frozenset[int]:
        """The tokens that end this sequence once ``min_tokens`` are out: its stop token ids,
        and EOS unless ``ignore_eos``."""
        params = self.sampling_params
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return frozenset(params.stop_token_ids) | eos

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def reads_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position computed, so such requests take no hits."""
        return self.pooling_params is not None or self.sampling_params.prompt_logprobs is None


@dataclass(slots=True)
class TopLogprobs:
    """One position: the chosen token's logprob and 1-based rank, then the top-k (ids, logprobs)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request: token ids and logprob ids, no text.

    ``new_logprobs`` has one entry per new token when the request asked for logprobs
    (or ranks its ``best_of`` sequences by them); ``new_prompt_logprobs`` covers the
    prompt positions computed this step. ``finish_reason`` is ``"stop"``, ``"length"``
    or ``"abort"`` once the core has finished the request; ``stop_reason`` is then the
    stop token id that ended it, if any. A beam search reports nothing until it ends, then
    its hypotheses in ``beams``.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TopLogprobs] | None = None
    new_prompt_logprobs: list[TopLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    beams: list[BeamHypothesis] | None = None  # a finished beam search: its hypotheses, best first
    pooled: object = None  # a finished pooling request: its output (a float32 CPU tensor)

    def then(self, later: EngineCoreOutput) -> EngineCoreOutput:
        """This output and a later one of the same request, as one (multi-step scheduling holds a
        window's outputs and reports them together)."""
        return EngineCoreOutput(
            self.request_id,
            self.new_token_ids + later.new_token_ids,
            _joined(self.new_logprobs, later.new_logprobs),
            _joined(self.new_prompt_logprobs, later.new_prompt_logprobs),
            later.finish_reason,
            later.stop_reason,
            later.num_cached_tokens,
            later.beams,
            later.pooled,
        )


def _joined(first: list | None, second: list | None) -> list | None:
    return first if second is None else second if first is None else first + second
