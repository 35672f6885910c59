"""From the core's token-level outputs to ``RequestOutput``: text, stop strings, logprobs, metrics.

Each sequence has a ``SequenceState`` here (its detokenizer, tokens, formatted
logprobs, finish reason), apart from the core's ``Request``. A stop string found
in the text finishes the sequence here and goes back to the core as an abort
(``OutputResult.reqs_to_abort``); every other finish comes from the core.

A user request with ``n``/``best_of`` > 1 becomes ``best_of`` child sequences
(``{i}_{request_id}``). Its ``RequestGroup`` reports them together; with
``best_of > n`` it waits for all of them and keeps the ``n`` with the highest
cumulative logprob. A beam search reports once, at its end: its ``n`` output
sequences take the best hypotheses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache

from kiln.engine.beam_search import BeamHypothesis
from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.request import EngineCoreOutput, TopLogprobs
from kiln.lora.request import LoRARequest
from kiln.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from kiln.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class SequenceState:
    """One sequence as the output side sees it."""

    request_id: str
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    sent_text: int = 0  # DELTA mode: what was already sent
    sent_tokens: int = 0
    sent_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState]
    sent_prompt_logprobs: bool = False
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            for seq in self.sequences:
                seq.prompt_logprobs = [None]  # nothing predicts the first prompt token

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def make_output(self) -> RequestOutput | None:
        finished = self.finished
        kind = self.params.output_kind
        ranked_later = self.params.best_of > self.params.n or self.params.use_beam_search
        if (kind is RequestOutputKind.FINAL_ONLY or ranked_later) and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        chosen = list(self.sequences)
        if self.params.best_of > self.params.n and not self.params.use_beam_search:
            chosen.sort(key=lambda s: s.cumulative_logprob, reverse=True)
            chosen = chosen[: self.params.n]
        outputs = [self._completion(index, seq, delta) for index, seq in enumerate(chosen)]
        first = self.sequences[0]
        prompt_logprobs = None
        if self.params.prompt_logprobs is not None and not (delta and self.sent_prompt_logprobs):
            prompt_logprobs = first.prompt_logprobs
            self.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens,
            metrics=first.metrics,
            lora_request=self.lora_request,
        )

    def take_beams(self, beams: list[BeamHypothesis], now: float) -> None:
        """A finished beam search: the output sequences take the best hypotheses, in order."""
        params = self.params
        for i, seq in enumerate(self.sequences):
            if i >= len(beams):  # fewer hypotheses than n: only with a tiny vocabulary
                seq.finish_reason = "length"
                continue
            hyp = beams[i]
            seq.token_ids = list(hyp.token_ids)
            stopped_on = hyp.token_ids[-1] if hyp.finish_reason == "stop" else None
            shown = (
                hyp.token_ids[:-1]
                if stopped_on is not None and not params.include_stop_str_in_output
                else hyp.token_ids
            )
            seq.detokenizer.update(shown, check_stop=False)
            seq.cumulative_logprob = hyp.cumulative_logprob
            seq.finish_reason = hyp.finish_reason
            seq.stop_reason = stopped_on if stopped_on in params.stop_token_ids else None
            seq.metrics.finished_time = now
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now - seq.metrics.arrival_time
            seq.metrics.last_token_time = now

    def _completion(self, index: int, seq: SequenceState, delta: bool) -> CompletionOutput:
        text = seq.detokenizer.visible_text(seq.finished)
        want_logprobs = self.params.logprobs is not None or self.params.use_beam_search
        tokens, logprobs = seq.token_ids, seq.logprobs if want_logprobs else None
        if delta:
            text, seq.sent_text = text[seq.sent_text :], len(text)
            tokens, seq.sent_tokens = tokens[seq.sent_tokens :], len(tokens)
            if logprobs is not None:
                logprobs, seq.sent_logprobs = logprobs[seq.sent_logprobs :], len(logprobs)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
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


@dataclass(slots=True)
class OutputResult:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # sequences a stop string finished while the core still runs them


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.formatter = LogprobFormatter(tokenizer)
        self.groups: dict[str, RequestGroup] = {}
        self.sequences: dict[str, tuple[RequestGroup, SequenceState]] = {}

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for seq in group.sequences:
            self.sequences[seq.request_id] = (group, seq)

    def abort(self, request_id: str) -> list[str]:
        """Forget a user request; returns its sequences' ids (for the core to abort)."""
        group = self.groups.pop(request_id, None)
        ids = [seq.request_id for seq in group.sequences] if group else []
        for rid in ids:
            del self.sequences[rid]
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def process(self, outputs: list[EngineCoreOutput]) -> OutputResult:
        now = time.time()
        touched: dict[str, RequestGroup] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self.sequences.get(out.request_id)
            if entry is None:
                continue  # aborted while the step ran
            group, seq = entry
            seq.num_cached_tokens = out.num_cached_tokens
            if out.beams is not None:
                group.take_beams(out.beams, now)
                touched[group.request_id] = group
                continue
            if out.new_prompt_logprobs:
                seq.prompt_logprobs.extend(self.formatter.position(lp) for lp in out.new_prompt_logprobs)
            if out.new_token_ids:
                if self._update(group.params, seq, out, now):
                    to_abort.append(seq.request_id)
                touched[group.request_id] = group
            elif out.finish_reason is not None:  # ended without a token (a dead guided constraint)
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
                seq.metrics.finished_time = now
                touched[group.request_id] = group
        request_outputs = []
        for group in touched.values():
            output = group.make_output()
            if output is not None:
                request_outputs.append(output)
            if group.finished:
                self.abort(group.request_id)
        return OutputResult(request_outputs, to_abort)

    def _update(self, params: SamplingParams, seq: SequenceState, out: EngineCoreOutput, now: float) -> bool:
        """Take a step's tokens; True when a stop string ended a sequence the core still runs."""
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now - m.arrival_time
        m.last_token_time = now
        # Token by token: a step may bring several (speculative decoding), and a stop string
        # in one ends the sequence there, as it would have one step at a time.
        new_logprobs = out.new_logprobs or [None] * len(out.new_token_ids)
        last = len(out.new_token_ids) - 1
        stop = None
        for i, (token_id, lp) in enumerate(zip(out.new_token_ids, new_logprobs)):
            seq.token_ids.append(token_id)
            if lp is not None:
                seq.cumulative_logprob += lp.logprob
                if params.logprobs is not None:
                    seq.logprobs.append(self.formatter.position(lp))
            if i == last and out.finish_reason == "stop" and not params.include_stop_str_in_output:
                break  # EOS or a stop_token_id ended it: like vLLM, its text is not part of the output
            # vLLM looks for stop strings only once min_tokens are out.
            stop = seq.detokenizer.update([token_id], check_stop=len(seq.token_ids) > params.min_tokens)
            if stop is not None:
                break
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        if seq.finished:
            m.finished_time = now
        return stop is not None and out.finish_reason is None
