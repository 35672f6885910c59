"""From a prompt and ``SamplingParams`` to the core's ``Request``s and the output side's state.

Per request: tokenize (or take the given ids), validate against the model and the
engine's limits, truncate, turn ``bad_words`` into token ids, compile the guided
decoding constraint (cached), and fan out ``best_of`` sequences (``{i}_{id}``,
seeds ``seed + i``, sharing their prompt's KV blocks). Safe to call from another
thread than the one stepping the engine (the server's front end does), so bad
input fails before anything is queued.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.output_processor import RequestGroup, SequenceState
from kiln.engine.request import Request

if TYPE_CHECKING:
    from kiln.engine.guided_manager import GuidedManager
    from kiln.engine.model_info import ModelInfo
    from kiln.interfaces.guided import CompiledGuide
    from kiln.lora.request import LoRARequest
    from kiln.sampling_params import SamplingParams

PromptInput = str | list[int] | dict


@dataclass(slots=True)
class ProcessedRequest:
    """A validated request: the sequences the core runs, and how its output is assembled."""

    requests: list[Request]
    group: RequestGroup
    lora_adapter: object = None  # the adapter's weights, read when checked, held while it runs

    @property
    def request_id(self) -> str:
        return self.group.request_id


class InputProcessor:
    def __init__(self, model: ModelInfo, guided: GuidedManager, max_logprobs: int) -> None:
        self.model = model
        self.tokenizer = model.tokenizer
        self.guided = guided
        self.max_logprobs = max_logprobs
        self._ids = itertools.count()

    def tokenize_prompt(self, prompt: PromptInput, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return None, list(prompt)

    def compile_guide(self, params: SamplingParams) -> CompiledGuide | None:
        """The request's compiled constraint (from the cache after the first time); ``ValueError``
        says what is wrong with it."""
        return None if params.guided_decoding is None else self.guided.compile(params.guided_decoding)

    def process(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Tokenize and validate; raises ``ValueError`` naming the bad field."""
        arrival = arrival_time or time.time()
        request_id = request_id or str(next(self._ids))
        text, ids = self.tokenize_prompt(prompt)
        self._validate(ids, params)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]
        if params.bad_words:
            params._bad_words_token_ids = self._bad_words_ids(params.bad_words)
        if params.use_beam_search:
            return self._beam_search(request_id, text, ids, params, arrival, priority, lora_request)
        guide = self.compile_guide(params)
        fanned_out = params.best_of > 1
        requests, sequences = [], []
        for i in range(params.best_of):
            req = Request(
                request_id=f"{i}_{request_id}" if fanned_out else request_id,
                prompt_token_ids=ids,
                sampling_params=params,
                eos_token_ids=self.model.eos_token_ids,
                arrival_time=arrival,
                priority=priority,
                cache_salt=request_id if fanned_out else None,
                seed=None if params.seed is None else params.seed + i,
                matcher=None if guide is None else self.guided.matcher(guide, self.model.eos_token_ids),
                lora_request=lora_request,
            )
            requests.append(req)
            detok = IncrementalDetokenizer(self.tokenizer, ids, params)
            sequences.append(SequenceState(req.request_id, detok, req.metrics))
        return ProcessedRequest(
            requests, RequestGroup(request_id, text, ids, params, sequences, lora_request=lora_request)
        )

    def _beam_search(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        arrival: float,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> ProcessedRequest:
        """One core sequence, the first beam (the scheduler forks the rest), and ``n`` output
        sequences for the best hypotheses; the first shares the request's id, which is how
        the core reports the search."""
        if params.guided_decoding is not None:
            raise ValueError("guided decoding is not supported with beam search (use_beam_search).")
        req = Request(request_id, ids, params, self.model.eos_token_ids, arrival, priority, lora_request=lora_request)
        sequences = [
            SequenceState(
                request_id if i == 0 else f"{i}_{request_id}",
                IncrementalDetokenizer(self.tokenizer, ids, params),
                req.metrics,
            )
            for i in range(params.n)
        ]
        return ProcessedRequest(
            [req], RequestGroup(request_id, text, ids, params, sequences, lora_request=lora_request)
        )

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(
                f"prompt: token ids must be in [0, {vocab}), got {max(ids) if max(ids) >= vocab else min(ids)}"
            )
        n = min(len(ids), params.truncate_prompt_tokens or len(ids))
        if n >= self.model.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens leave no room to generate within max_model_len={self.model.max_model_len}"
            )
        limit = self.model.max_num_seqs
        if params.best_of > limit:  # sequences (or beams) of one request run side by side
            name = "n" if params.n > limit else "best_of"
            raise ValueError(f"{name}: at most {limit} sequences per request (--max-num-seqs)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}: {value} is more than --max-logprobs {self.max_logprobs}")
        for name in ("allowed_token_ids", "stop_token_ids"):
            bad = [t for t in (getattr(params, name) or []) if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}: token ids out of the vocabulary: {bad[:5]}")
        if params.logit_bias and any(not 0 <= int(t) < vocab for t in params.logit_bias):
            raise ValueError("logit_bias: token ids out of the vocabulary")

    def _bad_words_ids(self, words: Sequence[str]) -> list[list[int]]:
        out: dict[tuple[int, ...], None] = {}  # ordered and de-duplicated in linear time
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids:
                    out[tuple(ids)] = None
        return [list(ids) for ids in out]
