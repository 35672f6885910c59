"""EAGLE drafts: an EAGLE-1 or EAGLE-3 head (``kiln.models.eagle``) proposing from the target's
hidden states.

The head runs as a draft model does (``kiln.worker.draft_model``: a second ``ModelRunner`` on the
first rank, its own KV cache addressed through the target's block tables) but its row at
position i reads the token at i + 1 and the target's hidden state at i. The target's runner
returns the hidden states of every token it computes (``ModelRunner.keep_features``; for
EAGLE-3 the inputs of three layers, which the head's ``combine`` projects once), which
``observe`` keeps per request, later rows replacing earlier ones from their first position on
(the rows of rejected drafts are recomputed by the next step). Before a step, for a request whose
tokens are x_0 .. x_{N-1}, the head catches up on positions ``held`` .. N-2 (hidden states the
target has computed, each with its next token), in passes of at most the step's token budget;
its output at N-2 gives the first draft, and each further draft is a row at the next position
reading the previous draft and the head's own output before it. Positions the target never
computed (prefix-cache hits) are not caught up on: the head's cache there may be stale, which
costs accepted drafts, never exactness (verification is unchanged). A request decoding without
drafts (drafts off under load, or past the speculative length) catches up every
``CATCH_UP_ROWS`` tokens, so the states kept for it stay few.
"""

from __future__ import annotations

import logging

import torch

from kiln.engine.request import Request
from kiln.engine.scheduler import SchedulerOutput
from kiln.models.eagle import aux_layer_ids
from kiln.models.llama import LlamaForCausalLM
from kiln.worker.draft_model import DraftModel
from kiln.worker.model_runner import ModelRunner, StepBatch

logger = logging.getLogger("kiln.spec_decode")
EAGLE_ARCHS = {"eagle": "EagleLlamaForCausalLM", "eagle3": "Eagle3LlamaForCausalLM"}  # method -> Kiln's head class
# What heads are published or run as: none of them runs alone (vLLM's EAGLEModel folders: read_eagle_config).
HEAD_ARCHS = {*EAGLE_ARCHS.values(), "LlamaForCausalLMEagle3"}
CATCH_UP_ROWS = 32


def prepare_head_config(method: str, head_cfg, target_cfg, model_impl: str) -> tuple[int, ...]:
    """Point an EAGLE head's config at Kiln's class for ``method`` (published EAGLE-1 heads say
    ``LlamaForCausalLM``) and check that it reads what the target has; returns the target layers
    whose inputs it reads (EAGLE-3), else ()."""
    if method == "eagle" and set(head_cfg.architectures or []) & {EAGLE_ARCHS["eagle3"], "LlamaForCausalLMEagle3"}:
        raise ValueError(f"--speculative-config: {head_cfg.architectures[0]} is an EAGLE-3 head; use method eagle3")
    head_cfg.architectures = [EAGLE_ARCHS[method]]
    reads = getattr(head_cfg, "target_hidden_size", None) or head_cfg.hidden_size
    if target_cfg.hidden_size != reads:
        raise ValueError(
            f"--speculative-config: the EAGLE head reads hidden states of size {reads}, the target's "
            f"are {target_cfg.hidden_size}; it must be trained for this target"
        )
    if method != "eagle3":
        return ()
    if model_impl == "transformers":
        raise ValueError(
            "--speculative-config: eagle3 reads the target's layers, which --model-impl transformers does not "
            "expose; use --model-impl kiln"
        )
    return aux_layer_ids(head_cfg, target_cfg.num_hidden_layers)


def refuse_head(hf_config, flag: str) -> None:
    """A ``ValueError`` when ``hf_config`` is an EAGLE head's (it drafts for a target only)."""
    archs = set(getattr(hf_config, "architectures", None) or []) & HEAD_ARCHS
    if archs:
        raise head_refusal(archs.pop(), flag)


def head_refusal(arch: str, flag: str) -> ValueError:
    """The error for an EAGLE head (``arch``) given where a model goes."""
    return ValueError(
        f"{flag}: {arch} is an EAGLE head, which only drafts for its target: serve the target with "
        '--speculative-config \'{"method": "eagle3", "model": HEAD, "num_speculative_tokens": 3}\' '
        '("eagle" for an EAGLE-1 head)'
    )


class EagleDraft(DraftModel):
    def __init__(self, runner: ModelRunner, max_tokens_per_pass: int, aux_layers: tuple[int, ...] = ()) -> None:
        super().__init__(runner, max_tokens_per_pass)
        self.aux_layers = aux_layers  # the target layers whose inputs the head reads (EAGLE-3)
        # request id -> the head's inputs not yet read, as (first position, rows) chunks in order
        self.features: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def attach(self, target: torch.nn.Module) -> None:
        """Lend the head the target's parts it shares, and have the target return what it reads."""
        if self.aux_layers:
            if type(target).forward is not LlamaForCausalLM.forward:
                raise ValueError(
                    f"--speculative-config: eagle3 reads the inputs of the target's layers, which "
                    f"{type(target).__name__} does not return"
                )
            target.aux_layers = self.aux_layers
        self.runner.model.attach(target)

    @torch.inference_mode()
    def observe(self, features: torch.Tensor, spans: dict[Request, tuple[int, int, int]]) -> None:
        """Keep what the head reads of a step's tokens (``features``, projected once by the
        head's ``combine``), (first position, first row, rows) per request; they replace any
        kept from their first position on (rejected drafts' rows, a recomputation)."""
        combined = self.runner.model.combine(features)
        for req, (first, offset, n) in spans.items():
            rows = combined[offset : offset + n].clone()  # a view would pin the step's tensor (or graph buffer)
            chunks = self.features.setdefault(req.request_id, [])
            if chunks and chunks[-1][0] + len(chunks[-1][1]) < first:  # positions never seen in between
                chunks.clear()
            while chunks and chunks[-1][0] >= first:
                chunks.pop()
            if chunks and chunks[-1][0] + len(chunks[-1][1]) > first:
                start, old = chunks[-1]
                chunks[-1] = (start, old[: first - start])
            chunks.append((first, rows))

    @torch.inference_mode()
    def fill(self, scheduled: SchedulerOutput) -> None:
        reqs = [req for req, _ in scheduled.scheduled if req.spec_token_ids]
        for req in [r for r in reqs if not self._covered(r)]:  # never seen so far; drafts are only guesses
            logger.warning(
                "EAGLE: no hidden state before request %s's last token; it drafts that token", req.request_id
            )
            req.spec_token_ids = [req.all_token_ids[-1]] * len(req.spec_token_ids)
            reqs.remove(req)
        lagging = [
            req for req, _ in scheduled.scheduled
            if not req.spec_token_ids and self._covered(req) and self._kept(req) >= CATCH_UP_ROWS
        ]  # fmt: skip
        if not reqs and not lagging:
            return
        tokens, hidden = self._catch_up(reqs + lagging)
        for req in lagging:
            self.seen[req.request_id] = (req.num_preemptions, req.num_tokens - 1)
        if not reqs:
            return
        drafts = [[token] for token in tokens[: len(reqs)]]
        for i in range(1, max(len(req.spec_token_ids) for req in reqs)):
            more = [j for j, req in enumerate(reqs) if len(req.spec_token_ids) > i]
            step = StepBatch([], [], [], [], [])
            for j in more:
                step.add([drafts[j][-1]], reqs[j].num_tokens + i - 2, [b.block_id for b in reqs[j].blocks])
            new_tokens, new_hidden = self._propose(step, hidden[more])
            for row, (j, token) in enumerate(zip(more, new_tokens)):
                drafts[j].append(token)
                hidden[j] = new_hidden[row]
        for req, proposed in zip(reqs, drafts):
            req.spec_token_ids = proposed
            self.seen[req.request_id] = (req.num_preemptions, req.num_tokens - 1)

    def _kept(self, req: Request) -> int:
        return sum(len(rows) for _, rows in self.features.get(req.request_id, ()))

    def _covered(self, req: Request) -> bool:
        """Whether the kept hidden states reach position N - 2, the first draft's input."""
        chunks = self.features.get(req.request_id)
        return bool(chunks) and chunks[0][0] <= req.num_tokens - 2 < chunks[-1][0] + len(chunks[-1][1])

    def _catch_up(self, reqs: list[Request]) -> tuple[list[int], torch.Tensor]:
        """Run the head over each request's unseen positions up to N - 2; its greedy token and
        output hidden state at N - 2 of each."""
        spans = {}  # req -> (next position to run, hidden-state rows from it to N - 2)
        for req in reqs:
            chunks = self.features.pop(req.request_id)
            first = chunks[0][0]
            rows = chunks[0][1] if len(chunks) == 1 else torch.cat([c for _, c in chunks])  # contiguous: see observe
            end = req.num_tokens - 1  # positions start .. end - 1
            start = min(max(self._held(req), first), end - 1)
            spans[req] = (start, rows[start - first : end - first])
            self.features[req.request_id] = [
                (end, rows[end - first :].clone())
            ]  # this step's drafts' (a copy: not all)
        tokens: dict[Request, int] = {}
        last: dict[Request, torch.Tensor] = {}
        while len(tokens) < len(reqs):
            batch, room = [], self.max_tokens_per_pass
            for req in reqs:
                start, rows = spans[req]
                n = min(len(rows), room)
                if req not in tokens and n > 0:
                    batch.append((req, n))
                    room -= n
            batch.sort(key=lambda row: row[1] != 1)  # one-token rows first, as the backends batch decodes
            step = StepBatch([], [], [], [], [])
            for req, n in batch:
                start, _ = spans[req]
                step.add(req.all_token_ids[start + 1 : start + 1 + n], start, [b.block_id for b in req.blocks])
            features = torch.cat([spans[req][1][:n] for req, n in batch])
            new_tokens, new_hidden = self._propose(step, features, last_only=True)
            for row, ((req, n), token) in enumerate(zip(batch, new_tokens)):
                start, rows = spans[req]
                spans[req] = (start + n, rows[n:])
                if not len(rows) - n:
                    tokens[req], last[req] = token, new_hidden[row]
        return [tokens[req] for req in reqs], torch.stack([last[req] for req in reqs])

    def _propose(self, step: StepBatch, features: torch.Tensor, last_only: bool = False):
        """The head over ``step`` reading ``features``: the greedy token after each row (each
        request's last row with ``last_only``) and the head's output there."""
        self.runner.model.features = features
        hidden = self.runner.run_batch(step)
        if last_only:
            hidden = hidden[torch.tensor(step.query_lens, device=hidden.device).cumsum(0) - 1]
        return self.runner.model.compute_logits(hidden).argmax(-1).tolist(), hidden

    def free(self, request_ids) -> None:
        request_ids = list(request_ids)
        super().free(request_ids)
        for rid in request_ids:
            self.features.pop(rid, None)
