"""Per-request sampling parameters (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output when the request finishes


@dataclass(slots=True)
class SamplingParams:
    """What to sample and when to stop. Invalid values raise ``ValueError`` naming the field."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    # Filled by the engine from the tokenizer (bad_words) and guided decoding.
    guided_decoding: object | None = None
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.best_of is None:
            self.best_of = self.n
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}")

        if self.n < 1:
            bad("n", f"must be at least 1, got {self.n}.")
        if self.best_of < self.n:
            bad("best_of", f"must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            bad("temperature", f"must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad("top_k", f"must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs}.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            bad("truncate_prompt_tokens", f"must be at least 1, got {self.truncate_prompt_tokens}.")
        if any(s == "" for s in self.stop):
            bad("stop", "cannot contain an empty string.")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            bad("allowed_token_ids", "must not be empty.")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
