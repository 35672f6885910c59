"""Kiln: an LLM serving engine with a hardware-agnostic core and device plugins.

``import kiln`` stays light (plugins import it for ``hookimpl``); the engine and
torch load on first use of ``LLM`` and friends.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kiln.hookspecs import hookimpl

if TYPE_CHECKING:
    from kiln.config import EngineConfig
    from kiln.entrypoints.llm import LLM
    from kiln.lora.request import LoRARequest
    from kiln.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from kiln.pooling_outputs import (
        ClassificationRequestOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        ScoringRequestOutput,
    )
    from kiln.pooling_params import PoolingParams
    from kiln.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kiln.entrypoints.llm",
    "EngineConfig": "kiln.config",
    "LoRARequest": "kiln.lora.request",
    "BeamSearchOutput": "kiln.outputs",
    "BeamSearchParams": "kiln.sampling_params",
    "CompletionOutput": "kiln.outputs",
    "Logprob": "kiln.outputs",
    "RequestMetrics": "kiln.outputs",
    "RequestOutput": "kiln.outputs",
    "RequestOutputKind": "kiln.sampling_params",
    "SamplingParams": "kiln.sampling_params",
    "PoolingParams": "kiln.pooling_params",
    "PoolingRequestOutput": "kiln.pooling_outputs",
    "EmbeddingRequestOutput": "kiln.pooling_outputs",
    "ClassificationRequestOutput": "kiln.pooling_outputs",
    "ScoringRequestOutput": "kiln.pooling_outputs",
}

__all__ = ["hookimpl", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
