"""Scores of text pairs, shared by ``LLM.score`` and the ``/score`` and ``/rerank`` endpoints.

Pairs follow vLLM: one first text against one second (1-to-1), one against each of N
(1-to-N), or N against N, in order. A cross-encoder (``--task score``/``classify``) reads
each pair together (``kiln.engine.pooling.tokenize_pair``) and its one-label head gives the
score; an embedding model (``--task embed``) embeds both texts and the score is their
similarity (cosine, or dot where the model's sentence-transformers config says so).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kiln.engine.pooling import tokenize_pair
from kiln.pooling_outputs import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput


def pair_up(first: str | Sequence[str], second: str | Sequence[str], names: tuple[str, str]) -> list[tuple[str, str]]:
    """The (first, second) pairs to score; ``ValueError`` naming the field when they do not pair."""
    a = [first] if isinstance(first, str) else list(first)
    b = [second] if isinstance(second, str) else list(second)
    for name, texts in zip(names, (a, b)):
        if not texts:
            raise ValueError(f"{name}: must not be empty")
    if len(a) == 1:
        a = a * len(b)
    elif len(a) != len(b):
        raise ValueError(f"{names[1]}: {len(b)} texts for {len(a)} in {names[0]}; give one {names[0]} or as many")
    return list(zip(a, b))


def similarity(x: torch.Tensor, y: torch.Tensor, kind: str) -> float:
    """Two embeddings' score: ``cosine`` or ``dot``."""
    if kind == "dot":
        return float(x.double() @ y.double())
    return float(F.cosine_similarity(x.double(), y.double(), dim=0))


def cross_encoder_score(data: torch.Tensor) -> float:
    """A cross-encoder's score from its pooled output (its one label's probability or logit)."""
    if data.numel() != 1:
        raise ValueError(
            f"score: the model classifies into {data.numel()} labels; scores need a one-label cross-encoder "
            "(use /classify for its classes)"
        )
    return float(data.reshape(()))


class ScorePlan:
    """The pooling requests that score ``pairs`` on the served model, and their scores once run.

    An embedding model embeds each distinct text once (1-to-N embeds the first text once);
    a cross-encoder gets one request per pair. Run ``prompts`` as ``task`` requests (in order),
    then ``results(outputs)`` gives one ``ScoringRequestOutput`` per pair.
    """

    def __init__(
        self,
        pairs: list[tuple[str, str]],
        model_task: str,
        tokenizer,
        truncate: int | None,
        max_model_len: int,
        similarity: str = "cosine",
    ) -> None:
        self.similarity = similarity
        if model_task == "embed":
            self.task = "embed"
            self.prompts: list = list(dict.fromkeys(text for pair in pairs for text in pair))
            row = {text: i for i, text in enumerate(self.prompts)}
            self.rows = [(row[a], row[b]) for a, b in pairs]
        else:
            self.task = "score"
            self.prompts = [tokenize_pair(tokenizer, a, b, truncate, max_model_len) for a, b in pairs]
            self.rows = None

    def results(self, outputs: list[PoolingRequestOutput]) -> list[ScoringRequestOutput]:
        if self.rows is None:
            return [ScoringRequestOutput.from_score(out, cross_encoder_score(out.outputs.data)) for out in outputs]
        results = []
        for i, j in self.rows:
            a, b = outputs[i], outputs[j]
            score = similarity(a.outputs.data, b.outputs.data, self.similarity)
            pair_id, ids = f"{a.request_id}_{b.request_id}", a.prompt_token_ids + b.prompt_token_ids
            results.append(ScoringRequestOutput(pair_id, ScoringOutput(score), ids, True))
        return results
