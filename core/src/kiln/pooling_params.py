"""Per-request pooling parameters (vLLM's names), and which requests a model's task serves.

A pooling request is prefill-only: the engine computes its prompt once and returns a
pooled vector (an embedding, class probabilities or per-token states) instead of
sampling. ``PoolingParams`` is to it what ``SamplingParams`` is to generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

# --task values (vLLM's). "auto" picks one from the architecture (kiln.models.pooler.resolve_task).
TASKS = ("auto", "generate", "embed", "score", "classify", "reward")
POOLING_TASKS = ("embed", "score", "classify", "reward")
# What a request may ask for: "encode" is the model's own pooled output, whatever its task.
REQUEST_TASKS = ("embed", "classify", "score", "encode")
# The pooled output each model task computes ("score" models are classifiers: cross-encoders).
HEADS = {"embed": "embed", "score": "classify", "classify": "classify", "reward": "reward"}


@dataclass(slots=True)
class PoolingParams:
    """What to return for a pooling request. Invalid values raise ``ValueError`` naming the field.

    ``None`` means the model's default (its pooler config: the sentence-transformers files in
    its folder, the architecture's default, then ``--override-pooler-config``).
    """

    dimensions: int | None = None  # matryoshka: keep the first ``dimensions`` values (then normalise)
    normalize: bool | None = None  # embeddings: L2-normalise
    use_activation: bool | None = None  # classify/score: softmax over labels (sigmoid for one label)
    truncate_prompt_tokens: int | None = None  # keep this many prompt tokens; -1: max_model_len
    task: str | None = None  # one of REQUEST_TASKS; None: what the model serves
    # Filled by the engine: the pooled output to compute ("embed" | "classify" | "reward") and how.
    head: str | None = None
    pooling_type: str | None = None  # LAST | MEAN | CLS | ALL

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {value!r}.")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1
        ):
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}.")
        if self.task is not None and self.task not in REQUEST_TASKS:
            raise ValueError(f"task must be one of {', '.join(REQUEST_TASKS)}, got {self.task!r}.")


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How the served model pools; requests may override ``normalize``, ``dimensions`` and
    ``use_activation`` (``PoolingParams``)."""

    pooling_type: str = "LAST"  # LAST | MEAN | CLS | ALL (every token's state: reward)
    normalize: bool = True
    use_activation: bool = True
    dimensions: int | None = None
    similarity: str = "cosine"  # score on an embedding model: cosine | dot


def check_task(model_task: str, params: object) -> None:
    """Refuse a request the served model's task cannot answer, naming the task and ``--task``."""
    if isinstance(params, PoolingParams):
        if model_task == "generate":
            raise ValueError(
                "--task generate: the model is served for text generation, not pooling; "
                "start it with --task embed (or classify, score, reward) for embeddings, scores and classes"
            )
        wanted = params.task
        if wanted in (None, "encode"):
            return
        if (wanted == "embed") != (HEADS[model_task] == "embed") or HEADS[model_task] == "reward":
            raise ValueError(
                f"--task {model_task}: the model is served for the {model_task} task and cannot answer "
                f"{wanted} requests; start it with --task {'embed' if wanted == 'embed' else 'classify'}"
            )
    elif model_task != "generate":
        raise ValueError(
            f"--task {model_task}: the model is served for the {model_task} task, not text generation; "
            "completions, chat and /generate need --task generate"
        )


POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
_OVERRIDE_ALIASES = {"softmax": "use_activation", "activation": "use_activation"}  # vLLM's older names


def parse_pooler_overrides(value: object) -> dict | None:
    """``--override-pooler-config`` (JSON text or a mapping) as ``PoolerConfig`` fields; ``ValueError``
    says what is wrong. Keys: pooling_type (LAST, MEAN, CLS, ALL), normalize, dimensions,
    use_activation (or softmax / activation)."""
    import json

    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    known = ("pooling_type", "normalize", "dimensions", "use_activation", *_OVERRIDE_ALIASES)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: {', '.join(known)}")
    out: dict = {}
    for key, given in value.items():
        field = _OVERRIDE_ALIASES.get(key, key)
        if field == "pooling_type":
            if str(given).upper() not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {given!r}")
            given = str(given).upper()
        elif field == "dimensions":
            if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
                raise ValueError(f"dimensions must be a positive integer, got {given!r}")
        elif not isinstance(given, bool):
            raise ValueError(f"{key} must be true or false, got {given!r}")
        out[field] = given
    return out
