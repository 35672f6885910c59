"""Continuous batching under a per-step token budget.

Each step, ``schedule()`` decides ``{request: num_tokens}`` so that every
request's ``num_computed_tokens`` moves towards its ``num_tokens``:

  1. Running requests first (decodes and unfinished prefill chunks), in order.
     If blocks run out, the lowest-priority running request is preempted by
     recompute (its blocks are freed, it goes back to the front of the queue and
     later re-prefills prompt + outputs, so its text is unchanged).
  2. Then waiting requests, by policy (fcfs: arrival; priority: lower value
     first, then arrival), while the budget, ``max_num_seqs`` and the free blocks
     allow; a request whose LoRA adapter would make more than ``max_loras`` adapters
     run at once waits (later requests may pass it, but after ``LORA_PATIENCE`` steps
     other adapters' requests wait for it instead). Prefix-cache hits are taken first; with chunked prefill a prompt may
     take whatever budget is left, otherwise it must fit whole.

Speculative decoding (``kiln.spec_decode``): once the running requests are scheduled, each
decoding one also gets the drafts its proposer offers, from the budget and blocks left
(drafts never preempt anyone; waiting requests are admitted after them);
``update_from_output`` appends the drafts the executor accepted and the token after them.

Multi-step scheduling (``--num-scheduler-steps N``): a step that runs decodes only opens a window,
and for its next N-1 steps the running requests go on decoding while no waiting request joins (a
new request waits up to N-1 steps longer for its first token). The window closes early once no
running request has a token to compute. ``EngineCore`` holds the window's outputs until it closes
under ``--multi-step-stream-outputs false``.

Admission keeps ``1 - kv_cache_ratio`` of the blocks free for the decodes of
running requests (seed 000's ``kv_cache_ratio``), which makes preemption rarer.

Beam search (``kiln.engine.beam_search``): each beam is a request here. A beam that has
offered its candidates waits (nothing to compute) until its siblings have too; then the
group picks the next beams, continuing or forking their parents (forks share the parent's
KV blocks) and dropping the rest.

Where a request finishes: here, and only here. ``update_from_output`` ends a
request on EOS, a stop token id, ``max_tokens``, ``max_model_len`` or a complete
guided-decoding constraint; ``finish_requests`` ends it on an abort from outside
(the client went away, or the output processor found a stop string).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.engine.beam_search import BeamCandidates, BeamGroup
from kiln.engine.guided_manager import GuardedMatcher
from kiln.engine.request import EngineCoreOutput, Request, RequestStatus, TopLogprobs
from kiln.spec_decode.draft_slots import DraftSlots
from kiln.spec_decode.ngram import NgramProposer
from kiln.spec_decode.stats import SpecDecodeStats

if TYPE_CHECKING:
    from kiln.config import EngineConfig
    from kiln.engine.kv_cache import KVCacheManager

logger = logging.getLogger("kiln.engine")
LORA_PATIENCE = 32  # steps a request may wait for an adapter slot before other adapters stop passing it


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # (request, tokens to compute), running first
    total_num_scheduled_tokens: int
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens computed this step (recomputation after preemption included)."""
        return sum(min(n, max(0, req.num_prompt_tokens - req.num_computed_tokens)) for req, n in self.scheduled)


@dataclass(slots=True)
class SampledToken:
    """A token the sampler chose, with its logprobs when the request wants them."""

    token_id: int
    logprobs: TopLogprobs | None = None
    beam_candidates: BeamCandidates | None = None  # beam search: the next tokens this beam offers


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.max_model_len = config.max_model_len
        self.token_budget = config.max_num_batched_tokens
        self.priority = config.scheduling_policy == "priority"
        self.reserve = int((1.0 - config.kv_cache_ratio) * (kv.num_blocks - 1))
        self.num_preemptions = 0
        spec = config.speculative_config
        self.proposer: NgramProposer | DraftSlots | None = None
        if spec is not None:
            ngram = spec.method == "ngram"
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if ngram else DraftSlots()
        self.spec_stats = SpecDecodeStats()
        self.window_left = 0  # multi-step scheduling: steps left in the window that admit no request
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.beam_groups: dict[str, BeamGroup] = {}  # unfinished beam searches, by request id

    def _key(self, req: Request) -> tuple:
        return (req.priority, req.arrival_time) if self.priority else (req.arrival_time,)

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)
        self.requests[req.request_id] = req
        if req.sampling_params is not None and req.sampling_params.use_beam_search:  # None: pooling
            params = req.sampling_params
            room = self.max_model_len - req.num_prompt_tokens
            group = BeamGroup(req.request_id, params, req.stop_ids, min(params.max_tokens or room, room))
            group.add_beam(req, 0.0)
            req.beam = group
            self.beam_groups[req.request_id] = group

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.token_budget
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        i = 0
        # At most max_num_seqs a step (forked beams can make more run): the rest wait a step.
        while i < len(self.running) and budget > 0 and len(scheduled) < self.config.max_num_seqs:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n == 0:  # a beam waiting for its siblings' candidates
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                # Only requests not yet scheduled this step may be preempted.
                victim = max(self.running[i:], key=self._key)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted itself; self.running[i] is now the next one
            scheduled.append((req, n))
            budget -= n
            i += 1

        if self.proposer is not None:
            budget = self._add_drafts(scheduled, budget)
        if not scheduled:
            self.window_left = 0  # the window's requests are done: admit again
        admit = self.window_left == 0

        # Beams waiting for their siblings compute nothing: they take no place in the batch.
        busy = sum(not _idle_beam(r) for r in self.running)
        # At most --max-loras adapters among running requests: the model has that many slots.
        loras = {r.lora_request for r in self.running if r.lora_request is not None}
        starved = self._starved_adapter(loras)
        while admit and self.waiting and budget > 0 and busy < self.config.max_num_seqs and not preempted:
            ready = (r for r in self.waiting if not _idle_beam(r) and self._lora_fits(r, loras, starved))
            req = min(ready, key=self._key, default=None) if self.priority else next(ready, None)
            if req is None:
                break
            computed, num_hit = self.kv.get_computed_blocks(req)
            n = req.num_tokens - num_hit
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            left = self.kv.can_fit(req, n, computed)
            if left is None or (self.running and left < self.reserve):
                if self.running and all(_idle_beam(r) for r in self.running):
                    # Only beams waiting for a sibling hold the blocks that sibling needs: evict one
                    # (its candidates stay offered; it recomputes once its group moves on).
                    self._preempt(self.running[-1])
                    continue
                break
            self.kv.allocate_slots(req, n, computed)
            self.waiting.remove(req)
            self.kv.record_admission(req, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_hit
                req.metrics.inference_start_time = time.time()
                req.metrics.time_in_queue = req.metrics.inference_start_time - req.arrival_time
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.lora_request is not None:
                loras.add(req.lora_request)
            busy += 1
            scheduled.append((req, n))
            budget -= n

        if self.window_left:
            self.window_left -= 1
        elif self.config.num_scheduler_steps > 1 and scheduled and all(_decodes(r, n) for r, n in scheduled):
            self.window_left = self.config.num_scheduler_steps - 1
        copies = self.kv.take_copies() if scheduled else []  # kept for a step that runs
        return SchedulerOutput(scheduled, self.token_budget - budget, preempted, copies)

    def _add_drafts(self, scheduled: list[tuple[Request, int]], budget: int) -> int:
        """Give the decoding requests scheduled this step their drafts, from the budget and free
        blocks the step leaves: drafts are optional, so they never preempt anyone. Returns the
        budget left."""
        limit = self.config.speculative_config.disable_by_batch_size
        if limit is not None and len(self.running) + len(self.waiting) > limit:
            return budget
        for i, (req, n) in enumerate(scheduled):
            if budget <= 0:
                break
            if not _decodes(req, n):
                continue  # a prefill chunk
            drafts = self._propose(req, budget)
            if drafts and self.kv.allocate_slots(req, 1 + len(drafts)):
                req.spec_token_ids = drafts
                scheduled[i] = (req, 1 + len(drafts))
                budget -= len(drafts)
        return budget

    def _propose(self, req: Request, room: int) -> list[int]:
        """Drafts to verify after ``req``'s last token: at most ``room`` and never more than it
        may still emit (or ``--speculative-max-model-len`` allows), less the token sampled after
        them."""
        spec, params = self.config.speculative_config, req.sampling_params
        if req.beam is not None or params is None:
            return []
        if req.matcher is not None and not req.matcher.supports_rollback:
            return []  # verifying drafts advances the matcher, then rolls it back
        left = min(self.max_model_len, spec.max_model_len or self.max_model_len) - req.num_tokens
        if params.max_tokens is not None:
            left = min(left, params.max_tokens - req.num_output_tokens)
        k = min(spec.num_speculative_tokens, room, left - 1)
        return self.proposer.propose(req.request_id, req.all_token_ids, k) if k > 0 else []

    def _starved_adapter(self, loras: set) -> object:
        """The adapter of the first waiting request kept out of a full set of slots for
        ``LORA_PATIENCE`` steps, or None. Until it runs no other adapter's request is admitted,
        so the running adapters drain: otherwise a stream of requests on them could keep it
        out forever."""
        if len(loras) < self.config.max_loras:
            return None
        starved = None
        for req in self.waiting:
            if req.lora_request is not None and req.lora_request not in loras:
                req.lora_waits += 1
                if starved is None and req.lora_waits >= LORA_PATIENCE:
                    starved = req.lora_request
        return starved

    def _lora_fits(self, req: Request, loras: set, starved: object) -> bool:
        lora = req.lora_request
        if lora is None:
            return True
        if starved is not None and lora != starved:
            return False
        return lora in loras or len(loras) < self.config.max_loras

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[Request, list[SampledToken]],
        prompt_logprobs: dict[Request, list[TopLogprobs]],
    ) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens (advancing guided matchers; after
        drafts, the accepted ones and the token sampled after them), finish requests that hit a
        stop, and say what changed for each request."""
        outputs = []
        ready_groups: list[BeamGroup] = []
        for req, n in output.scheduled:
            req.num_computed_tokens += n
            drafts, req.spec_token_ids = req.spec_token_ids, []
            tokens = sampled.get(req)
            new_prompt_logprobs = prompt_logprobs.get(req)
            if tokens and req.beam is not None and req.beam.offer(req, tokens[0].beam_candidates):
                ready_groups.append(req.beam)
            if not tokens or req.beam is not None:
                if new_prompt_logprobs:  # a prefill chunk, or a beam (which reports only at the end)
                    outputs.append(
                        EngineCoreOutput(
                            req.request_id,
                            [],
                            new_prompt_logprobs=new_prompt_logprobs,
                            num_cached_tokens=req.num_cached_tokens or 0,
                        )
                    )
                continue
            if isinstance(req.matcher, GuardedMatcher) and req.matcher.dead:
                # Its constraint allows no token: end with the text it has, as a constraint that
                # cannot complete does ("length"), and drop the token sampled from no real choice.
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                outputs.append(
                    EngineCoreOutput(
                        req.request_id, [], None, new_prompt_logprobs, "length", None, req.num_cached_tokens or 0
                    )
                )
                continue
            if drafts:
                accepted = next((i for i, (t, d) in enumerate(zip(tokens, drafts)) if t.token_id != d), len(drafts))
                self.spec_stats.observe(len(drafts), min(accepted, len(tokens)))
                # The last token's K/V is computed next step; rejected drafts' slots are rewritten then.
                req.num_computed_tokens -= len(drafts) - (len(tokens) - 1)
            emitted, status, stop_reason = self._append_tokens(req, tokens)
            outputs.append(
                EngineCoreOutput(
                    req.request_id,
                    [t.token_id for t in emitted],
                    None if emitted[0].logprobs is None else [t.logprobs for t in emitted],
                    new_prompt_logprobs,
                    None if status is None else status.value,
                    stop_reason,
                    req.num_cached_tokens or 0,
                )
            )
        for group in ready_groups:
            done = self._advance_beams(group)
            if done is not None:
                outputs.append(done)
        return outputs

    def _append_tokens(
        self, req: Request, tokens: list[SampledToken]
    ) -> tuple[list[SampledToken], RequestStatus | None, int | None]:
        """Append ``tokens`` one by one up to the first that stops ``req`` (then finished here):
        the tokens kept, the finish status and the stop token id that ended it."""
        for i, token in enumerate(tokens):
            req.append_output_token(token.token_id)
            if req.matcher is not None and not req.matcher.accept(token.token_id):
                logger.warning("request %s: sampled token %d breaks its constraint", req.request_id, token.token_id)
            status, stop_reason = self._check_stop(req, token.token_id)
            if status is not None:
                self._finish(req, status)
                return tokens[: i + 1], status, stop_reason
        return tokens, None, None

    def _advance_beams(self, group: BeamGroup) -> EngineCoreOutput | None:
        """Move a beam group on by one token: continue or fork the chosen parents, drop the
        others; when the search is over, end it and report its hypotheses."""
        chosen = group.advance()
        if chosen is None:
            for beam in group.live:
                self._finish(beam, RequestStatus.FINISHED_STOPPED)
            del self.beam_groups[group.request_id]
            beams = group.results()
            cached = group.live[0].num_cached_tokens or 0
            return EngineCoreOutput(group.request_id, [], None, None, beams[0].finish_reason, None, cached, beams)
        parents, group.live, group.scores = group.live, [], {}
        continued: set[Request] = set()
        next_tokens = []
        for parent, token, score in chosen:
            if parent in continued:
                beam = parent.fork(group.fork_id())
                beam.status = parent.status
                self.kv.fork(parent, beam)
                self.requests[beam.request_id] = beam
                queue = self.running if parent.status is RequestStatus.RUNNING else self.waiting
                queue.insert(queue.index(parent) + 1, beam)
            else:
                continued.add(parent)
                beam = parent
            group.add_beam(beam, score)
            next_tokens.append(token)
        for parent in parents:
            if parent not in continued:
                self._finish(parent, RequestStatus.FINISHED_ABORTED)
        for beam, token in zip(group.live, next_tokens):  # after forking: forks copy the parent as it was
            beam.append_output_token(token)
        return None

    def _check_stop(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        if req.matcher is not None and req.matcher.is_terminated():
            return RequestStatus.FINISHED_STOPPED, None  # the constraint is complete
        return None, None

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End unfinished requests by id (aborts, stop strings), wherever they are; return them.
        A beam search's id ends all its beams."""
        found = []
        for rid in request_ids:
            group = self.beam_groups.pop(rid, None)
            if group is not None:
                found.extend(group.live)
            elif rid in self.requests:
                found.append(self.requests[rid])
        for req in found:
            self._finish(req, status)
        return found

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (running, waiting or preempted) and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        del self.requests[req.request_id]
        if self.proposer is not None:
            self.proposer.free(req.request_id)


def _decodes(req: Request, n: int) -> bool:
    """Whether computing ``n`` tokens of ``req`` is a decode (its last token alone), not a prefill chunk."""
    return n == 1 and req.num_computed_tokens + 1 == req.num_tokens


def _idle_beam(req: Request) -> bool:
    """A beam that has offered its candidates and waits for its siblings' (nothing to compute)."""
    return req.beam is not None and req in req.beam.pending
