"""The pooling endpoints, in vLLM's shapes: ``/v1/embeddings``, ``/pooling``, ``/score`` (and
``/v1/score``), ``/rerank`` (and ``/v1/rerank``, ``/v2/rerank``) and ``/classify``.

Each needs a model served for one of its tasks (``ENDPOINT_TASKS``); otherwise a 400 names the
served task and ``--task``. Scores come from a cross-encoder, or from embedding similarity on an
embedding model (``kiln.entrypoints.scoring``).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

import numpy as np
from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from kiln.engine.pooling import encode_text, truncation_limit
from kiln.entrypoints.openai.protocol import APIError
from kiln.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from kiln.entrypoints.openai.serving import OpenAIServing, Prompt, error_message, new_id, now
from kiln.entrypoints.scoring import ScorePlan, pair_up
from kiln.interfaces.tokenizer import is_mistral
from kiln.pooling_params import PoolingParams

if TYPE_CHECKING:
    from kiln.engine.async_engine import AsyncEngine
    from kiln.entrypoints.openai.metrics import ServerMetrics
    from kiln.entrypoints.openai.serving import ServerOptions
    from kiln.entrypoints.openai.serving_chat import ChatServing
    from kiln.pooling_outputs import PoolingRequestOutput

ENDPOINT_TASKS = {
    "/v1/embeddings": ("embed",),
    "/pooling": ("embed", "score", "classify", "reward"),
    "/score": ("embed", "score", "classify"),
    "/rerank": ("embed", "score", "classify"),
    "/classify": ("classify", "score"),
}


class PoolingServing(OpenAIServing):
    def __init__(self, engine: AsyncEngine, options: ServerOptions, metrics: ServerMetrics, chat: ChatServing) -> None:
        super().__init__(engine, options, metrics, chat.models)
        self.chat = chat  # renders the chat form of /v1/embeddings and /pooling

    # ------------------------------------------------------------ endpoints
    async def embeddings(self, req: EmbeddingRequest, raw: HTTPRequest) -> dict:
        self.check_request(req.model, "/v1/embeddings")
        params = self.params(req, task="embed", dimensions=req.dimensions, normalize=req.normalize)
        outs = await self.run(new_id("embd", req.request_id), self.inputs(req), params, req, raw, "input")
        data = [
            {"index": i, "object": "embedding", "embedding": encode(out.outputs.data, req.encoding_format)}
            for i, out in enumerate(outs)
        ]
        return self.response(outs, data, "embd")

    async def pooling(self, req: PoolingRequest, raw: HTTPRequest) -> dict:
        self.check_request(req.model, "/pooling")
        params = self.params(
            req, dimensions=req.dimensions, normalize=req.normalize, use_activation=req.activation_flag()
        )
        outs = await self.run(new_id("pool", req.request_id), self.inputs(req), params, req, raw, "input")
        data = [
            {"index": i, "object": "pooling", "data": encode(out.outputs.data, req.encoding_format)}
            for i, out in enumerate(outs)
        ]
        return self.response(outs, data, "pool")

    async def classify(self, req: ClassificationRequest, raw: HTTPRequest) -> dict:
        self.check_request(req.model, "/classify")
        params = self.params(req, task="classify", use_activation=req.activation_flag())
        outs = await self.run(new_id("classify", req.request_id), self.inputs(req), params, req, raw, "input")
        labels = self.engine.input_processor.info.labels
        data = []
        for i, out in enumerate(outs):
            probs = out.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            label = labels[best] if best < len(labels) else f"LABEL_{best}"
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        return self.response(outs, data, "classify")

    async def score(self, req: ScoreRequest, raw: HTTPRequest) -> dict:
        self.check_request(req.model, "/score")
        pairs = self.pairs(req.text_1, req.text_2, ("text_1", "text_2"))
        scores, outs = await self.scores(pairs, req, raw, "text_1")
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return self.response(outs, data, "score")

    async def rerank(self, req: RerankRequest, raw: HTTPRequest) -> dict:
        self.check_request(req.model, "/rerank")
        documents = req.document_texts()
        if not documents:
            raise APIError("documents: must not be empty", param="documents")
        scores, outs = await self.scores(self.pairs(req.query, documents, ("query", "documents")), req, raw, "query")
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        results = []
        for i in order[: req.top_n or None]:
            result = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        usage = self.pool_usage(outs)
        return {
            "id": new_id("rerank", req.request_id),
            "model": self.model_name,
            "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]},
            "results": results,
        }

    # ------------------------------------------------------------ shared
    def check_request(self, model: str | None, endpoint: str) -> None:
        """The model exists, is not a LoRA adapter, and is served for a task ``endpoint`` answers."""
        if self.check_model(model) is not None:
            raise APIError(
                f"model: {model!r} is a LoRA adapter; LoRA adapters apply to generation, not to {endpoint}",
                param="model",
            )
        allowed, task = ENDPOINT_TASKS[endpoint], self.model.task
        if task not in allowed:
            served = "text generation" if task == "generate" else f"the {task} task"
            raise APIError(
                f"--task {task}: the model is served for {served}; {endpoint} needs a model served with "
                f"--task {' or --task '.join(allowed)}"
            )

    def params(self, req, **values) -> PoolingParams:
        """The request's ``PoolingParams`` (its ``truncate_prompt_tokens`` cuts token-id inputs in the
        engine; texts are cut as they are tokenized)."""
        try:
            params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, **values)
            self.engine.input_processor.resolve(params)  # checked against the model before tokenizing
            return params
        except ValueError as exc:
            raise error_message(exc) from None

    def pairs(self, first, second, names: tuple[str, str]) -> list[tuple[str, str]]:
        try:
            return pair_up(first, second, names)
        except ValueError as exc:
            raise error_message(exc) from None

    def inputs(self, req: EmbeddingRequest | ClassificationRequest) -> list[Prompt]:
        """The request's prompts: its ``input`` items (texts or token ids), or its rendered ``messages``."""
        truncate, limit = req.truncate_prompt_tokens, self.max_model_len
        messages = getattr(req, "messages", None)
        if (req.input is None) == (messages is None):
            raise APIError("give exactly one of input and messages", param="input")
        if messages is not None:
            prompt = self.chat.render(req, bool(req.add_special_tokens))
            if truncation_limit(truncate, limit) is None or is_mistral(self.tokenizer):
                # mistral_common's ids come from the conversation, not from a text to cut: the engine
                # keeps their tail, as it does any token ids (and as vLLM does).
                return [prompt]
            return [
                Prompt(
                    prompt.text, encode_text(self.tokenizer, prompt.text, truncate, limit, bool(req.add_special_tokens))
                )
            ]
        given = req.input
        items = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)
        if not items or any(len(item) == 0 for item in items):
            raise APIError("input: must not be empty (nor hold an empty text or token list)", param="input")
        add = req.add_special_tokens is not False
        return [
            Prompt(item, encode_text(self.tokenizer, item, truncate, limit, add))
            if isinstance(item, str)
            else Prompt(None, list(item))
            for item in items
        ]

    async def scores(
        self, pairs: list[tuple[str, str]], req: ScoreRequest | RerankRequest, raw: HTTPRequest, field: str
    ) -> tuple[list[float], list[PoolingRequestOutput]]:
        """Each pair's score, and the outputs of the requests that computed them."""
        info = self.engine.input_processor.info
        truncate = req.truncate_prompt_tokens
        try:
            plan = ScorePlan(
                pairs, self.model.task, self.tokenizer, truncate, self.max_model_len, info.pooler.similarity
            )
        except ValueError as exc:  # truncate_prompt_tokens past the context
            raise error_message(exc) from None
        params = self.params(req, task=plan.task, use_activation=req.activation_flag())
        if plan.task == "embed":
            prompts = [Prompt(t, encode_text(self.tokenizer, t, truncate, self.max_model_len)) for t in plan.prompts]
        else:
            prompts = [Prompt(None, p["prompt_token_ids"], p.get("token_type_ids")) for p in plan.prompts]
        outs = await self.run(new_id("score", req.request_id), prompts, params, req, raw, field)
        try:
            return [r.outputs.score for r in plan.results(outs)], outs
        except ValueError as exc:
            raise error_message(exc) from None

    async def run(
        self, request_id: str, prompts: list[Prompt], params: PoolingParams, req, raw: HTTPRequest, field: str
    ) -> list[PoolingRequestOutput]:
        """Run one pooling request per prompt; their outputs, in order. ``field`` is the request field
        the prompts came from: errors about a prompt name it."""
        for prompt in prompts:
            if params.truncate_prompt_tokens is None and len(prompt.token_ids) > self.max_model_len:
                raise APIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{len(prompt.token_ids)} tokens in the input. Please reduce the length of the input "
                    "or set truncate_prompt_tokens.",
                    param=field,
                )
        try:
            streams = self.start(request_id, [(prompt, params) for prompt in prompts], req.priority)
        except APIError as exc:
            if exc.param == "prompt":
                exc.param = field
            raise
        return await self.final_outputs(streams, raw)

    def observe_finished(self, out: PoolingRequestOutput, model_name: str | None = None) -> None:
        m, name = self.metrics, self.model_name
        m.finished.labels(name, "stop").inc()
        m.prompt_len.labels(name).observe(len(out.prompt_token_ids))
        if out.metrics is not None and out.metrics.finished_time is not None:
            m.e2e.labels(name).observe(out.metrics.finished_time - out.metrics.arrival_time)

    def pool_usage(self, outs: list[PoolingRequestOutput]) -> dict:
        tokens = sum(len(out.prompt_token_ids) for out in outs)
        return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}

    def response(self, outs: list[PoolingRequestOutput], data: list[dict], prefix: str) -> dict:
        return {
            "id": new_id(prefix),
            "object": "list",
            "created": now(),
            "model": self.model_name,
            "data": data,
            "usage": self.pool_usage(outs),
        }


def encode(data, encoding_format: str):
    """A pooled tensor as JSON floats, or as base64 of its little-endian float32 bytes (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(data.numpy(), dtype="<f4").tobytes()).decode("ascii")
    return data.tolist()


def add_routes(app: FastAPI, serving: PoolingServing) -> None:
    """The pooling endpoints on ``app`` (routes take the app's ``ValidatedJSONRoute``)."""

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw: HTTPRequest):
        return await serving.embeddings(body, raw)

    @app.post("/pooling")
    async def create_pooling(body: PoolingRequest, raw: HTTPRequest):
        return await serving.pooling(body, raw)

    @app.post("/classify")
    async def create_classify(body: ClassificationRequest, raw: HTTPRequest):
        return await serving.classify(body, raw)

    async def create_score(body: ScoreRequest, raw: HTTPRequest):
        return await serving.score(body, raw)

    async def do_rerank(body: RerankRequest, raw: HTTPRequest):
        return await serving.rerank(body, raw)

    for path in ("/score", "/v1/score"):
        app.post(path)(create_score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(do_rerank)
