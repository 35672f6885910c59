"""``LLMEngine``: builds every part from the config and drives one step at a time."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import torch

from kiln.config import EngineConfig
from kiln.distributed import TensorParallel
from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.kv_cache import KVCacheManager
from kiln.engine.output_processor import LogprobFormatter, RequestGroup
from kiln.engine.request import Request, RequestStatus
from kiln.engine.sampler import Sampler, top_logprobs
from kiln.engine.scheduler import Scheduler
from kiln.engine.tp_executor import TensorParallelWorkers
from kiln.engine.worker import build_runner
from kiln.guided import GuidedManager, allocate_bitmask
from kiln.models.loader import load_generation_defaults, resolve_model
from kiln.outputs import RequestOutput
from kiln.platforms.select import select_platform
from kiln.plugins import PluginManager, get_plugin_manager
from kiln.sampling_params import SamplingParams

logger = logging.getLogger("kiln.engine")

PromptInput = str | list[int] | dict
_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


class LLMEngine:
    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.config = config
        self.plugins = plugins or get_plugin_manager()
        registry = self.plugins.registry
        self.platform = select_platform(config.device, registry)
        self.platform.update_config(config)
        files = resolve_model(config.model, config.load_format)
        self.model_name, self.model_path = files.name, files.path
        hf_config = AutoConfig.from_pretrained(files.path, trust_remote_code=config.trust_remote_code)
        self.hf_config = hf_config
        self._resolve_lengths(hf_config)
        self.plugins.update_engine_config(config)
        self.dtype = self._resolve_dtype(hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(
            config.tokenizer or files.path, trust_remote_code=config.trust_remote_code
        )
        self.generation_defaults = load_generation_defaults(files.path, config.generation_config)

        tp = TensorParallel(0, config.tensor_parallel_size)
        self.workers = self._start_workers(tp) if tp.size > 1 else None
        try:
            self.runner = build_runner(config, registry, self.platform, hf_config, self.dtype, self.model_path, tp)
            num_blocks = self._num_kv_blocks()  # the workers profile alongside, then report "built"
            if self.workers is not None:
                self.workers.expect("built")
                self.workers.send(num_blocks)
            self.runner.allocate_kv_cache(num_blocks)
            self.runner.build_graphs()
            if self.workers is not None:
                self.workers.expect("ready")
                self.runner.peers = self.workers
        except BaseException:
            self.shutdown()
            raise
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, self.platform.kv_memory_on_first_write
        )
        self.scheduler = Scheduler(config, self.kv)
        self.sampler = Sampler(config.seed)
        self.guided = GuidedManager(registry, self.tokenizer, hf_config.vocab_size, config.guided_decoding_backend)
        self.sampler.masks.append(self._guided_mask)
        self.logprob_formatter = LogprobFormatter(self.tokenizer)
        self.groups: dict[str, RequestGroup] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens = 0  # prompt tokens computed (recomputation included), for stats
        self.num_generation_tokens = 0
        eos = self.generation_defaults.pop("eos_token_ids", [])
        self.eos_token_ids = frozenset(
            eos + ([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        )
        logger.info(
            "engine ready: model=%s platform=%s dtype=%s attention=%s kv_blocks=%d x %d tokens",
            self.model_name,
            self.platform.name,
            self.dtype,
            self.runner.backend.name,
            num_blocks,
            config.block_size,
        )

    # ----------------------------------------------------------------- set-up
    def _resolve_lengths(self, hf_config) -> None:
        cfg = self.config
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        if cfg.max_model_len is None:
            cfg.max_model_len = limit
        elif cfg.max_model_len > limit:
            raise ValueError(f"--max-model-len: {cfg.max_model_len} exceeds the model's limit of {limit} positions")
        if cfg.max_num_batched_tokens is None:
            cfg.max_num_batched_tokens = 2048 if cfg.enable_chunked_prefill else max(cfg.max_model_len, 2048)
        elif not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
            raise ValueError(
                f"--max-num-batched-tokens: {cfg.max_num_batched_tokens} is smaller than --max-model-len "
                f"{cfg.max_model_len}; enable chunked prefill or raise it"
            )

    def _resolve_dtype(self, hf_config) -> torch.dtype:
        stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(stored, str):
            stored = getattr(torch, stored, None)
        dtype = self.platform.dtype_for(stored) if self.config.dtype == "auto" else _DTYPES[self.config.dtype]
        if dtype not in self.platform.supported_dtypes:
            raise ValueError(f"--dtype: {dtype} is not supported on {self.platform.name}")
        return dtype

    def _start_workers(self, tp: TensorParallel) -> TensorParallelWorkers:
        """Spawn ranks 1..N-1 and form the collective group with them (rank 0 is this process)."""
        self.platform.init_rank(0, tp.size)
        resolved = self.config.model_copy(update={"device": self.platform.name})
        workers = TensorParallelWorkers(resolved, self.model_path, self.dtype, tp.size)
        try:
            workers.expect("joining")
            torch.distributed.init_process_group(
                self.platform.dist_backend, init_method=workers.init_method, rank=0, world_size=tp.size
            )
        except BaseException:
            workers.shutdown()
            raise
        return workers

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        bs = cfg.block_size
        if cfg.num_gpu_blocks_override is not None:
            num_blocks = cfg.num_gpu_blocks_override
        else:
            activations = self.runner.profile_peak()
            if activations is None:  # not measurable: a generous estimate of one step's buffers
                activations = cfg.max_num_batched_tokens * self.hf_config.intermediate_size * 4 * 8
            free, total = self.platform.mem_get_info()
            budget = total * cfg.gpu_memory_utilization - (total - free) - activations
            useful = cfg.max_num_seqs * -(-cfg.max_model_len // bs) + 1
            num_blocks = min(int(budget // self.runner.kv_block_bytes()), useful)
        if (num_blocks - 1) * bs < cfg.max_model_len:
            raise ValueError(
                f"the KV cache holds {max(num_blocks - 1, 0) * bs} tokens, less than --max-model-len "
                f"{cfg.max_model_len}; lower --max-model-len or give it more blocks/memory"
            )
        return num_blocks

    # --------------------------------------------------------------- requests
    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults applied (vLLM's behaviour)."""
        return SamplingParams(**{**self.generation_defaults, **overrides})

    def tokenize_prompt(self, prompt: PromptInput, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return None, list(prompt)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """Validate and queue a request; raises ``ValueError`` naming the bad field."""
        group = self.prepare_request(request_id, prompt, params, arrival_time, priority)
        self.add_prepared(group)
        return group.request_id

    def prepare_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> RequestGroup:
        """Tokenize and validate a request without touching the scheduler.

        Safe to call from another thread than the one stepping the engine (the
        server's front end does), so bad input fails before it is queued.
        """
        arrival = arrival_time or time.time()
        request_id = request_id or str(next(self._ids))
        if request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already running")
        text, ids = self.tokenize_prompt(prompt)
        self._validate(ids, params)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]
        if params.bad_words:
            params._bad_words_token_ids = self._bad_words_ids(params.bad_words)
        guide = None if params.guided_decoding is None else self.guided.compile(params.guided_decoding)
        salt = request_id if params.best_of > 1 else None
        children = []
        for i in range(params.best_of):
            child_id = request_id if params.best_of == 1 else f"{i}_{request_id}"
            seed = None if params.seed is None else params.seed + i
            children.append(
                Request(
                    request_id=child_id,
                    prompt_token_ids=ids,
                    sampling_params=params,
                    eos_token_ids=self.eos_token_ids,
                    arrival_time=arrival,
                    priority=priority,
                    parent_id=None if params.best_of == 1 else request_id,
                    cache_salt=salt,
                    generator=None if seed is None else torch.Generator().manual_seed(seed),
                    matcher=None if guide is None else guide.matcher(),
                )
            )
        if params.prompt_logprobs is not None:
            for child in children:
                child.prompt_logprobs = [None]  # nothing predicts the first prompt token
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params) for _ in children]
        return RequestGroup(request_id, text, ids, params, children, detoks)

    def add_prepared(self, group: RequestGroup) -> None:
        """Queue a request made by ``prepare_request``."""
        if group.request_id in self.groups:
            raise ValueError(f"request_id: {group.request_id!r} is already running")
        self.groups[group.request_id] = group
        now = time.time()
        for child in group.children:
            child.metrics.request_start_time = now
            child.metrics.preprocess_cost_time = now - child.arrival_time
            self.scheduler.add_request(child)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.hf_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(
                f"prompt: token ids must be in [0, {vocab}), got {max(ids) if max(ids) >= vocab else min(ids)}"
            )
        n = min(len(ids), params.truncate_prompt_tokens or len(ids))
        if n >= self.config.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens leave no room to generate within max_model_len={self.config.max_model_len}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"{name}: {value} is more than --max-logprobs {self.config.max_logprobs}")
        for name in ("allowed_token_ids", "stop_token_ids"):
            bad = [t for t in (getattr(params, name) or []) if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}: token ids out of the vocabulary: {bad[:5]}")
        if params.logit_bias and any(not 0 <= int(t) < vocab for t in params.logit_bias):
            raise ValueError("logit_bias: token ids out of the vocabulary")

    def _bad_words_ids(self, words: Sequence[str]) -> list[list[int]]:
        out = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        for child in group.children if group else ():
            self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, detokenize; return outputs of requests that changed."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        t0 = time.perf_counter()
        result = self.runner.execute(out)
        sampled: dict[Request, int] = {}
        if result.sampling_reqs:
            s = self.sampler(result.logits, result.sampling_reqs)
            for req, token, lp in zip(result.sampling_reqs, s.token_ids, s.logprobs):
                sampled[req] = token
                if lp is not None:
                    req.cumulative_logprob += lp.logprob
                    if req.sampling_params.logprobs is not None:
                        req.logprobs.append(self.logprob_formatter.position(lp))
        for req, token in sampled.items():
            if req.matcher is not None and not req.matcher.accept(token):
                logger.warning("request %s: sampled token %d breaks its constraint", req.request_id, token)
        for req, (first, logits) in result.prompt_logits.items():
            self._record_prompt_logprobs(req, first, logits)
        for req, n in out.scheduled:
            self.num_prompt_tokens += min(n, max(0, len(req.prompt_token_ids) - req.num_computed_tokens))
        self.num_generation_tokens += len(sampled)
        self.scheduler.update_from_output(out, sampled)
        for req in sampled:
            if req.matcher is not None and req.matcher.is_terminated() and not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)  # the constraint is complete

        now = time.time()
        step_time = time.perf_counter() - t0
        touched: dict[str, RequestGroup] = {}
        for req, _ in out.scheduled:
            req.metrics.model_forward_time += result.forward_time
            req.metrics.model_execute_time += step_time
            if req in sampled:
                self._on_token(req, sampled[req], now)
                gid = req.parent_id or req.request_id
                touched.setdefault(gid, self.groups[gid])
        outputs = []
        for gid, group in touched.items():
            output = group.make_output()
            if output is not None:
                outputs.append(output)
            if group.finished:
                del self.groups[gid]
        return outputs

    def _guided_mask(self, logits: torch.Tensor, reqs: Sequence[Request]) -> None:
        """Mask the logits of constrained rows to what their matchers allow (before any sampling step)."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None and not r.matcher.is_terminated()]
        if not rows:
            return
        bitmask = allocate_bitmask(logits.shape[0], logits.shape[-1])
        for i in rows:
            reqs[i].matcher.fill_bitmask(bitmask, i)
        self.guided.apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), rows)

    def _on_token(self, req: Request, token: int, now: float) -> None:
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now - m.arrival_time
        m.last_token_time = now
        group = self.groups[req.parent_id or req.request_id]
        detok = group.detokenizers[group.children.index(req)]
        params = req.sampling_params
        if req.status is RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output:
            stop = None  # EOS or a stop_token_id ended it: like vLLM, its text is not part of the output
        else:
            # vLLM looks for stop strings only once min_tokens are out.
            stop = detok.update([token], check_stop=req.num_output_tokens > params.min_tokens)
        if stop is not None:
            req.stop_reason = stop
            if req.is_finished:
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        if req.is_finished:
            m.finished_time = now

    def _record_prompt_logprobs(self, req: Request, first: int, logits: torch.Tensor) -> None:
        if len(req.prompt_logprobs) != first + 1:
            return  # recomputed after preemption: already recorded
        k = req.sampling_params.prompt_logprobs
        logprobs = logits.log_softmax(-1)
        for row in range(logits.shape[0]):
            token = req.prompt_token_ids[first + row + 1]
            req.prompt_logprobs.append(self.logprob_formatter.position(top_logprobs(logprobs[row], token, k)))

    def get_stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
        }
