"""Turns a batch of logits into tokens.

Pipeline, per step (rows are requests that sample this step):

  1. raw log-probs (for ``logprobs`` / ``best_of`` ranking), before any processing
  2. the guided-decoding bitmask, when given (rows whose constraint is active)
  3. logit_bias, allowed_token_ids, bad_words, min_tokens (ban EOS / stop ids)
  4. repetition (prompt + output), presence and frequency (output) penalties
  5. greedy rows: argmax, for the whole batch at once
  6. other rows: temperature, top_k, top_p, min_p over those rows at once, then one
     exponential race ``argmax(p / q)``, q ~ Exp(1), drawn from the request's own
     generator when it has a seed: the same seed gives the same tokens whatever
     else is batched.
  7. beam-search rows sample nothing: they offer their most likely next tokens, by
     the raw log-probabilities of step 1 (``kiln.engine.beam_search``).

Steps 3 and 4 loop over the rows that use those parameters (most rows use none).
Everything runs where the logits are (the accelerator): only the chosen token ids
and requested log-probs travel to the host, not a vocabulary-wide row per request.
The sampler reads its inputs as data (logits, the requests' parameters and tokens,
the bitmask), so it can be tested on synthetic logits alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kiln.engine.beam_search import BeamCandidates
from kiln.engine.request import Request, TopLogprobs
from kiln.interfaces.guided import allocate_bitmask, apply_token_bitmask
from kiln.interfaces.model import argmax as reference_argmax

NUCLEUS_CANDIDATES = 1024  # the most likely tokens of a row a top-p nucleus is looked for among first

# Sets the logits of the given rows to -inf where the bitmask disallows a token, in place.
BitmaskKernel = Callable[[torch.Tensor, torch.Tensor, list[int]], None]


@dataclass(slots=True)
class GrammarBitmask:
    """Guided decoding's allowed tokens: int32 words, one bit per token (xgrammar's layout),
    one row per sampling request; only ``rows`` are applied."""

    bitmask: torch.Tensor
    rows: list[int]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TopLogprobs | None]
    beam_candidates: dict[int, BeamCandidates]  # row -> candidates, for beam-search rows


class Sampler:
    """Samples one token per row; ``bitmask_kernel`` applies guided decoding's bitmask
    (the guided backend's own kernel where it has one), ``argmax`` picks the greedy rows'
    tokens (the platform's ``argmax`` op, ``kiln.interfaces.model``)."""

    def __init__(
        self,
        seed: int = 0,
        bitmask_kernel: BitmaskKernel = apply_token_bitmask,
        argmax: Callable[[torch.Tensor], torch.Tensor] = reference_argmax,
    ) -> None:
        self.seed = seed
        self.bitmask_kernel = bitmask_kernel
        self.argmax = argmax
        self.generators: dict[torch.device, torch.Generator] = {}
        self.seeded: dict[str, torch.Generator] = {}  # request id -> its own generator

    def free(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests' generators."""
        for rid in request_ids:
            self.seeded.pop(rid, None)

    def _generator(self, device: torch.device) -> torch.Generator:
        """The engine-wide generator (for unseeded requests) on ``device``, seeded once."""
        if device not in self.generators:
            self.generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self.generators[device]

    def _request_generator(self, req: Request) -> torch.Generator | None:
        """A seeded request's generator, on the host: its draws do not depend on the device."""
        if req.seed is None:
            return None
        if req.request_id not in self.seeded:
            self.seeded[req.request_id] = torch.Generator().manual_seed(req.seed)
        return self.seeded[req.request_id]

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, reqs: Sequence[Request], bitmask: GrammarBitmask | None = None
    ) -> SamplerOutput:
        """Tokens for ``logits`` (one float32 row per request in ``reqs``, modified in place)."""
        params = [r.sampling_params for r in reqs]
        beam_rows = [i for i, r in enumerate(reqs) if r.beam is not None]
        candidates = _beam_candidates(logits, reqs, beam_rows) if beam_rows else {}
        want_lp = [i for i, p in enumerate(params) if (p.logprobs is not None or p.best_of > 1) and i not in candidates]
        raw = logits[want_lp].log_softmax(-1) if want_lp else None

        if bitmask is not None:
            self.bitmask_kernel(logits, bitmask.bitmask.to(logits.device, non_blocking=True), bitmask.rows)
        _apply_token_rules(logits, reqs)
        _apply_penalties(logits, reqs)

        tokens = self.argmax(logits)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy and i not in candidates]
        if sampled_rows:
            idx = torch.tensor(sampled_rows, device=logits.device)
            tokens[idx] = self._sample(logits[idx], [reqs[i] for i in sampled_rows])
        token_list = tokens.tolist()

        out_lp: list[TopLogprobs | None] = [None] * len(reqs)
        if raw is not None:
            for row, i in enumerate(want_lp):
                out_lp[i] = top_logprobs(raw[row], token_list[i], params[i].logprobs or 0)
        return SamplerOutput(token_list, out_lp, candidates)

    def _sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in reqs]
        device = logits.device
        logits = logits / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        cut = [(row, p.top_k) for row, p in enumerate(params) if 0 < p.top_k < logits.shape[1]]
        if cut:  # each row's k-th largest logit from a top-k of the largest k (a full sort took ~40x as long)
            rows = torch.tensor([row for row, _ in cut], device=device)
            k = torch.tensor([k for _, k in cut], device=device)
            kth = torch.full((logits.shape[0], 1), float("-inf"), device=device)  # -inf: a row left whole
            kth[rows] = logits[rows].topk(max(top for _, top in cut), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
            logits.masked_fill_(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        _keep_nucleus(probs, [p.top_p for p in params])
        min_p = [p.min_p for p in params]
        if any(min_p):
            floor = probs.max(-1, keepdim=True).values * torch.tensor(min_p, device=device).unsqueeze(1)
            probs.masked_fill_(probs < floor, 0.0)
        q = torch.empty_like(probs).exponential_(generator=self._generator(device))
        for row, req in enumerate(reqs):
            generator = self._request_generator(req)
            if generator is not None:
                q[row] = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=generator)
        return (probs / q).argmax(-1)


def _keep_nucleus(probs: torch.Tensor, top_p: list[float]) -> None:
    """Zero each row's tokens outside its nucleus: in descending order, a token is dropped when the
    mass strictly before it already reaches the row's ``top_p`` (rows of 1 stay whole). The nucleus
    is looked for among a row's ``NUCLEUS_CANDIDATES`` most likely tokens, and a row sorted whole
    only where those do not reach its ``top_p`` (a sort per row was ~5 ms over 49k tokens)."""
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return
    index = torch.tensor(rows, device=probs.device)
    part = probs[index]
    limit = torch.tensor([top_p[i] for i in rows], device=probs.device).unsqueeze(1)

    def nucleus(values: torch.Tensor, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Descending ``values`` with those past the nucleus zeroed, and which rows' mass falls short."""
        mass = values.cumsum(-1)
        return values.masked_fill(mass - values >= limit, 0.0), mass[:, -1] < limit[:, 0]

    values, order = part.topk(min(part.shape[1], NUCLEUS_CANDIDATES), dim=-1)
    kept, short = nucleus(values, limit)
    out = torch.zeros_like(part).scatter_(1, order, kept)
    if kept.shape[1] < part.shape[1] and bool(short.any()):  # a nucleus past the candidates
        whole = short.nonzero()[:, 0]
        values, order = part[whole].sort(dim=-1, descending=True)
        kept, _ = nucleus(values, limit[whole])
        out[whole] = torch.zeros_like(kept).scatter_(1, order, kept)
    probs[index] = out


def _beam_candidates(logits: torch.Tensor, reqs: Sequence[Request], rows: list[int]) -> dict[int, BeamCandidates]:
    """Each beam's ``num_candidates`` most likely next tokens by log-probability; before
    ``min_tokens``, its stop tokens are impossible (transformers' min-new-tokens rule)."""
    logprobs = logits[rows].log_softmax(-1)
    for row, i in enumerate(rows):
        req = reqs[i]
        if req.num_output_tokens < req.sampling_params.min_tokens and req.beam.stop_ids:
            logprobs[row, list(req.beam.stop_ids)] = float("-inf")
    k = max(reqs[i].beam.num_candidates for i in rows)
    values, ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    out = {}
    for row, i in enumerate(rows):
        n = reqs[i].beam.num_candidates
        out[i] = BeamCandidates(ids[row][:n], values[row][:n])
    return out


def _apply_token_rules(logits: torch.Tensor, reqs: Sequence[Request]) -> None:
    neg_inf = float("-inf")
    for row, req in enumerate(reqs):
        p = req.sampling_params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[row].index_add_(0, ids, bias)
        if p.allowed_token_ids is not None:
            keep = logits[row, p.allowed_token_ids].clone()
            logits[row].fill_(neg_inf)
            logits[row, p.allowed_token_ids] = keep
        for word in p._bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or req.output_token_ids[-len(prefix) :] == prefix:
                logits[row, word[-1]] = neg_inf
        if req.num_output_tokens < p.min_tokens:
            banned = list(req.stop_ids)
            if banned:
                logits[row, banned] = neg_inf


def _apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> None:
    rows = [
        i
        for i, r in enumerate(reqs)
        if r.sampling_params.repetition_penalty != 1.0
        or r.sampling_params.presence_penalty
        or r.sampling_params.frequency_penalty
    ]
    if not rows:
        return
    vocab = logits.shape[1]
    for i in rows:
        p, req = reqs[i].sampling_params, reqs[i]
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
            seen[torch.tensor(req.all_token_ids, device=row.device)] = True
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, scaled, row))
        if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            output_ids = torch.tensor(req.output_token_ids, device=row.device)
            counts = torch.bincount(output_ids, minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def top_logprobs(logprobs: torch.Tensor, token_id: int, k: int) -> TopLogprobs:
    """The chosen token's logprob and 1-based rank, and the k most likely tokens."""
    chosen = logprobs[token_id]
    rank = int((logprobs > chosen).sum()) + 1
    if k:
        values, ids = logprobs.topk(k)
        top_ids, top_lps = ids.tolist(), values.tolist()
    else:
        top_ids, top_lps = [], []
    return TopLogprobs(token_id, float(chosen), rank, top_ids, top_lps)


def prompt_top_logprobs(logits: torch.Tensor, next_tokens: list[int], k: int) -> list[TopLogprobs]:
    """Prompt logprobs: row ``i`` of ``logits`` predicts ``next_tokens[i]``."""
    logprobs = logits.log_softmax(-1)
    return [top_logprobs(logprobs[row], token, k) for row, token in enumerate(next_tokens)]


def grammar_bitmask(reqs: Sequence[Request], vocab_size: int) -> GrammarBitmask | None:
    """The bitmask of the requests whose guided-decoding constraint is still active, or None."""
    rows = [i for i, r in enumerate(reqs) if r.matcher is not None and not r.matcher.is_terminated()]
    if not rows:
        return None
    bitmask = allocate_bitmask(len(reqs), vocab_size)
    for i in rows:
        reqs[i].matcher.fill_bitmask(bitmask, i)
    return GrammarBitmask(bitmask, rows)
