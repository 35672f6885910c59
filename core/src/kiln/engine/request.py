"""A request's state as the scheduler and engine see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.outputs import PositionLogprobs, RequestMetrics

if TYPE_CHECKING:
    import torch

    from kiln.engine.kv_cache import Block
    from kiln.guided import GuideMatcher
    from kiln.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
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
    brings it level.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    priority: int = 0
    parent_id: str | None = None  # the user's request id when this is one of best_of sequences
    cache_salt: object = None  # requests fanned out from one prompt share this, so share blocks
    generator: torch.Generator | None = None
    matcher: GuideMatcher | None = None  # guided decoding: this sequence's constraint state
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit on first scheduling
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    metrics: RequestMetrics | None = None

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

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished
