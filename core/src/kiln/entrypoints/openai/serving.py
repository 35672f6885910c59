"""What the completion and chat endpoints share: the served model, sampling parameters, prompts,
logprobs, usage, and the plumbing between engine streams and HTTP responses."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HTTPRequest

import kiln
from kiln.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, RequestStream
from kiln.engine.model_info import ModelInfo
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.entrypoints.openai.protocol import APIError, SamplingFields
from kiln.entrypoints.openai.serving_models import ServingModels
from kiln.entrypoints.openai.structured_outputs import request_constraint
from kiln.interfaces.guided import GuidedDecodingParams
from kiln.lora.request import LoRARequest
from kiln.outputs import PositionLogprobs, RequestOutput
from kiln.sampling_params import SAMPLING_SHAPERS, RequestOutputKind, SamplingParams

logger = logging.getLogger("kiln.server")


# Constraint compiles get threads of their own: a burst of slow ones (each bounded by
# KILN_GUIDED_COMPILE_TIMEOUT_S) then waits here instead of holding every thread of asyncio's
# default pool, which chat rendering uses; past MAX_PENDING_COMPILES waiting, a 503.
_COMPILE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kiln-guided-compile")
MAX_PENDING_COMPILES = 64
_compiles_pending = 0  # read and written on the event loop only


@dataclass
class ServerOptions:
    """The server flags the endpoints read (the rest configure uvicorn and the app)."""

    served_model_names: list[str]
    response_role: str = "assistant"
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    trust_request_chat_template: bool = False  # accept chat_template (and overrides) from requests
    enable_prompt_tokens_details: bool = False
    return_tokens_as_token_ids: bool = False
    disable_log_requests: bool = False
    max_log_len: int | None = None
    generation_overrides: dict[str, Any] = field(default_factory=dict)
    tool_parser: type | None = None  # a ToolParser subclass (--tool-call-parser)
    enable_auto_tool_choice: bool = False
    reasoning_parser: type | None = None  # a ReasoningParser subclass (--reasoning-parser)


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # a cross-encoder pair's segment ids (pooling)


def system_fingerprint(model: ModelInfo) -> str:
    """OpenAI's ``system_fingerprint``: ``fp_`` and a hash of what decides the outputs (Kiln's version,
    the model folder, dtype and quantization), so one server build of one model always sends the same."""
    build = "|".join(map(str, (kiln.__version__, model.path, model.dtype, model.quantization)))
    return "fp_" + hashlib.sha256(build.encode()).hexdigest()[:12]


def error_message(exc: ValueError) -> APIError:
    """Engine and ``SamplingParams`` errors start with the field name: keep it as ``param``."""
    message = str(exc)
    head = message.split(":", 1)[0].split(" ", 1)[0]
    return APIError(message, param=head if head.isidentifier() else None)


class OpenAIServing:
    def __init__(
        self, engine: AsyncEngine, options: ServerOptions, metrics: ServerMetrics, models: ServingModels | None = None
    ) -> None:
        self.engine = engine
        self.models = models if models is not None else ServingModels(engine, options.served_model_names)
        self.model = engine.model_info
        self.tokenizer = self.model.tokenizer
        self.options = options
        self.metrics = metrics
        self.max_model_len = self.model.max_model_len
        self.model_name = options.served_model_names[0]
        self.system_fingerprint = system_fingerprint(self.model)

    # ------------------------------------------------------------ validation
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model); an unknown name is a 404."""
        return self.models.check_model(model)

    async def resolve_model(self, model: str | None) -> LoRARequest | None:
        """``check_model``, with the adapter read (if it is not still held or cached) off the event
        loop, so that queueing the request finds it read."""
        lora = self.check_model(model)
        if lora is not None:
            try:
                await asyncio.to_thread(self.engine.add_lora, lora)
            except ValueError as exc:  # its folder changed since it was loaded
                raise APIError(str(exc), param="model") from None
        return lora

    def check_unsupported(self, req: SamplingFields) -> None:
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options: only allowed when stream is true", param="stream_options")
        best_of = req.best_of or req.n
        if req.stream and best_of > req.n:
            raise APIError("best_of: values above n are not supported when streaming", param="best_of")

    def guided_params(self, req: SamplingFields) -> GuidedDecodingParams | None:
        """The request's constraint (``structured_outputs``, ``guided_*`` or ``response_format``)."""
        try:
            return request_constraint(req)
        except ValueError as exc:
            raise error_message(exc) from None

    async def compile_guide(self, params: SamplingParams) -> None:
        """Compile the constraint off the event loop (and off the engine loop): the request waits,
        everything else goes on. Later lookups hit the cache; errors become a 400."""
        if params.guided_decoding is None:
            return
        global _compiles_pending
        if _compiles_pending >= MAX_PENDING_COMPILES:
            raise APIError(
                f"guided decoding: {_compiles_pending} constraints are already compiling; retry later",
                status=503,
                headers={"Retry-After": "1"},
            )
        _compiles_pending += 1
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(_COMPILE_POOL, self.engine.input_processor.compile_guide, params)
        except ValueError as exc:
            raise error_message(exc) from None
        finally:
            _compiles_pending -= 1

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def truncate(self, prompt: Prompt, req: SamplingFields) -> Prompt:
        k = req.truncate_prompt_tokens
        if k is not None and len(prompt.token_ids) > k:
            return Prompt(None, prompt.token_ids[-k:])
        return prompt

    def sampling_params(
        self,
        req: SamplingFields,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
    ) -> SamplingParams:
        """The request's ``SamplingParams`` over the model's generation defaults and the server overrides."""
        if prompt_len >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input.",
                param="prompt",
            )
        room = self.max_model_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} in the completion). "
                "Please reduce the length of the input or the completion.",
                param="max_tokens",
            )
        given = {
            "n": req.n,
            "best_of": req.best_of,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "seed": req.seed,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "bad_words": req.bad_words,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "ignore_eos": req.ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": req.min_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "skip_special_tokens": req.skip_special_tokens,
            "spaces_between_special_tokens": req.spaces_between_special_tokens,
            "logit_bias": req.logit_bias or None,
            "allowed_token_ids": req.allowed_token_ids,
            "truncate_prompt_tokens": req.truncate_prompt_tokens,
            "use_beam_search": req.use_beam_search,
            "length_penalty": req.length_penalty,
            "early_stopping": req.early_stopping,
        }
        values = {**self.model.generation_defaults, **self.options.generation_overrides}
        if req.use_beam_search:  # beams follow the model's own distribution (see SamplingParams)
            values = {k: v for k, v in values.items() if k not in SAMPLING_SHAPERS}
        values.update({k: v for k, v in given.items() if v is not None})
        values["max_tokens"] = min(values.get("max_tokens") or room, room) if max_tokens is None else max_tokens
        values["output_kind"] = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        values["guided_decoding"] = self.guided_params(req)
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise error_message(exc) from None

    # ------------------------------------------------------------- streams
    def start(
        self,
        request_id: str,
        items: Sequence[tuple[Prompt, SamplingParams]],
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """Queue one engine request per prompt (on adapter ``lora``, if given); if any is refused,
        none stays queued."""
        streams: list[RequestStream] = []
        try:
            for i, (prompt, params) in enumerate(items):
                rid = request_id if len(items) == 1 else f"{request_id}-{i}"
                inputs = {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
                if prompt.token_type_ids is not None:
                    inputs["token_type_ids"] = prompt.token_type_ids
                streams.append(self.engine.add_request(rid, inputs, params, priority=priority, lora_request=lora))
                self.log_request(rid, prompt, params, lora)
        except (ValueError, EngineDeadError, EngineOverloadedError) as exc:
            for stream in streams:
                stream.close()
            if isinstance(exc, EngineOverloadedError):
                self.metrics.observe_rejected("overloaded", self.models.model_name(lora))
                raise APIError(str(exc), status=503, headers={"Retry-After": "1"}) from None
            if isinstance(exc, EngineDeadError):
                raise APIError(str(exc), status=503) from None
            raise error_message(exc) from None
        return streams

    def log_request(self, request_id: str, prompt: Prompt, params: SamplingParams, lora: LoRARequest | None) -> None:
        if self.options.disable_log_requests:
            return
        limit = self.options.max_log_len
        text = prompt.text if prompt.text is None or limit is None else prompt.text[:limit]
        ids = prompt.token_ids if limit is None else prompt.token_ids[:limit]
        adapter = "" if lora is None else f", lora_request={lora}"
        logger.info("request %s: prompt=%r, prompt_token_ids=%s, params=%s%s", request_id, text, ids, params, adapter)

    async def merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several streams as they come, tagged with the stream's index."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
            except BaseException as exc:
                await queue.put((i, exc))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    async def final_outputs(
        self, streams: list[RequestStream], raw: HTTPRequest, model_name: str | None = None
    ) -> list[RequestOutput]:
        """Wait for every stream's final output; a client that goes away aborts them. ``model_name``
        labels the metrics (default: the first served name)."""
        results: list[RequestOutput | None] = [None] * len(streams)

        async def collect() -> None:
            async for i, out in self.merged(streams):
                results[i] = out

        task = asyncio.ensure_future(collect())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    task.result()
                    break
                if await raw.is_disconnected():
                    task.cancel()
                    raise asyncio.CancelledError("client disconnected")
        except EngineDeadError as exc:
            raise APIError(str(exc), status=503) from None
        finally:
            for stream in streams:
                stream.close()
        for out in results:
            self.observe_finished(out, model_name)
        return results

    def observe_finished(self, out: RequestOutput, model_name: str | None = None) -> None:
        """Record a finished request in the metrics (pooling endpoints record theirs differently)."""
        self.metrics.observe_finished(out, [len(c.token_ids) for c in out.outputs], model_name)

    # ------------------------------------------------------------- formats
    def tokens_as_ids(self, req: SamplingFields) -> bool:
        flag = req.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids if flag is None else flag

    def token_str(self, token_id: int, decoded: str | None, as_ids: bool) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        return decoded if decoded is not None else self.tokenizer.decode([token_id])

    def usage(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None
    ) -> dict:
        """OpenAI's usage; ``reasoning_tokens`` (given where a reasoning parser reads the output) goes
        in ``completion_tokens_details``."""
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if self.options.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    def top_entries(self, position: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
        ranked = sorted(((tid, lp) for tid, lp in position.items() if lp.rank is not None), key=lambda e: e[1].rank)
        return [(tid, lp) for tid, lp in ranked if lp.rank <= k]

    def prompt_logprobs_json(self, out: RequestOutput) -> list | None:
        if out.prompt_logprobs is None:
            return None
        return [
            None
            if position is None
            else {
                str(t): {"logprob": self.clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in position.items()
            }
            for position in out.prompt_logprobs
        ]

    @staticmethod
    def clamp(logprob: float) -> float:
        return max(logprob, -9999.0)  # JSON has no -inf


def new_id(prefix: str, given: str | None = None) -> str:
    return given or f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def now() -> int:
    return int(time.time())
