"""The engine configuration: one typed object holding every engine flag.

Defaults follow vLLM (seed 003), whose flags the server mirrors; ``kv_cache_ratio``
comes from seed 000. Values the model or platform decide (``max_model_len``,
``block_size``, ``max_num_batched_tokens``, the resolved dtype) stay ``None``
until ``LLMEngine`` resolves them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.spec_decode.config import SpeculativeFlags

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


class EngineConfig(SpeculativeFlags):
    """Every engine flag; the speculative-decoding ones come from ``SpeculativeFlags``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    model: str | None = Field(None, description="HF folder, .gguf file, or None for the embedded default")
    tokenizer: str | None = Field(None, description="tokenizer folder; defaults to the model's")
    tokenizer_mode: Literal["auto", "slow", "mistral"] = Field(
        "auto",
        description="auto: Hugging Face's tokenizer (mistral_common's for a folder whose only tokenizer files are "
        "its tekken.json or tokenizer.model.v<N>); mistral: mistral_common's (pip install "
        "mistral-common[sentencepiece]); slow is refused with the reason",
    )
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    max_model_len: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, description="tokens per KV-cache block; the platform's default if unset")
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    num_gpu_blocks_override: int | None = Field(None, ge=1)
    kv_cache_ratio: float = Field(0.75, gt=0.0, le=1.0)
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description="KV-cache storage dtype: auto (the model's), bfloat16 or fp8 (e4m3/e5m2), where the platform has it",
    )
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_scheduler_steps: int = Field(
        1,
        ge=1,
        description="decode steps per scheduling decision: after a step of decodes only, the next N-1 steps "
        "continue those requests and admit no waiting one",
    )
    multi_step_stream_outputs: bool = Field(
        True,
        description="under multi-step scheduling, stream each step's tokens (true) or each request's tokens "
        "once per N steps (false)",
    )
    seed: int = 0
    enforce_eager: bool = False
    max_seq_len_to_capture: int = Field(8192, ge=1)
    graph_sizes: list[int] | None = Field(
        None, description="decode batch sizes run as graphs (CUDA graph capture sizes, torchair gears)"
    )
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_mode: Literal["recompute"] | None = None
    load_format: Literal["auto", "safetensors", "pt", "gguf", "mistral", "dummy"] = Field(
        "auto",
        description="auto: a folder's safetensors, else .bin (or a .gguf file's); mistral: Mistral's "
        "consolidated*.safetensors; dummy: random weights",
    )
    config_format: Literal["auto", "hf", "mistral"] = Field(
        "auto", description="auto: config.json, else Mistral's params.json; hf: config.json; mistral: params.json"
    )
    max_parallel_loading_workers: int | None = Field(
        None, ge=1, description="tensor-parallel ranks that read the checkpoint at once (the others wait their turn)"
    )
    generation_config: str | None = Field("auto", description="'auto' (the model's), 'vllm' (none) or a folder")
    max_logprobs: int = Field(20, ge=0)
    device: str = "auto"
    attention_backend: str | None = Field(None, description="a registered attention backend; the platform's if unset")
    guided_decoding_backend: str = Field(
        "xgrammar",
        description="guided-decoding backend for requests that name none; 'NAME:no-fallback' forbids fallback",
    )
    tensor_parallel_size: int = Field(1, ge=1)
    enable_expert_parallel: bool = Field(
        False,
        description="mixtures of experts: give each tensor-parallel rank whole experts instead of a slice of each",
    )
    quantization: str | None = Field(
        None,
        description="awq, gptq, compressed-tensors, smoothquant (w8a8), weight_only_int8, gguf or none; "
        "auto-detected from the checkpoint's quantization_config (gguf for a .gguf file; none there: exact fp32)",
    )
    model_impl: Literal["auto", "kiln", "vllm", "transformers"] = Field(
        "auto",
        description="'auto'/'kiln' (vLLM's 'vllm'): Kiln's own model classes; 'transformers': any decoder "
        "transformers runs, through Kiln's scheduler, KV cache and attention (slower; one rank, unquantized)",
    )
    trust_remote_code: bool = False
    revision: str | None = Field(None, description="the Hub revision (branch, tag or commit) of a repo-id model")
    tokenizer_revision: str | None = Field(None, description="the Hub revision of a repo-id --tokenizer")
    code_revision: str | None = Field(
        None, description="accepted only equal to --revision: remote code runs from the model's snapshot"
    )
    download_dir: str | None = Field(None, description="the Hugging Face cache for repo ids (default: HF_HUB_CACHE)")
    task: Literal["auto", "generate", "embed", "score", "classify", "reward"] = Field(
        "auto",
        description="what the model serves; auto: generate for *ForCausalLM, embed for encoders, "
        "score/classify for *ForSequenceClassification",
    )
    runner: Literal["auto", "generate", "pooling"] = Field("auto", description="vLLM's newer spelling of --task")
    convert: Literal["auto", "none", "embed", "classify", "reward"] = Field(
        "auto", description="with --runner pooling: serve the model as this pooling task"
    )
    hf_overrides: dict[str, Any] | None = Field(
        None, description="JSON set on the model's Hugging Face config, e.g. '{\"max_position_embeddings\": 4096}'"
    )
    rope_scaling: dict[str, Any] | None = Field(
        None, description='JSON rope scaling, e.g. \'{"rope_type": "yarn", "factor": 4.0}\''
    )
    rope_theta: float | None = Field(None, gt=0, description="the rope base frequency, over the model's")
    enable_lora: bool = Field(False, description="serve LoRA adapters (--lora-modules, or per request)")
    max_loras: int = Field(1, ge=1, description="LoRA adapters in one batch")
    max_lora_rank: int = Field(16, ge=1, description="the largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA adapters kept loaded in host memory, least recently used out (>= --max-loras)"
    )
    lora_dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto", description="dtype of the LoRA weights; auto: the model's"
    )
    enable_lora_bias: bool = Field(False, description="allow adapters with a bias on lora_B (PEFT's lora_bias)")
    fully_sharded_loras: bool = Field(
        False, description="shard LoRA's A as well under tensor parallelism (refused there; nothing to shard on 1 rank)"
    )
    lora_extra_vocab_size: int = Field(
        256, ge=0, description="accepted at vLLM's default only: adapters that add tokens are refused"
    )
    long_lora_scaling_factors: list[float] | None = Field(None, description="LongLoRA: refused (not supported)")
    override_pooler_config: dict[str, Any] | None = Field(
        None, description='JSON pooling over the model\'s, e.g. \'{"pooling_type": "MEAN", "normalize": true}\''
    )
    limit_mm_per_prompt: dict[str, int] | None = Field(
        None, description="JSON images/videos/audios per prompt, e.g. '{\"image\": 0}': Kiln serves text, so 0 only"
    )

    @field_validator("quantization")
    @classmethod
    def _known_method(cls, value: str | None) -> str | None:
        from kiln.quantization.config import normalize_flag

        normalize_flag(value)
        return value

    @field_validator("override_pooler_config", mode="before")
    @classmethod
    def _pooler_overrides(cls, value: object) -> object:
        from kiln.pooling_params import parse_pooler_overrides

        return parse_pooler_overrides(value)

    @field_validator("hf_overrides", "rope_scaling", "speculative_config", mode="before")
    @classmethod
    def _json_object(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON ({exc})") from None
        if value is not None and not isinstance(value, (dict, BaseModel)):  # BaseModel: a SpeculativeConfig
            raise ValueError("must be a JSON object")
        return value

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _text_only(cls, value: object) -> object:
        if isinstance(value, str) and not value.lstrip().startswith("{"):  # vLLM's older image=2,video=1
            pairs = [item.partition("=") for item in value.split(",")]
            if not all(sep and key.strip() for key, sep, _ in pairs):
                raise ValueError("give a JSON object such as '{\"image\": 0}' (or image=0)")
            value = {key.strip(): number.strip() for key, _, number in pairs}
        value = cls._json_object(value)
        if isinstance(value, dict):
            # vLLM's newer form gives a medium options: {"video": {"count": 1, "num_frames": 32}}
            media = [k for k, v in value.items() if str(v.get("count") if isinstance(v, dict) else v).strip() != "0"]
            if media:
                raise ValueError(
                    f"Kiln serves text only ({', '.join(map(repr, media))} inputs are not supported): a multimodal "
                    "release serves its text model, so every limit must be 0"
                )
            value = {k: 0 for k in value}
        return value

    @field_validator("tokenizer_mode")
    @classmethod
    def _no_slow_tokenizers(cls, value: str) -> str:
        if value == "slow":
            raise ValueError(
                "slow is not supported: transformers 5 has no slow (Python) tokenizers, its AutoTokenizer ignores "
                "use_fast; --tokenizer-mode auto loads the same tokenizer"
            )
        return value

    @model_validator(mode="after")
    def _lora_flags(self) -> EngineConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})")
        if self.lora_extra_vocab_size != 256:
            raise ValueError(
                "--lora-extra-vocab-size: adapters that add tokens to the vocabulary are not supported (Kiln "
                "serves adapters over the base model's vocabulary); leave it at its default"
            )
        if self.long_lora_scaling_factors:
            raise ValueError(
                "--long-lora-scaling-factors: LongLoRA adapters (scaled rotary contexts per adapter) are not supported"
            )
        if self.fully_sharded_loras and self.tensor_parallel_size > 1:
            raise ValueError(
                "--fully-sharded-loras: Kiln shards LoRA's B over column-parallel layers and A over row-parallel ones "
                "(vLLM's default split); sharding both is not implemented, drop the flag"
            )
        return self

    @model_validator(mode="after")
    def _multi_step(self) -> EngineConfig:
        if self.num_scheduler_steps > 1 and self.speculative_config is not None:
            raise ValueError(
                "--num-scheduler-steps: multi-step scheduling runs one token a step, speculative decoding several; "
                "use one or the other"
            )
        return self

    @model_validator(mode="after")
    def _one_code_revision(self) -> EngineConfig:
        if self.code_revision is not None and self.code_revision != (self.revision or "main"):
            raise ValueError(
                "--code-revision: remote code runs from the model's --revision snapshot; "
                f"a different code revision ({self.code_revision!r}) is not supported"
            )
        return self

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int | None) -> int | None:
        if value is not None and (value < 1 or value & (value - 1)):
            raise ValueError("must be a power of two")
        return value

    @property
    def max_decode_rows(self) -> int:
        """The most decode rows one step may hold: ``max_num_seqs``, each with its drafts under
        speculative decoding (a draft is a decode row of its own)."""
        spec = self.speculative_config
        return self.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))

    @classmethod
    def create(cls, **kwargs: object) -> EngineConfig:
        """Build a config; a bad value raises ``ValueError`` naming the flag (``--block-size: ...``)."""
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            raise ValueError(format_validation_error(exc)) from None


def format_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if p != "__root__"]
        flag = "--" + loc[0].replace("_", "-") if loc else "config"
        msg = err["msg"].removeprefix("Value error, ")
        keys = [p for p in loc[1:] if not p.isdigit()]  # a key inside a JSON flag (--speculative-config)
        if keys:
            msg = f"{'.'.join(keys)}: {msg}"
        parts.append(f"{flag}: {msg} (got {err.get('input')!r})" if loc else msg)
    return "; ".join(parts)
