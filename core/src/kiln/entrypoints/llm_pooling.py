"""``LLM``'s pooling methods, with vLLM's signatures: ``encode``, ``embed``, ``classify``, ``reward``
and ``score``. The served model's ``--task`` decides which apply (a generation model refuses
them all, naming the flag)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kiln.entrypoints.scoring import ScorePlan, pair_up
from kiln.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from kiln.pooling_params import PoolingParams

if TYPE_CHECKING:
    from kiln.engine.llm_engine import LLMEngine, PromptInput

Params = PoolingParams | Sequence[PoolingParams] | None


class PoolingMixin:
    """Mixed into ``LLM``, whose ``_submit`` queues requests and ``_run`` steps them to the end."""

    engine: LLMEngine

    def encode(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: Params = None,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """The model's pooled output per prompt, in order (``.outputs.data``: a float32 tensor)."""
        return self._pool(prompts, pooling_params, truncate_prompt_tokens, "encode")

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        truncate_prompt_tokens: int | None = None,
        pooling_params: Params = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``.outputs.embedding``), for a model served with ``--task embed``."""
        outputs = self._pool(prompts, pooling_params, truncate_prompt_tokens, "embed")
        return [EmbeddingRequestOutput.from_base(out) for out in outputs]

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        truncate_prompt_tokens: int | None = None,
        pooling_params: Params = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``.outputs.probs``), for ``--task classify`` (or score)."""
        outputs = self._pool(prompts, pooling_params, truncate_prompt_tokens, "classify")
        return [ClassificationRequestOutput.from_base(out) for out in outputs]

    def reward(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        truncate_prompt_tokens: int | None = None,
        pooling_params: Params = None,
    ) -> list[PoolingRequestOutput]:
        """Every token's hidden state per prompt, for ``--task reward``."""
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of ``data_1`` against ``data_2`` (1-to-1, 1-to-N or N-to-N; see
        ``kiln.entrypoints.scoring``), one output per pair, in order."""
        info = self.engine.model_info
        pairs = pair_up(data_1, data_2, ("data_1", "data_2"))
        similarity = self.engine.input_processor.info.pooler.similarity if info.task != "generate" else "cosine"
        plan = ScorePlan(pairs, info.task, info.tokenizer, truncate_prompt_tokens, info.max_model_len, similarity)
        # Cross-encoder pairs come truncated (both texts cut, longest first); texts truncate as usual.
        truncate = truncate_prompt_tokens if plan.task == "embed" else None
        return plan.results(self._pool(plan.prompts, pooling_params, truncate, plan.task))

    def _pool(
        self, prompts: PromptInput | Sequence[PromptInput], params: Params, truncate: int | None, task: str
    ) -> list[PoolingRequestOutput]:
        def fill(p: PoolingParams) -> PoolingParams:
            return replace(
                p, task=task, truncate_prompt_tokens=p.truncate_prompt_tokens if truncate is None else truncate
            )

        if params is None:
            params = PoolingParams()
        params = [fill(p) for p in params] if isinstance(params, (list, tuple)) else fill(params)
        return self._run(self._submit(prompts, params, "pooling_params"))
