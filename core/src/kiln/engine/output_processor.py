"""From finished steps to ``RequestOutput``: grouping fanned-out sequences, text, logprobs.

A user request with ``n``/``best_of`` > 1 becomes ``best_of`` child sequences
(``{i}_{request_id}``). The group reports them together; with ``best_of > n`` it
waits for all of them and keeps the ``n`` with the highest cumulative logprob.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.request import Request
from kiln.engine.sampler import TopLogprobs
from kiln.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from kiln.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    sent_text: list[int] = field(default_factory=list)  # DELTA mode: chars already sent
    sent_tokens: list[int] = field(default_factory=list)
    sent_logprobs: list[int] = field(default_factory=list)
    sent_prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        k = len(self.children)
        self.sent_text, self.sent_tokens, self.sent_logprobs = [0] * k, [0] * k, [0] * k

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)

    def make_output(self) -> RequestOutput | None:
        finished = self.finished
        kind = self.params.output_kind
        if (kind is RequestOutputKind.FINAL_ONLY or self.params.best_of > self.params.n) and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        chosen = list(range(len(self.children)))
        if self.params.best_of > self.params.n:
            chosen.sort(key=lambda i: self.children[i].cumulative_logprob, reverse=True)
            chosen = chosen[: self.params.n]
        outputs = [self._completion(index, i, delta) for index, i in enumerate(chosen)]
        first = self.children[0]
        prompt_logprobs = None
        if self.params.prompt_logprobs is not None and not (delta and self.sent_prompt_logprobs):
            prompt_logprobs = first.prompt_logprobs
            self.sent_prompt_logprobs = True
        metrics = first.metrics
        metrics.model_execute_time = time.time() - metrics.arrival_time
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics=metrics,
        )

    def _completion(self, index: int, i: int, delta: bool) -> CompletionOutput:
        req, detok = self.children[i], self.detokenizers[i]
        finished = req.is_finished
        text = detok.visible_text(finished)
        tokens, logprobs = req.output_token_ids, req.logprobs if self.params.logprobs is not None else None
        if delta:
            text, self.sent_text[i] = text[self.sent_text[i] :], len(text)
            tokens, self.sent_tokens[i] = tokens[self.sent_tokens[i] :], len(tokens)
            if logprobs is not None:
                logprobs, self.sent_logprobs[i] = logprobs[self.sent_logprobs[i] :], len(logprobs)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=req.cumulative_logprob if self.params.logprobs is not None else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
        )


class LogprobFormatter:
    """Builds vLLM-shaped ``{token_id: Logprob}`` positions, decoding each token once."""

    def __init__(self, tokenizer) -> None:
        self.decode = lru_cache(maxsize=65536)(lambda tid: tokenizer.decode([tid]))

    def position(self, lp: TopLogprobs) -> PositionLogprobs:
        out = {lp.token_id: Logprob(lp.logprob, lp.rank, self.decode(lp.token_id))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            out.setdefault(tid, Logprob(value, rank, self.decode(tid)))
        return out
