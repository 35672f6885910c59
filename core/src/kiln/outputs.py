"""What the engine returns: the fields of the seed-000 output tables, in vLLM's shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.lora.request import LoRARequest


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> Logprob (the sampled token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    reasoning_content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Times are ``time.time()`` seconds; costs are seconds."""

    arrival_time: float
    request_start_time: float | None = None  # when the engine accepted it
    preprocess_cost_time: float | None = None  # tokenization and validation
    inference_start_time: float | None = None  # first scheduled
    time_in_queue: float | None = None
    first_token_time: float | None = None  # seconds from arrival to the first token
    last_token_time: float | None = None
    finished_time: float | None = None
    model_forward_time: float = 0.0  # forward passes this request took part in
    model_execute_time: float = 0.0  # forward + sampling + detokenization steps


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error_code: int | None = None
    error_msg: str | None = None
    lora_request: LoRARequest | None = field(default=None, repr=False)  # the adapter it ran with


@dataclass(slots=True)
class BeamSearchSequence:
    """One hypothesis of ``LLM.beam_search`` (vLLM's shape): ``tokens`` and ``text`` cover the
    prompt and the generated tokens; ``cum_logprob`` sums the generated tokens' log-probabilities."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """``LLM.beam_search``'s result for one prompt: its hypotheses, best first."""

    sequences: list[BeamSearchSequence]
