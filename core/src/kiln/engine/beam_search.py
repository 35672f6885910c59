"""Beam search: which beams live on after each step, and which hypotheses are finished.

A beam-search request starts as one sequence (its prompt). Each step every live
beam offers its ``num_candidates`` most likely next tokens (log-probabilities from
the sampler); ``BeamGroup.advance`` ranks all of them by cumulative log-probability
and returns the next live beams as ``(parent, token, score)``. The scheduler then
continues the first child of each parent in place and forks the others, sharing
the parent's KV blocks (``KVCacheManager.fork``).

The rules are Hugging Face transformers' ``generate(num_beams=k, do_sample=False)``
for one prompt, so both give the same sequences and scores:

* candidates: the best ``max(2, 1 + len(stop tokens)) * k`` continuations over all
  beams; those ending in a stop token, or reaching ``max_tokens``, are done;
* the next live beams are the best ``k`` candidates that are not done;
* a done candidate among the best ``k`` becomes a hypothesis scored
  ``cumulative_logprob / generated_len ** length_penalty``; the best ``k`` are kept;
* the search ends when every candidate is done, when ``early_stopping=True`` and
  ``k`` hypotheses exist, or when no live beam can beat the worst kept hypothesis
  (with ``early_stopping=False`` judged at the current length; with ``"never"`` and a
  positive length penalty, at ``max_tokens``).

No tensors here: the scheduler imports this module.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kiln.sampling_params import SamplingParams


class Beam(Protocol):
    """What a beam group reads of a beam (``kiln.engine.request.Request``)."""

    output_token_ids: list[int]

    @property
    def num_output_tokens(self) -> int: ...


@dataclass(slots=True)
class BeamHypothesis:
    """A finished beam: its generated tokens (the stop token included), their summed
    log-probability, the length-penalised score it is ranked by, and why it ended."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (a stop token) | "length"


@dataclass(slots=True)
class BeamCandidates:
    """A beam's most likely next tokens, best first, with their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass(eq=False, slots=True)
class BeamGroup:
    """One beam-search request: its live beams (the core's requests) and its hypotheses."""

    request_id: str
    params: SamplingParams
    stop_ids: frozenset[int]  # tokens that end a beam (EOS unless ignore_eos, and stop_token_ids)
    max_tokens: int  # generated tokens at most (the request's, or what max_model_len leaves)
    live: list[Beam] = field(default_factory=list)
    scores: dict[Beam, float] = field(default_factory=dict)  # cumulative log-probability per live beam
    pending: dict[Beam, BeamCandidates] = field(default_factory=dict)  # this step's, until all beams have some
    hypotheses: list[BeamHypothesis] = field(default_factory=list)  # best first, at most ``width``
    improvable: bool = True  # can a live beam still beat the worst hypothesis?
    _forks: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def width(self) -> int:
        return self.params.best_of

    @property
    def num_candidates(self) -> int:
        """Continuations each beam offers per step (transformers' ``beams_to_keep``)."""
        return max(2, 1 + len(self.stop_ids)) * self.width

    def fork_id(self) -> str:
        """A fresh core id for a forked beam (never shown to clients)."""
        return f"{self.request_id}#beam{next(self._forks)}"

    def add_beam(self, req: Beam, score: float) -> None:
        self.live.append(req)
        self.scores[req] = score

    def offer(self, req: Beam, candidates: BeamCandidates) -> bool:
        """Record a beam's candidates for this step; True once every live beam has offered."""
        self.pending[req] = candidates
        return all(beam in self.pending for beam in self.live)

    def advance(self) -> list[tuple[Beam, int, float]] | None:
        """Rank this step's candidates: the next live beams as (parent, token, cumulative
        logprob), best first, or None when the search is over."""
        generated = self.live[0].num_output_tokens + 1  # each candidate's length once taken
        ranked = sorted(
            (
                (self.scores[beam] + lp, order, beam, token)
                for order, beam in enumerate(self.live)
                for token, lp in zip(self.pending[beam].token_ids, self.pending[beam].logprobs)
            ),
            key=lambda c: (-c[0], c[1]),
        )[: self.num_candidates]
        self.pending.clear()
        # Whether hypotheses may be added is decided by the state before this step, as transformers does.
        closed = not self.improvable or (len(self.hypotheses) == self.width and self.params.early_stopping is True)
        next_beams = []
        for rank, (score, _, beam, token) in enumerate(ranked):
            stopped = token in self.stop_ids
            if stopped or generated >= self.max_tokens:
                if rank < self.width and not closed:
                    reason = "stop" if stopped else "length"
                    self._add_hypothesis(beam.output_token_ids + [token], score, generated, reason)
            elif len(next_beams) < self.width:
                next_beams.append((beam, token, score))
        if not next_beams:
            return None
        self._update_improvable(next_beams[0][2], generated)
        full = len(self.hypotheses) == self.width
        if not self.improvable or (full and self.params.early_stopping is True):
            return None
        return next_beams

    def _add_hypothesis(self, tokens: list[int], logprob: float, length: int, reason: str) -> None:
        score = logprob / length**self.params.length_penalty
        if len(self.hypotheses) == self.width and score <= self.hypotheses[-1].score:
            return
        self.hypotheses.append(BeamHypothesis(tokens, logprob, score, reason))
        self.hypotheses.sort(key=lambda h: -h.score)
        del self.hypotheses[self.width :]

    def _update_improvable(self, best_live: float, generated: int) -> None:
        if len(self.hypotheses) < self.width:
            return
        penalty = self.params.length_penalty
        length = self.max_tokens if self.params.early_stopping == "never" and penalty > 0 else generated
        self.improvable = self.improvable and best_live / length**penalty > self.hypotheses[-1].score

    def results(self) -> list[BeamHypothesis]:
        """The best ``width`` hypotheses, best first; live beams stand in (as "length") if fewer
        have finished, which only a vocabulary smaller than the candidate count allows."""
        out = list(self.hypotheses)
        for beam in sorted(self.live, key=lambda b: -self.scores[b])[: self.width - len(out)]:
            score = self.scores[beam]
            length = max(beam.num_output_tokens, 1)
            out.append(
                BeamHypothesis(list(beam.output_token_ids), score, score / length**self.params.length_penalty, "length")
            )
        return out
