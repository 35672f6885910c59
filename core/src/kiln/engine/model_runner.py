"""Runs the model for one scheduled batch.

Per step:
  1. order requests decodes first (one query token), then prefills/chunks;
  2. flatten their tokens into ``input_ids``/``positions`` and describe the batch
     (``BatchLayout``: query offsets, sequence lengths, block table, slot mapping);
  3. run the model once over all tokens;
  4. return logits only where they are needed: the last token of each request
     that samples, and every prompt position of requests asking prompt_logprobs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kiln.attention.base import AttentionBackend, BatchLayout
from kiln.config import EngineConfig
from kiln.engine.request import Request
from kiln.engine.scheduler import SchedulerOutput
from kiln.models.llama import StepContext
from kiln.platforms.base import Platform

logger = logging.getLogger("kiln.runner")


@dataclass(slots=True)
class StepResult:
    sampling_reqs: list[Request]  # requests that sample this step, in logits row order
    logits: torch.Tensor  # (len(sampling_reqs), vocab) float32
    prompt_logits: dict[Request, tuple[int, torch.Tensor]]  # req -> (first position, logits rows)
    forward_time: float


class ModelRunner:
    def __init__(self, config: EngineConfig, platform: Platform, model: torch.nn.Module, backend: AttentionBackend):
        self.config = config
        self.platform = platform
        self.device = platform.device()
        self.model = model
        self.backend = backend
        self.block_size = config.block_size
        self.kv_caches: list[torch.Tensor] = []

    def kv_block_bytes(self) -> int:
        shape = self.backend.kv_cache_shape(1, self.block_size)
        per_layer = torch.Size(shape).numel() * torch.finfo(self.backend.dtype).bits // 8
        return per_layer * len(self.model.layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = self.backend.kv_cache_shape(num_blocks, self.block_size)
        self.kv_caches = [self.platform.allocate_kv_cache(shape, self.backend.dtype) for _ in self.model.layers]

    def _layout(self, batch: list[tuple[Request, int]]):
        input_ids: list[int] = []
        positions: list[int] = []
        for req, n in batch:
            start = req.num_computed_tokens
            input_ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
        layout = BatchLayout.build(
            [[b.block_id for b in req.blocks] for req, _ in batch],
            [req.num_computed_tokens for req, _ in batch],
            [n for _, n in batch],
            self.block_size,
            self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return ids, pos, layout

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        # Decodes first: backends batch them separately from prefills.
        batch = sorted(output.scheduled, key=lambda item: item[1] != 1)
        input_ids, positions, layout = self._layout(batch)

        rows: list[int] = []  # flat token indices whose logits we need
        sampling_reqs: list[Request] = []
        prompt_spans: list[tuple[Request, int, int, int]] = []  # req, first pos, row offset, count
        sample_rows: list[int] = []
        offset = 0
        for req, n in batch:
            start = req.num_computed_tokens
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                count = min(start + n, req.num_prompt_tokens - 1) - start
                prompt_spans.append((req, start, len(rows), count))
                rows.extend(range(offset, offset + count))
            if start + n == req.num_tokens:
                sampling_reqs.append(req)
                sample_rows.append(offset + n - 1)
            offset += n
        sample_from = len(rows)
        rows.extend(sample_rows)

        t0 = time.perf_counter()
        ctx = StepContext(self.backend.build_metadata(layout), self.kv_caches)
        hidden = self.model(input_ids, positions, ctx)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)])
        self.platform.synchronize()
        forward_time = time.perf_counter() - t0
        logits = logits.cpu()
        prompt_logits = {req: (first, logits[o : o + c]) for req, first, o, c in prompt_spans}
        return StepResult(sampling_reqs, logits[sample_from:], prompt_logits, forward_time)
