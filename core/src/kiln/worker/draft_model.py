"""A draft model proposing drafts: its greedy continuation of each sequence.

It is a second ``ModelRunner`` (eager, on the first rank) whose KV cache has the target's
number of blocks and is addressed through the same block tables: the draft's K/V for a
position sits in the same slot of its own cache tensors, so the scheduler's one block
manager serves both models. Before each step's forward pass it fills the draft positions
the scheduler reserved (``kiln.spec_decode.draft_slots``): it catches up on the tokens each
sequence added since it last looked (all of them for a new or preempted sequence, whose
blocks are new or were computed without it), in passes of at most the step's token budget,
then runs one single-token pass per further draft. Greedy drafts are single tokens, so the
target's verification stays exact.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kiln.engine.request import Request
from kiln.engine.scheduler import SchedulerOutput
from kiln.worker.model_runner import ModelRunner, StepBatch


class DraftModel:
    def __init__(self, runner: ModelRunner, max_tokens_per_pass: int) -> None:
        self.runner = runner
        self.max_tokens_per_pass = max_tokens_per_pass
        self.seen: dict[str, tuple[int, int]] = {}  # request id -> (its preemptions, tokens the draft holds)

    @torch.inference_mode()
    def fill(self, scheduled: SchedulerOutput) -> None:
        """Replace each scheduled request's reserved draft positions with the draft's tokens."""
        reqs = [req for req, _ in scheduled.scheduled if req.spec_token_ids]
        if not reqs:
            return
        first = self._catch_up(reqs)
        drafts = [[first[req]] for req in reqs]
        for i in range(1, max(len(req.spec_token_ids) for req in reqs)):
            more = [j for j, req in enumerate(reqs) if len(req.spec_token_ids) > i]
            step = StepBatch([], [], [], [], [])
            for j in more:
                step.add([drafts[j][-1]], reqs[j].num_tokens + i - 1, [b.block_id for b in reqs[j].blocks])
            for j, token in zip(more, self._greedy(step)):
                drafts[j].append(token)
        for req, tokens in zip(reqs, drafts):
            req.spec_token_ids = tokens
            self.seen[req.request_id] = (req.num_preemptions, req.num_tokens)

    def _catch_up(self, reqs: list[Request]) -> dict[Request, int]:
        """Run the draft over each request's unseen tokens, at most ``max_tokens_per_pass`` a pass;
        its greedy token after each request's last one."""
        start = {req: self._held(req) for req in reqs}
        first: dict[Request, int] = {}
        while len(first) < len(reqs):
            rows, room = [], self.max_tokens_per_pass
            for req in reqs:
                n = min(req.num_tokens - start[req], room)
                if req in first or n <= 0:
                    continue
                rows.append((req, n))
                room -= n
            rows.sort(key=lambda row: row[1] != 1)  # one-token rows first, as the backends batch decodes
            step = StepBatch([], [], [], [], [])
            for req, n in rows:
                step.add(req.all_token_ids[start[req] : start[req] + n], start[req], [b.block_id for b in req.blocks])
            for (req, n), token in zip(rows, self._greedy(step)):
                start[req] += n
                if start[req] == req.num_tokens:
                    first[req] = token
        return first

    def _held(self, req: Request) -> int:
        """Tokens whose K/V the draft's cache holds for ``req`` (0 after a preemption), short of its
        last one: the draft needs that token's logits."""
        preemptions, held = self.seen.get(req.request_id, (req.num_preemptions, 0))
        return min(held, req.num_tokens - 1) if preemptions == req.num_preemptions else 0

    def _greedy(self, step: StepBatch) -> list[int]:
        """The draft's most likely next token after each row of ``step``."""
        hidden = self.runner.run_batch(step)
        last = torch.tensor(step.query_lens, device=hidden.device).cumsum(0) - 1
        return self.runner.model.compute_logits(hidden[last]).argmax(-1).tolist()

    def free(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.seen.pop(rid, None)
