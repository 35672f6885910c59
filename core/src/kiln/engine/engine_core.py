"""``EngineCore``: one step is schedule → execute → sample (verifying drafts) → update (pooling requests
end with their pooled output instead: ``kiln.engine.pooling``).

It takes ``Request`` objects from the input processor and returns token-level
``EngineCoreOutput``s (ids, logprob ids, finish reasons) for the output processor;
it never sees text. Requests finish only in the scheduler (see
``kiln.engine.scheduler``).

Under multi-step scheduling with ``--multi-step-stream-outputs false`` a request's outputs are
held while the scheduler's window lasts and reported as one when it closes (or when the request
finishes), so detokenization and streaming run once a window rather than once a step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kiln.engine.pooling import finish_pooled
from kiln.engine.request import EngineCoreOutput, Request, RequestStatus

if TYPE_CHECKING:
    from kiln.engine.scheduler import Scheduler
    from kiln.worker.executor import Executor


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.num_prompt_tokens = 0  # prompt tokens computed (recomputation included), for stats
        self.num_generation_tokens = 0
        config = scheduler.config
        self.hold_outputs = config.num_scheduler_steps > 1 and not config.multi_step_stream_outputs
        self.held: dict[str, EngineCoreOutput] = {}  # by request id, while a multi-step window lasts

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step: aborts, and stop strings the output processor found."""
        request_ids = list(request_ids)
        for rid in request_ids:
            self.held.pop(rid, None)
        finished = self.scheduler.finish_requests(request_ids, status)
        self.executor.free(req.request_id for req in finished)

    def step(self) -> list[EngineCoreOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return self._hold([]) if self.held else []  # a window that closed with nothing to run
        t0 = time.perf_counter()
        self.executor.propose(scheduled)
        output = self.executor.execute_model(scheduled)
        sampled = self.executor.sample(output)
        self.num_prompt_tokens += scheduled.num_prompt_tokens
        self.num_generation_tokens += sum(map(len, sampled.values()))
        outputs = self.scheduler.update_from_output(scheduled, sampled, output.prompt_logprobs)
        outputs += finish_pooled(self.scheduler, output.pooled)
        step_time = time.perf_counter() - t0
        for metrics in {id(req.metrics): req.metrics for req, _ in scheduled.scheduled}.values():  # beams share one
            metrics.model_forward_time += output.forward_time
            metrics.model_execute_time += step_time
        self.executor.free(out.request_id for out in outputs if out.finish_reason is not None)
        return self._hold(outputs) if self.hold_outputs else outputs

    def _hold(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Keep unfinished requests' outputs while the scheduler's window lasts; report each
        request's held outputs as one when it finishes or the window closes."""
        for out in outputs:
            held = self.held.get(out.request_id)
            self.held[out.request_id] = out if held is None else held.then(out)
        if not self.scheduler.window_left:
            released, self.held = list(self.held.values()), {}
            return released
        done = [rid for rid, out in self.held.items() if out.finish_reason is not None]
        return [self.held.pop(rid) for rid in done]
