"""Sampling a step whose requests may carry draft tokens (speculative decoding), exactly.

Position ``j`` of a request with drafts is sampled as a decode step would sample it had
the request already appended its first ``j`` drafts (``DraftView``): the same bitmask,
logit bias, bad words, ``min_tokens`` and penalties, then the same greedy argmax or
temperature / top-k / top-p / min-p draw. Draft ``j`` is accepted when the token sampled
there equals it; the first position whose token differs, or the one after the last
draft, ends the request's tokens for the step with the token sampled there.

Why that is exact: a proposer that offers one token (not a distribution) is rejection
sampling's special case of a point-mass draft distribution. Accepting draft ``d`` with
probability ``p(d)`` and otherwise sampling ``p`` without ``d`` is the same as sampling
``p`` and comparing, so every emitted token is drawn from the target distribution given
the tokens before it. Greedy requests emit what decoding one token at a time emits; a
request with its own seed draws once per emitted token from its generator, in order, so
it gets the same tokens as without speculation too. Positions are sampled in rounds
(all requests' position 0, then the requests still accepting, ...), so a round costs one
batched sampler call and positions after a rejection are never drawn.

A guided request's matcher accepts each accepted draft so that the next position's
bitmask follows it, and is rolled back afterwards: the scheduler appends the tokens
(and advances the matcher) as for any step.
"""

from __future__ import annotations

import torch

from kiln.engine.guided_manager import GuardedMatcher
from kiln.engine.request import Request
from kiln.engine.scheduler import SampledToken
from kiln.worker.sampler import Sampler, grammar_bitmask


class DraftView:
    """``req`` as the sampler reads it, with ``accepted`` drafts appended to its tokens."""

    __slots__ = ("req", "output_token_ids", "all_token_ids")

    def __init__(self, req: Request, accepted: list[int]) -> None:
        self.req = req
        self.output_token_ids = req.output_token_ids + accepted
        self.all_token_ids = req.all_token_ids + accepted

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def __getattr__(self, name: str) -> object:
        return getattr(self.req, name)


def sample_with_drafts(
    sampler: Sampler, logits: torch.Tensor, reqs: list[Request]
) -> dict[Request, list[SampledToken]]:
    """The tokens each request emits this step: its accepted drafts, then one sampled token.

    ``logits`` has ``req.num_sampled_rows`` rows per request, in order (one without
    drafts); it may be modified in place."""
    starts, num_rows = [], 0
    for req in reqs:
        starts.append(num_rows)
        num_rows += req.num_sampled_rows
    out: dict[Request, list[SampledToken]] = {req: [] for req in reqs}
    advanced = [0] * len(reqs)  # drafts each matcher accepted here, rolled back at the end
    alive, pos = list(range(len(reqs))), 0
    try:
        while alive:
            views = [reqs[i] if pos == 0 else DraftView(reqs[i], reqs[i].spec_token_ids[:pos]) for i in alive]
            rows = logits if num_rows == len(reqs) else logits[[starts[i] + pos for i in alive]]
            result = sampler(rows, views, grammar_bitmask(views, logits.shape[-1]))
            still = []
            for k, i in enumerate(alive):
                req, token = reqs[i], result.token_ids[k]
                if pos and isinstance(req.matcher, GuardedMatcher) and req.matcher.dead:
                    # The constraint allows nothing after the accepted drafts: they stand, and the
                    # next step's decode meets the dead end as decoding one token at a time would.
                    req.matcher.revive()
                    continue
                out[req].append(SampledToken(token, result.logprobs[k], result.beam_candidates.get(k)))
                drafts = req.spec_token_ids
                if pos == len(drafts) or token != drafts[pos] or token in req.stop_ids:
                    continue  # rejected, or past the drafts, or a stop: its tokens end here
                if req.matcher is not None:
                    req.matcher.accept(token)
                    advanced[i] += 1
                    if req.matcher.is_terminated():
                        continue
                still.append(i)
            alive, pos = still, pos + 1
    finally:
        for i, count in enumerate(advanced):
            if count:
                reqs[i].matcher.rollback(count)
    return out
