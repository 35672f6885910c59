"""Runs the model for one scheduled batch.

Per step:
  1. order requests decodes first (one query token), then prefills/chunks;
  2. flatten their tokens into ``input_ids``/``positions`` and describe the batch
     (``BatchLayout``: query offsets, sequence lengths, block table, slot mapping);
  3. run the model once over all tokens;
  4. return logits only where they are needed: the last token of each request
     that samples (and each of its draft tokens, under speculative decoding), and
     every prompt position of requests asking prompt_logprobs.

Graph mode (a platform ``GraphRunner``, unless ``--enforce-eager``): a step made only
of decodes, no larger than the largest graph size and no longer than
``--max-seq-len-to-capture``, is padded to the smallest graph size that holds it
(``DecodeGraphInputs``) and run through the graph built for that size.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kiln.config import EngineConfig
from kiln.engine.request import Request
from kiln.engine.scheduler import SchedulerOutput
from kiln.interfaces.attention import AttentionBackend, BatchLayout, DecodeGraphInputs
from kiln.interfaces.model import StepContext
from kiln.interfaces.platform import Platform
from kiln.lora.slots import LoRASlots, SlotLoad
from kiln.models.pooler import load_dense_layers, pool

logger = logging.getLogger("kiln.runner")


@dataclass(slots=True)
class StepResult:
    sampling_reqs: list[Request]  # requests that sample this step, in logits row order
    logits: torch.Tensor  # (rows, vocab) float32 on the device: num_sampled_rows rows per request
    prompt_logits: dict[Request, tuple[int, torch.Tensor]]  # req -> (first position, logits rows)
    forward_time: float
    pooled: dict[Request, torch.Tensor] = field(default_factory=dict)  # pooling requests' outputs, on the host
    # With ``keep_features``: what an EAGLE head reads of every token (``split_features``; a view,
    # valid until the next step) and each request's (first position, first row, rows) in it.
    features: torch.Tensor | None = None
    feature_spans: dict[Request, tuple[int, int, int]] = field(default_factory=dict)


class DecodeStep(torch.nn.Module):
    """The model over the KV cache for one padded decode step, as graph runners capture it:
    tensors in, hidden states out, no host values."""

    def __init__(
        self, model: torch.nn.Module, backend: AttentionBackend, kv_caches: list[torch.Tensor], block_size: int
    ):
        super().__init__()
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size

    def forward(self, input_ids, positions, block_table, seq_lens, slot_mapping) -> torch.Tensor:
        metadata = self.backend.graph_metadata(block_table, seq_lens, slot_mapping, self.block_size)
        return self.model(input_ids, positions, StepContext(metadata, self.kv_caches))


@dataclass(slots=True)
class StepBatch:
    """One step's tokens and where they go in the KV cache, as host lists (decodes first):
    all a tensor-parallel rank needs to run the same forward as rank 0."""

    input_ids: list[int]
    positions: list[int]
    block_rows: list[list[int]]
    context_lens: list[int]
    query_lens: list[int]
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), done before the forward
    token_type_ids: list[int] | None = None  # every token's segment id, when a request has them (cross-encoders)
    lora_slots: list[int] | None = None  # each row's LoRA slot (-1: base), when any request has an adapter
    lora_loads: list[SlotLoad] = field(default_factory=list)  # adapters to copy into slots first (sent whole)

    @classmethod
    def of(cls, batch: list[tuple[Request, int]]) -> StepBatch:
        """The batch's tokens; a request with drafts becomes one decode row per token (its last
        known token, then each draft), so that verifying drafts takes every platform's decode
        path (its kernels and graphs)."""
        step = cls([], [], [], [], [])
        for req, n in batch:
            start, drafts = req.num_computed_tokens, req.spec_token_ids
            tokens = req.all_token_ids[start : start + n - len(drafts)] + drafts
            step.add(tokens, start, [b.block_id for b in req.blocks], one_row_each=bool(drafts))
        if any(req.token_type_ids for req, _ in batch):
            step.token_type_ids = []
            for req, n in batch:
                start = req.num_computed_tokens
                step.token_type_ids.extend((req.token_type_ids or [0] * req.num_tokens)[start : start + n])
        return step

    def add(self, tokens: list[int], start: int, blocks: list[int], one_row_each: bool = False) -> None:
        """Append a sequence's ``tokens`` from position ``start`` over its ``blocks``: as one row
        (a prefill chunk or a decode), or with ``one_row_each`` as a decode row per token, each
        attending to the tokens before it."""
        self.input_ids.extend(tokens)
        self.positions.extend(range(start, start + len(tokens)))
        rows = len(tokens) if one_row_each else 1
        self.block_rows.extend([blocks] * rows)
        self.context_lens.extend(range(start, start + rows))
        self.query_lens.extend([1] * rows if one_row_each else [len(tokens)])


def pick_graph_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest graph size (ascending ``sizes``) that holds ``num_reqs`` rows, or None."""
    return next((s for s in sizes if s >= num_reqs), None)


def _note_unused_graph_flags(config: EngineConfig, platform: Platform, built: bool) -> None:
    """Say in the log when graph flags change nothing: the platform has no graph mode."""
    if built or type(platform).graph_runner is not Platform.graph_runner:
        return  # graphs ran, or the platform has them and the flags chose eager
    given = [
        flag
        for flag, set_ in (
            ("--enforce-eager", config.enforce_eager),
            ("--graph-sizes", config.graph_sizes is not None),
            (
                "--max-seq-len-to-capture",
                config.max_seq_len_to_capture != EngineConfig.model_fields["max_seq_len_to_capture"].default,
            ),
        )
        if set_
    ]
    if given:
        logger.warning(
            "the %s platform has no graph mode and always runs eagerly: %s change nothing",
            platform.name,
            ", ".join(given),
        )


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        model: torch.nn.Module,
        backend: AttentionBackend,
        lora: LoRASlots | None = None,
    ):
        self.config = config
        self.lora = lora  # --enable-lora: the adapter slots beside the model's projections
        self.platform = platform
        self.device = platform.device()
        self.model = model
        self.backend = backend
        self.block_size = config.block_size
        self.kv_caches: list[torch.Tensor] = []
        # Sizes first: with none (e.g. max_num_seqs 1 on Ascend) no graph runner is built at all.
        # Encoders never decode: a one-token prompt step must not take the decode-graph path.
        eager = (
            config.enforce_eager or getattr(model, "is_encoder", False) or not getattr(model, "supports_graphs", True)
        )
        sizes = [] if eager else platform.graph_sizes(config)
        self.graphs = platform.graph_runner(config) if sizes else None
        if self.graphs is not None and not backend.supports_decode_graphs:
            logger.warning("attention backend %s has no decode-graph path; running eagerly", backend.name)
            self.graphs = None
        self.graph_sizes = sizes if self.graphs is not None else []
        _note_unused_graph_flags(config, platform, built=self.graphs is not None)
        self.max_blocks_per_req = -(-config.max_model_len // config.block_size)
        self.graph_steps = 0  # decode steps run as graphs, for logs and tests
        self.keep_features = False  # return what an EAGLE head reads of every computed token
        self.peers = None  # tensor-parallel ranks 1..N-1 (rank 0 only): has send(StepBatch)
        # sentence-transformers projections after pooling (embedding models; a few KB, on the host)
        self.dense = load_dense_layers(config.model) if config.task == "embed" and config.model else []

    def kv_block_bytes(self) -> int:
        shape = self.backend.kv_cache_shape(1, self.block_size)
        per_layer = torch.Size(shape).numel() * torch.finfo(self.backend.cache_dtype).bits // 8
        return per_layer * len(self.model.layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = self.backend.kv_cache_shape(num_blocks, self.block_size)
        self.kv_caches = [self.platform.allocate_kv_cache(shape, self.backend.cache_dtype) for _ in self.model.layers]

    def profile_peak(self) -> int | None:
        """Device memory a full-budget step needs beyond the weights (None: not measurable here,
        or not needed with ``--num-gpu-blocks-override``). Every tensor-parallel rank calls it
        at the same point, since the step's all-reduces need them all."""
        if self.config.num_gpu_blocks_override is not None:
            return None
        return self.platform.peak_memory_of(self._profile_step)

    def _profile_step(self) -> None:
        """The largest step the scheduler forms, a prefill of the whole token budget, with logits
        for ``max_num_seqs`` rows, over a throwaway KV cache just big enough for it."""
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        blocks = -(-n // self.block_size)
        kept = self.kv_caches
        self.allocate_kv_cache(blocks + 1)  # block 0 stays the null block
        batch = StepBatch([0] * n, list(range(n)), [list(range(1, blocks + 1))], [0], [n])
        try:
            with torch.inference_mode():
                hidden, _ = self.split_features(self.run_batch(batch))
                if self.config.task == "generate":  # pooling models compute no logits (drafts: a row each)
                    self.model.compute_logits(hidden[: min(n, self.config.max_decode_rows)])
        finally:
            self.kv_caches = kept

    def build_graphs(self) -> None:
        """Build a decode graph for every size, largest first (graphs can then share the largest's
        memory), on padding-only example inputs; called once the KV cache exists."""
        if self.graphs is None:
            return
        step = DecodeStep(self.model, self.backend, self.kv_caches, self.block_size)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for size in reversed(self.graph_sizes):
                example = DecodeGraphInputs.empty(size, self.max_blocks_per_req, self.device)
                self.graphs.build(size, step.forward, example)
        logger.info("built decode graphs for batch sizes %s in %.1f s", self.graph_sizes, time.perf_counter() - t0)

    def _graph_size(self, layout: BatchLayout) -> int | None:
        if self.graphs is None or layout.num_decode_reqs != layout.num_reqs:
            return None
        if layout.max_seq_len > self.config.max_seq_len_to_capture:
            return None
        return pick_graph_size(layout.num_reqs, self.graph_sizes)

    def split_features(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states, what an EAGLE head reads) of a forward's output: its two parts when
        the model returns layer inputs after its output (``aux_layers``), else the output twice."""
        aux = len(getattr(self.model, "aux_layers", ()))
        if not aux:
            return out, out
        width = self.model.config.hidden_size
        if out.shape[-1] != (aux + 1) * width:
            raise RuntimeError(f"{type(self.model).__name__} returned {out.shape[-1]} columns, not {aux + 1} x {width}")
        return out[:, :width].contiguous(), out[:, width:]

    def run_batch(self, batch: StepBatch) -> torch.Tensor:
        """The model's output for every token of ``batch`` (eagerly or through a graph): its
        hidden states, and after them the layer inputs an EAGLE-3 head reads (``split_features``)."""
        if batch.block_copies:
            src, dst = (torch.tensor(ids, dtype=torch.int64, device=self.device) for ids in zip(*batch.block_copies))
            for kv_cache in self.kv_caches:
                self.backend.copy_blocks(kv_cache, src, dst)
        layout = BatchLayout.build(batch.block_rows, batch.context_lens, batch.query_lens, self.block_size, self.device)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=self.device)
        lora = None
        if self.lora is not None:
            lora = self.lora.apply(batch.lora_loads, batch.lora_slots, batch.query_lens, self.device)
        size = self._graph_size(layout) if lora is None else None  # graphs hold the base model only
        if size is None:
            ctx = StepContext(self.backend.build_metadata(layout), self.kv_caches, layout, lora=lora)
            if batch.token_type_ids is not None:
                ctx.token_type_ids = torch.tensor(batch.token_type_ids, dtype=torch.int64, device=self.device)
            return self.model(input_ids, positions, ctx)
        self.graph_steps += 1
        inputs = DecodeGraphInputs.pad(input_ids, positions, layout, size, self.max_blocks_per_req)
        return self.graphs.run(size, inputs)[: layout.num_reqs]

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        # Decodes (with their drafts) first: backends batch them separately from prefills.
        batch = sorted(output.scheduled, key=lambda item: item[1] - len(item[0].spec_token_ids) != 1)
        step = StepBatch.of(batch)
        step.block_copies = output.block_copies
        if self.lora is not None and any(req.lora_request is not None for req, _ in batch):
            per_row = [req.lora_request for req, _ in batch for _ in range(req.num_sampled_rows)]
            step.lora_slots, step.lora_loads = self.lora.assign(per_row)

        rows: list[int] = []  # flat token indices whose logits we need
        sampling_reqs: list[Request] = []
        prompt_spans: list[tuple[Request, int, int, int]] = []  # req, first pos, row offset, count
        sample_rows: list[int] = []
        pool_spans: list[tuple[Request, int, int]] = []  # pooling requests: req, first row, rows
        spans: dict[Request, tuple[int, int, int]] = {}  # with keep_features: first position, first row, rows
        offset = 0
        for req, n in batch:
            start = req.num_computed_tokens
            if req.pooling_params is not None:  # prefill-only: pooled below, never sampled
                pool_spans.append((req, offset, n))
                offset += n
                continue
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                count = min(start + n, req.num_prompt_tokens - 1) - start
                prompt_spans.append((req, start, len(rows), count))
                rows.extend(range(offset, offset + count))
            if start + n == req.num_tokens + len(req.spec_token_ids):  # the last token, then each draft
                sampling_reqs.append(req)
                sample_rows.extend(range(offset + n - 1 - len(req.spec_token_ids), offset + n))
            if self.keep_features and req.beam is None:  # beams never draft
                spans[req] = (start, offset, n)
            offset += n
        sample_from = len(rows)
        rows.extend(sample_rows)

        t0 = time.perf_counter()
        if self.peers is not None:
            self.peers.send(step)  # the other tensor-parallel ranks run the same step alongside
        hidden, head_input = self.split_features(self.run_batch(step))
        if rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)])
        else:  # only pooling requests (pooling models may have no LM head)
            logits = hidden.new_zeros((0, 0), dtype=torch.float32)
        pooled = pool(self.model, hidden, pool_spans, self.dense) if pool_spans else {}
        self.platform.synchronize()
        forward_time = time.perf_counter() - t0
        # Sampling stays on the device; prompt log-probs are read row by row, on the host.
        prompt_logits = {req: (first, logits[o : o + c].cpu()) for req, first, o, c in prompt_spans}
        features = head_input if spans else None
        return StepResult(sampling_reqs, logits[sample_from:], prompt_logits, forward_time, pooled, features, spans)
