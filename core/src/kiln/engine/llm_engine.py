"""``LLMEngine``: builds the parts from the config and drives them one step at a time.

add_request ─▶ InputProcessor ─▶ EngineCore.step() ─▶ OutputProcessor ─▶ RequestOutput
               (tokens, checks,   (schedule, execute,   (text, stop strings,
                guided compile,    bitmask, sample,      logprobs, metrics)
                best_of fan-out)   update)                     │
                                        ▲                     │
                                        └── stop strings come back as aborts
"""

from __future__ import annotations

import logging
import time

from kiln.config import EngineConfig
from kiln.engine.engine_core import EngineCore
from kiln.engine.guided_manager import GuidedManager
from kiln.engine.input_processor import InputProcessor, ProcessedRequest, PromptInput
from kiln.engine.kv_cache import KVCacheManager
from kiln.engine.model_info import ModelInfo
from kiln.engine.output_processor import OutputProcessor
from kiln.engine.pooling import PoolingInputProcessor, PoolingOutputProcessor
from kiln.engine.request import RequestStatus
from kiln.engine.scheduler import Scheduler
from kiln.engine.tokenizer import load_tokenizer
from kiln.lora.request import LoRARequest
from kiln.models.bert import position_offset
from kiln.models.eagle import read_eagle_config
from kiln.models.loader import (
    is_gguf_file,
    load_generation_defaults,
    load_hf_config,
    resolve_model,
    resolve_tokenizer,
)
from kiln.models.pooler import setup_pooling
from kiln.models.rope import context_limit
from kiln.outputs import RequestOutput
from kiln.platforms.select import select_platform
from kiln.plugins import PluginManager, get_plugin_manager
from kiln.pooling_params import PoolingParams, check_task
from kiln.quantization import config as quant_config
from kiln.sampling_params import SamplingParams
from kiln.spec_decode.config import spec_metrics_enabled
from kiln.worker.builder import resolve_dtype
from kiln.worker.eagle import head_refusal, refuse_head
from kiln.worker.executor import Executor

__all__ = ["LLMEngine", "PromptInput"]

logger = logging.getLogger("kiln.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None) -> None:
        self.config = config
        self.plugins = plugins or get_plugin_manager()
        registry = self.plugins.registry
        self.platform = select_platform(config.device, registry)
        _note_unused_lora_flags(config)
        if not config.multi_step_stream_outputs and config.num_scheduler_steps == 1:
            logger.warning("--multi-step-stream-outputs false changes nothing without --num-scheduler-steps above 1")
        model_id = config.model
        gguf = is_gguf_file(model_id, config.load_format)
        config.quantization = quant_config.for_model_file(config.quantization, gguf)
        self.platform.update_config(config)  # sees the resolved quantization; fails before any download
        files = resolve_model(model_id, config.load_format, config.revision, config.download_dir)
        config.model = files.path  # later readers (tensor-parallel ranks, platforms) get the local folder
        if read_eagle_config(files.path) is not None:  # vLLM 0.6's layout, which transformers cannot read
            raise head_refusal("EAGLEModel", "model")
        hf_config = load_hf_config(files.path, config)
        refuse_head(hf_config, "model")
        pooling = setup_pooling(config, hf_config, registry, files.path)  # resolves --task
        if config.speculative_config is not None and config.task != "generate":
            raise ValueError(
                f"--speculative-config: drafts speed up generation; --task {config.task} generates nothing"
            )
        self.spec_metrics = config.speculative_config is not None and spec_metrics_enabled()
        _resolve_lengths(config, hf_config)
        self.plugins.update_engine_config(config)
        self.dtype = resolve_dtype(config, self.platform, hf_config)
        tokenizer_path = resolve_tokenizer(
            config.tokenizer, model_id, files.path, config.tokenizer_revision, config.download_dir
        )
        tokenizer = load_tokenizer(tokenizer_path, config.tokenizer_mode, config.trust_remote_code)
        defaults = load_generation_defaults(files.path, config.generation_config)
        eos = defaults.pop("eos_token_ids", []) + (
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        )
        self.model_info = ModelInfo(
            files.name, files.path, tokenizer, hf_config.vocab_size, config.max_model_len, config.max_num_seqs,
            frozenset(eos), defaults, str(self.dtype).removeprefix("torch."), config.quantization, config.task,
        )  # fmt: skip
        guided = GuidedManager(registry, tokenizer, hf_config.vocab_size, config.guided_decoding_backend)
        self.executor = Executor(
            config, registry, self.platform, hf_config, self.dtype, files.path, guided.apply_bitmask
        )
        num_blocks = self.executor.num_blocks
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, self.platform.kv_memory_on_first_write
        )
        self.core = EngineCore(Scheduler(config, self.kv), self.executor)
        if pooling is None:
            self.input_processor = InputProcessor(self.model_info, guided, config.max_logprobs)
            self.output_processor = OutputProcessor(tokenizer)
        else:  # a pooling model takes PoolingParams requests (kiln.engine.pooling)
            self.input_processor = PoolingInputProcessor(self.model_info, pooling)
            self.output_processor = PoolingOutputProcessor()
        logger.info(
            "engine ready: model=%s platform=%s dtype=%s attention=%s kv_blocks=%d x %d tokens",
            files.name,
            self.platform.name,
            self.dtype,
            self.executor.runner.backend.name,
            num_blocks,
            config.block_size,
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        self.executor.shutdown()

    # --------------------------------------------------------------- requests
    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults applied (vLLM's behaviour)."""
        return SamplingParams(**{**self.model_info.generation_defaults, **overrides})

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; raises ``ValueError`` naming the bad field."""
        processed = self.process_request(request_id, prompt, params, arrival_time, priority, lora_request)
        self.add_processed(processed)
        return processed.request_id

    def process_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Tokenize and validate without queueing (safe off the engine's thread)."""
        check_task(self.model_info.task, params)
        if request_id is not None and request_id in self.output_processor.groups:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError("priority: only allowed with --scheduling-policy priority (vLLM refuses it under fcfs)")
        if lora_request is None:
            return self.input_processor.process(request_id, prompt, params, arrival_time, priority)
        if isinstance(params, PoolingParams):
            raise ValueError("lora_request: LoRA adapters apply to generation, not to pooling requests")
        adapter = self.add_lora(lora_request)
        processed = self.input_processor.process(request_id, prompt, params, arrival_time, priority, lora_request)
        processed.lora_adapter = adapter
        return processed

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest):
        """Read (or find already read) and check a LoRA adapter, and return it; ``ValueError``
        says what is wrong."""
        slots = self.executor.runner.lora
        if slots is None:
            raise ValueError("LoRA adapters need the engine started with --enable-lora")
        return slots.cache.get(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget a loaded adapter (requests running on it finish with it)."""
        if self.executor.runner.lora is not None:
            self.executor.runner.lora.forget(lora_int_id)

    def add_processed(self, processed: ProcessedRequest) -> None:
        """Queue a request made by ``process_request``."""
        if processed.request_id in self.output_processor.groups:
            raise ValueError(f"request_id: {processed.request_id!r} is already running")
        self.output_processor.add(processed.group)
        if processed.lora_adapter is not None:  # held until the request ends: steps never read a disk
            self.executor.runner.lora.cache.hold(processed.group.lora_request, processed.lora_adapter)
        now = time.time()
        for req in processed.requests:
            req.metrics.request_start_time = now
            req.metrics.preprocess_cost_time = now - req.arrival_time
            self.core.add_request(req)

    def abort_request(self, request_id: str) -> None:
        group = self.output_processor.groups.get(request_id)
        self.core.finish_requests(self.output_processor.abort(request_id), RequestStatus.FINISHED_ABORTED)
        if group is not None:
            self._release_adapter(group.lora_request)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One engine-core step; the outputs of the requests it changed."""
        result = self.output_processor.process(self.core.step())
        if result.reqs_to_abort:
            self.core.finish_requests(result.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        if self.executor.runner.lora is not None:
            for out in result.request_outputs:
                if out.finished:  # pooling outputs have no adapter
                    self._release_adapter(getattr(out, "lora_request", None))
        return result.request_outputs

    def _release_adapter(self, lora_request: LoRARequest | None) -> None:
        if lora_request is not None:
            self.executor.runner.lora.cache.release(lora_request)

    def get_stats(self) -> dict:
        scheduler = self.core.scheduler
        return {
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "prompt_tokens": self.core.num_prompt_tokens,
            "generation_tokens": self.core.num_generation_tokens,
            "num_preemptions": scheduler.num_preemptions,
            # a copy of the drafted/accepted counts, with speculative decoding (else None)
            "spec_decode": scheduler.spec_stats.since(None) if self.spec_metrics else None,
        }


def _note_unused_lora_flags(config: EngineConfig) -> None:
    """Say in the log when LoRA flags change nothing: LoRA is off."""
    flags = ("max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype", "enable_lora_bias", "fully_sharded_loras")
    given = [f for f in flags if getattr(config, f) != EngineConfig.model_fields[f].default]
    if given and not config.enable_lora:
        names = ", ".join("--" + f.replace("_", "-") for f in given)
        logger.warning("%s change nothing without --enable-lora", names)


def _resolve_lengths(cfg: EngineConfig, hf_config) -> None:
    """Fill ``max_model_len`` and ``max_num_batched_tokens`` from the model, or check them."""
    # (XLM-)RoBERTa's first position embeddings belong to padding: they take fewer tokens.
    trained = (getattr(hf_config, "max_position_embeddings", None) or 2048) - position_offset(hf_config)
    limit = context_limit(hf_config, trained)
    if cfg.max_model_len is None:
        cfg.max_model_len = limit
    elif cfg.max_model_len > limit:
        raise ValueError(f"--max-model-len: {cfg.max_model_len} exceeds the model's limit of {limit} positions")
    if cfg.max_num_batched_tokens is None:
        cfg.max_num_batched_tokens = 2048 if cfg.enable_chunked_prefill else max(cfg.max_model_len, 2048)
    elif not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
        remedy = (
            "raise it (or lower --max-model-len): a pooling model computes each prompt whole in one step"
            if cfg.task != "generate"
            else "enable chunked prefill or raise it"
        )
        raise ValueError(
            f"--max-num-batched-tokens: {cfg.max_num_batched_tokens} is smaller than --max-model-len "
            f"{cfg.max_model_len}; {remedy}"
        )
