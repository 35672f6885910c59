"""``Executor``: the engine core's one handle on the tensor side.

It builds rank 0's model and KV cache (and starts ranks 1..N-1 under tensor
parallelism), then per step runs the model over a ``SchedulerOutput`` and samples
from the logits it returns. The core sees only requests, token ids and logprob
ids going in and out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kiln.config import EngineConfig
from kiln.distributed import TensorParallel
from kiln.engine.request import Request, TopLogprobs
from kiln.engine.scheduler import SampledToken, SchedulerOutput
from kiln.interfaces.model import resolve_ops
from kiln.interfaces.platform import Platform
from kiln.models.eagle import read_eagle_config
from kiln.models.loader import is_gguf_file, load_hf_config, resolve_model
from kiln.quantization import config as quant_config
from kiln.registry import Registry
from kiln.spec_decode.config import MODEL_METHODS
from kiln.worker.builder import build_runner
from kiln.worker.draft_model import DraftModel
from kiln.worker.eagle import EAGLE_ARCHS, EagleDraft, prepare_head_config, refuse_head
from kiln.worker.sampler import BitmaskKernel, Sampler, prompt_top_logprobs
from kiln.worker.spec_verify import sample_with_drafts
from kiln.worker.tp_workers import TensorParallelWorkers

logger = logging.getLogger("kiln.engine")


@dataclass(slots=True)
class ModelOutput:
    """One forward pass: logits of the requests that sample, and prompt logprobs computed."""

    sampling_reqs: list[Request]  # in logits row order
    logits: torch.Tensor  # (rows, vocab) float32 on the device: num_sampled_rows rows per request
    prompt_logprobs: dict[Request, list[TopLogprobs]]
    forward_time: float
    pooled: dict[Request, torch.Tensor] = field(default_factory=dict)  # pooling requests' outputs (host)


class Executor:
    """Rank 0's ``ModelRunner``, the other tensor-parallel ranks, and the ``Sampler``."""

    def __init__(
        self,
        config: EngineConfig,
        registry: Registry,
        platform: Platform,
        hf_config,
        dtype: torch.dtype,
        model_path: str,
        bitmask_kernel: BitmaskKernel,
    ) -> None:
        self.config, self.platform, self.hf_config = config, platform, hf_config
        tp = TensorParallel(0, config.tensor_parallel_size, config.enable_expert_parallel)
        # The draft model first: once started, the other ranks wait in rank 0's collectives.
        spec = config.speculative_config
        self.draft = self._build_draft(registry, dtype) if spec and spec.method in MODEL_METHODS else None
        self.workers = self._start_workers(model_path, dtype, tp) if tp.size > 1 else None
        try:
            self.runner = build_runner(config, registry, platform, hf_config, dtype, model_path, tp)
            if isinstance(self.draft, EagleDraft):  # the head reads the target's embeddings, LM head and states
                self.draft.attach(self.runner.model)
                self.runner.keep_features = True
            self.num_blocks = self._num_kv_blocks()  # the workers profile alongside, then report "built"
            if self.workers is not None:
                self.workers.expect("built")
                self.workers.send(self.num_blocks)
            self.runner.allocate_kv_cache(self.num_blocks)
            if self.draft is not None:
                self.draft.runner.allocate_kv_cache(self.num_blocks)
            self.runner.build_graphs()
            if self.workers is not None:
                self.workers.expect("ready")
                self.runner.peers = self.workers
        except BaseException:
            self.shutdown()
            raise
        self.sampler = Sampler(config.seed, bitmask_kernel, resolve_ops(platform.custom_ops()).argmax)

    def _start_workers(self, model_path: str, dtype: torch.dtype, tp: TensorParallel) -> TensorParallelWorkers:
        """Spawn ranks 1..N-1 and form the collective group with them (rank 0 is this process)."""
        self.platform.init_rank(0, tp.size)
        resolved = self.config.model_copy(update={"device": self.platform.name})
        workers = TensorParallelWorkers(resolved, model_path, dtype, tp.size)
        try:
            workers.expect("joining")
            torch.distributed.init_process_group(
                self.platform.dist_backend, init_method=workers.init_method, rank=0, world_size=tp.size
            )
        except BaseException:
            workers.shutdown()
            raise
        return workers

    def _build_draft(self, registry: Registry, dtype: torch.dtype) -> DraftModel:
        """The speculative draft model: whole on this rank, eager, with the target's block size."""
        spec = self.config.speculative_config
        load_format = "dummy" if self.config.load_format == "dummy" else "auto"
        files = resolve_model(spec.model, load_format, None, self.config.download_dir)
        quantization = quant_config.for_model_file(None, is_gguf_file(spec.model, load_format))
        has_graphs = type(self.platform).graph_runner is not Platform.graph_runner
        eagle = spec.method in EAGLE_ARCHS
        config = self.config.model_copy(
            update={
                "model": files.path, "load_format": load_format, "config_format": "auto", "quantization": quantization,
                "tensor_parallel_size": 1, "enforce_eager": self.config.enforce_eager or has_graphs,
                "enable_lora": False, "hf_overrides": None, "rope_scaling": None, "rope_theta": None,
                **({"model_impl": "kiln"} if eagle else {}),  # a head is Kiln's own class
            }
        )  # fmt: skip
        hf_config = read_eagle_config(files.path)  # the layout ``kiln convert-eagle`` writes
        if hf_config is None:
            hf_config = load_hf_config(files.path, config)
        elif spec.method != "eagle":
            raise ValueError(f"--speculative-config: {spec.model!r} is an EAGLE-1 head (EAGLEModel); use method eagle")
        aux_layers = ()
        if eagle:
            aux_layers = prepare_head_config(spec.method, hf_config, self.hf_config, self.config.model_impl)
        else:
            refuse_head(hf_config, "--speculative-config")
        if hf_config.vocab_size != self.hf_config.vocab_size:
            raise ValueError(
                f"--speculative-config: the draft model's vocabulary ({hf_config.vocab_size} tokens) differs from "
                f"the target's ({self.hf_config.vocab_size}); a draft model must share the target's tokenizer"
            )
        runner = build_runner(config, registry, self.platform, hf_config, dtype, files.path, TensorParallel(0, 1))
        headless = getattr(runner.model, "pooling_only", False) and not eagle  # an EAGLE head gets the target's
        if getattr(runner.model, "is_encoder", False) or not hasattr(runner.model, "compute_logits") or headless:
            raise ValueError(f"--speculative-config: the draft model {spec.model!r} is not a causal language model")
        if eagle:
            runner.model.release_shared()  # before the target loads: the target lends them (``attach``)
            return EagleDraft(runner, self.config.max_num_batched_tokens, aux_layers)
        return DraftModel(runner, self.config.max_num_batched_tokens)

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
            per_block = self.runner.kv_block_bytes()  # 0 for encoders: no KV cache, blocks only count tokens
            if self.draft is not None:  # the draft model's cache has as many blocks
                per_block += self.draft.runner.kv_block_bytes()
            num_blocks = min(int(budget // per_block), useful) if per_block else useful
        if (num_blocks - 1) * bs < cfg.max_model_len:
            raise ValueError(
                f"the KV cache holds {max(num_blocks - 1, 0) * bs} tokens, less than --max-model-len "
                f"{cfg.max_model_len}; lower --max-model-len or give it more blocks/memory"
            )
        return num_blocks

    def propose(self, scheduled: SchedulerOutput) -> None:
        """Fill the draft positions the scheduler reserved for a draft model (n-gram drafts come
        filled)."""
        if self.draft is not None:
            self.draft.fill(scheduled)

    def execute_model(self, scheduled: SchedulerOutput) -> ModelOutput:
        """Run the model over the scheduled tokens (all ranks); prompt logprobs of positions
        computed for the first time."""
        result = self.runner.execute(scheduled)
        if result.feature_spans:
            self.draft.observe(result.features, result.feature_spans)
        prompt_logprobs = {}
        for req, (first, logits) in result.prompt_logits.items():
            if req.num_prompt_logprobs != first:
                continue  # recomputed after preemption: already emitted
            next_tokens = req.prompt_token_ids[first + 1 : first + 1 + logits.shape[0]]
            prompt_logprobs[req] = prompt_top_logprobs(logits, next_tokens, req.sampling_params.prompt_logprobs)
            req.num_prompt_logprobs += len(next_tokens)
        return ModelOutput(result.sampling_reqs, result.logits, prompt_logprobs, result.forward_time, result.pooled)

    def sample(self, output: ModelOutput) -> dict[Request, list[SampledToken]]:
        """The tokens each sampling request emits: one, or its accepted drafts and one more."""
        if not output.sampling_reqs:
            return {}
        return sample_with_drafts(self.sampler, output.logits, output.sampling_reqs)

    def free(self, request_ids: Iterable[str]) -> None:
        """Drop per-request state of finished requests (seeded generators, the draft model's)."""
        request_ids = list(request_ids)
        self.sampler.free(request_ids)
        if self.draft is not None:
            self.draft.free(request_ids)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
