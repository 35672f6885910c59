"""``ModelInfo``: what the front end and the input processor need to know about the served
model, and nothing of the engine's internals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ModelInfo:
    name: str  # the default served name
    path: str  # the resolved local Hugging Face folder
    tokenizer: Any  # a transformers tokenizer
    vocab_size: int  # the logits' width (may exceed len(tokenizer))
    max_model_len: int
    max_num_seqs: int
    eos_token_ids: frozenset[int]
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # generation_config.json, as SamplingParams
    dtype: str = "auto"  # the resolved weights dtype, e.g. "float32"
    quantization: str | None = None
    task: str = "generate"  # --task, resolved: generate, or a pooling task (embed, score, classify, reward)
